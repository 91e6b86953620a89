package proxy

import (
	"context"
	"net"
	"syscall"
)

// A small stored blob is sent with its connection corked (TCP_CORK), so
// that its header goes out in the body's first segment, as nginx's
// tcp_nopush does. Uncorked, with TCP_NODELAY (Go's default), the header
// leaves in a packet of its own, which the kernel transmits and the client
// receives separately: a fixed cost per response that a small blob's few
// packets do not dilute.

// connKey is the context key of a connection's *connInfo.
type connKey struct{}

// connInfo is the TCP connection under a request.
type connInfo struct {
	tcp *net.TCPConn
	raw syscall.RawConn
}

// ConnContext is meant for http.Server.ConnContext (Serve sets it): it lets
// the responses on a TCP connection cork it while they send a small stored
// blob, and lets the blob loop take the connection over (see fastPath).
// Without it, each blob's header goes out in a packet of its own. Other
// connections (TLS) are left as they are.
func (s *Server) ConnContext(ctx context.Context, c net.Conn) context.Context {
	var tc *net.TCPConn
	switch c := c.(type) {
	case *net.TCPConn:
		tc = c
	case *bufferedConn:
		tc = c.tcp
	default:
		return ctx
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return ctx
	}
	return context.WithValue(ctx, connKey{}, &connInfo{tcp: tc, raw: raw})
}

// cork corks the request's connection, if ConnContext made that possible,
// and returns what uncork takes to send what the cork holds back.
func cork(ctx context.Context) syscall.RawConn {
	ci, _ := ctx.Value(connKey{}).(*connInfo)
	if ci == nil || ci.raw.Control(setCork) != nil {
		return nil
	}
	return ci.raw
}

// uncork sends what cork held back: the blob's last, partial segment.
func uncork(raw syscall.RawConn) {
	if raw != nil {
		raw.Control(clearCork)
	}
}
