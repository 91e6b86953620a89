package proxy

import (
	"io"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"
)

// clientConns bounds the client connections a Server holds open. Each
// holds a descriptor and a goroutine, and a blob being sent one more
// descriptor: past the process's descriptor limit every new request fails
// with "too many open files", wherever it comes from. Past the bound, a
// new connection gets a 503 with Retry-After instead, which containerd
// takes as a reason to try its next host, and is closed.
//
// A connection is counted when accepted and uncounted when it is closed
// for good: by net/http (http.StateClosed, connections it got back from
// the blob loop included) or by the blob loop. One the loop takes over,
// or hands back, stays counted.
type clientConns struct {
	max     int64 // 0: no bound
	open    atomic.Int64
	refused atomic.Int64
	// refusing bounds the refusals being written at once: beyond it a
	// connection is closed without one.
	refusing atomic.Int64
	warnedAt atomic.Int64 // unix seconds of the last warning
}

// maxRefusing is how many refusals are written at once, at most.
const maxRefusing = 64

// closed uncounts a connection closed for good.
func (cc *clientConns) closed() { cc.open.Add(-1) }

// limitListener is a listener whose Accept counts connections in cc and
// refuses those past its bound.
type limitListener struct {
	net.Listener
	s  *Server
	cc *clientConns
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if !l.s.clients.allows(c.RemoteAddr().String()) {
			l.refuse(c, refusalForbidden, "client")
			continue
		}
		if n := l.cc.open.Add(1); l.cc.max <= 0 || n <= l.cc.max {
			return c, nil
		}
		l.cc.open.Add(-1)
		l.cc.refused.Add(1)
		if now := time.Now().Unix(); now-l.cc.warnedAt.Load() >= 10 && l.cc.warnedAt.Swap(now) != now {
			l.s.log.Warn("client connection refused: at the bound of open client connections",
				"max_client_connections", l.cc.max, "refused_so_far", l.cc.refused.Load(),
				"fix", "raise max_client_connections (and the process's descriptor limit), or add a replica")
		}
		l.refuse(c, refusalBusy, "limit")
	}
}

// refusalBusy is the answer to a connection past the bound, and
// refusalForbidden to one from outside the allowed networks: written
// before the request is read, which HTTP/1.1 clients take as the answer to
// it.
var (
	refusalBusy = refusalResponse("503 Service Unavailable", "Retry-After: 1\r\n", "TOOMANYREQUESTS",
		"pullproxy holds as many client connections as it is allowed (max_client_connections): try again shortly, or another host")
	refusalForbidden = refusalResponse("403 Forbidden", "", "DENIED",
		"clients from this address may not use this pullproxy (allow_clients)")
)

func refusalResponse(status, extra, code, message string) []byte {
	body := `{"errors":[{"code":"` + code + `","message":"` + message + `"}]}`
	return []byte("HTTP/1.1 " + status + "\r\nContent-Type: application/json\r\n" + extra +
		"Connection: close\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}

// refuse answers c with answer and closes it; reason labels the metric.
func (l *limitListener) refuse(c net.Conn, answer []byte, reason string) {
	l.s.metrics.connsRefused.WithLabelValues(reason).Inc()
	if l.cc.refusing.Add(1) > maxRefusing {
		l.cc.refusing.Add(-1)
		c.Close()
		return
	}
	go func() {
		defer l.cc.refusing.Add(-1)
		// Closing with the request unread would reset the connection,
		// and the client might not see the answer: the write side is
		// shut first, and the request read and dropped.
		c.SetDeadline(time.Now().Add(time.Second))
		c.Write(answer)
		if tc, ok := c.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		io.Copy(io.Discard, io.LimitReader(c, 64<<10))
		c.Close()
	}()
}

// trackClosed wraps a ConnState hook so that the connections net/http
// closes are uncounted.
func (cc *clientConns) trackClosed(next func(net.Conn, http.ConnState)) func(net.Conn, http.ConnState) {
	return func(c net.Conn, st http.ConnState) {
		if st == http.StateClosed {
			cc.closed()
		}
		if next != nil {
			next(c, st)
		}
	}
}
