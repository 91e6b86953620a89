package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// A node's containerd resolves a tag with HEAD, which has no body, and when
// that fails the kubelet's event quotes the status line alone:
//
//	failed to resolve reference "…": pulling from host pullproxy:5000 failed
//	with status code [manifests v1]: 503 upstream docker.io unreachable: connection refused
//
// So every error pullproxy sends names its cause in the status line's reason
// phrase, which clients print as the server sent it. net/http always writes
// http.StatusText there, so an error response is written on the hijacked
// connection (writeWithReason), which then goes back to net/http.

// maxReason bounds a reason phrase: a status line, not a log.
const maxReason = 200

// causeOf is err in one line for a node to read: what failed, where, and
// the root cause, without URLs, requests or anything the upstream echoed.
// rt is the request that failed.
func causeOf(err error, rt route) string {
	name := rt.up.Name()
	var ue *upstream.Error
	if errors.As(err, &ue) && ue.Upstream != "" {
		name = ue.Upstream
	}
	what := rt.repo + ":" + rt.ref
	switch {
	case rt.kind == kindBlob:
		what = "blob " + rt.ref
	case rt.kind == kindTags:
		what = "repository " + rt.repo
	case strings.Contains(rt.ref, ":"):
		what = rt.repo + "@" + rt.ref
	}
	switch {
	case errors.Is(err, errShuttingDown):
		return "pullproxy is shutting down"
	case errors.Is(err, storage.ErrNoSpace), errors.Is(err, syscall.ENOSPC):
		return "pullproxy's data dir is full: " + what + " cannot be stored"
	case errors.Is(err, storage.ErrDigestMismatch), errors.Is(err, storage.ErrSizeMismatch):
		return what + " from upstream " + name + " failed verification: nothing was cached"
	case errors.Is(err, upstream.ErrNotFound):
		return what + " not found at upstream " + name
	case errors.Is(err, storage.ErrNotFound):
		return what + " is not cached and upstream " + name + " is not asked (offline)"
	case errors.Is(err, upstream.ErrCredentialsRefused):
		return "upstream " + name + " refused pullproxy's configured credentials for " + rt.repo
	case errors.Is(err, upstream.ErrUnauthorized):
		return "upstream " + name + " wants credentials for " + rt.repo + ": none are configured"
	case errors.Is(err, upstream.ErrDenied):
		return "upstream " + name + " denied pullproxy access to " + rt.repo
	case errors.Is(err, upstream.ErrTooManyRequests):
		return "upstream " + name + " is rate limiting pullproxy"
	case errors.Is(err, context.DeadlineExceeded):
		return "upstream " + name + " did not answer in time"
	case ue != nil && ue.Status == 0 && errors.Is(err, upstream.ErrUnavailable):
		return "upstream " + name + " unreachable: " + rootCause(err)
	case ue != nil && ue.Status != 0:
		// The upstream answered, with an error or something pullproxy
		// refuses: its status and code, and pullproxy's words for an
		// answer it refused (never the upstream's own, which may echo).
		s := "upstream " + name + " answered " + strconv.Itoa(ue.Status)
		if ue.Code != "" {
			s += " " + ue.Code
		}
		if errors.Is(err, upstream.ErrInvalid) && ue.Message != "" {
			s += ": " + ue.Message
		}
		return s
	case errors.Is(err, upstream.ErrUnavailable):
		return "upstream " + name + " unavailable: " + rootCause(err)
	}
	return ""
}

// rootCause is the innermost error of err's chain, in its own words:
// "connection refused", "i/o timeout", "x509: certificate signed by unknown
// authority". Where a chain branches, the cause is the last branch (the
// kind comes first: upstream.Error, fmt.Errorf("%w: %w", kind, err)).
func rootCause(err error) string {
	if dnsErr := (*net.DNSError)(nil); errors.As(err, &dnsErr) {
		return "DNS lookup of " + dnsErr.Name + " failed: " + dnsErr.Err
	}
	var timeout net.Error
	if errors.As(err, &timeout) && timeout.Timeout() {
		return "timed out"
	}
	for {
		var next error
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			next = u.Unwrap()
		case interface{ Unwrap() []error }:
			if errs := u.Unwrap(); len(errs) > 0 {
				next = errs[len(errs)-1]
			}
		}
		if next == nil {
			return err.Error()
		}
		err = next
	}
}

// reasonPhrase makes s safe for a status line: printable ASCII on one
// line, at most maxReason bytes.
func reasonPhrase(s string) string {
	var b strings.Builder
	space := false
	for _, c := range s {
		switch {
		case c == ' ' || c == '\t' || c == '\r' || c == '\n':
			space = b.Len() > 0
			continue
		case c < 0x20 || c == 0x7f:
			continue
		case c > 0x7e:
			c = '?'
		}
		if space {
			b.WriteByte(' ')
			space = false
		}
		b.WriteRune(c)
		if b.Len() >= maxReason {
			return b.String()[:maxReason-3] + "..."
		}
	}
	return b.String()
}

// writeWithReason sends an error response whose status line carries
// reason, and reports whether it did. It writes on the hijacked
// connection, which it then hands back to net/http to read the next
// request (or closes, when the request leaves that unsafe). It sends
// nothing, and returns false, where the connection cannot be hijacked
// (HTTP/2, a test's recorder): the caller writes the response.
func (s *Server) writeWithReason(w http.ResponseWriter, r *http.Request, status int, reason string, body []byte) bool {
	if rec, ok := w.(*responseRecorder); r.ProtoMajor != 1 || ok && rec.headerSent {
		return false
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return false
	}
	if rec, ok := w.(*responseRecorder); ok {
		rec.status = status
		if r.Method != http.MethodHead {
			rec.written = int64(len(body))
		}
	}
	pending := make([]byte, brw.Reader.Buffered())
	brw.Reader.Read(pending)
	f := s.fast.Load()
	keep := f != nil && loopCanTake(r)
	var back net.Conn
	switch c := conn.(type) {
	case *net.TCPConn:
		back = &bufferedConn{tcp: c, pending: pending}
	case *bufferedConn:
		back = &bufferedConn{tcp: c.tcp, pending: append(pending, c.pending...)}
	case *tls.Conn:
		if len(pending) == 0 { // net/http reads the next request from the TLS conn itself
			back = c
		}
	}
	keep = keep && back != nil

	h := w.Header()
	h.Set("Date", time.Now().UTC().Format(http.TimeFormat))
	if !keep {
		h.Set("Connection", "close")
	}
	var out bytes.Buffer
	out.Grow(512 + len(body))
	fmt.Fprintf(&out, "HTTP/1.1 %d %s\r\n", status, reason)
	h.Write(&out)
	out.WriteString("\r\n")
	if r.Method != http.MethodHead {
		out.Write(body)
	}
	conn.SetWriteDeadline(time.Now().Add(errorWriteTimeout))
	_, err = conn.Write(out.Bytes())
	conn.SetDeadline(time.Time{})
	if err != nil || !keep || !f.handoff.hand(back) {
		conn.Close()
		s.clientConns.closed()
	}
	return true
}

// errorWriteTimeout bounds the write of an error response: a few hundred
// bytes, which only a client that reads nothing makes wait.
const errorWriteTimeout = 10 * time.Second
