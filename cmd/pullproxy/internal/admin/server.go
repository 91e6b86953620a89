package admin

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
)

// Server is the admin endpoint's HTTP server.
type Server struct {
	hs     *http.Server
	drain  *drainHandler
	cancel context.CancelFunc // ends the requests' contexts
	once   sync.Once
	log    *slog.Logger
}

// Start serves the admin endpoint of m on ln, guarded for its kind
// of listener: on TCP, with the token in tokenFile.
func Start(m *mirror.Mirror, ln net.Listener, dataDir, tokenFile string, log *slog.Logger) (*Server, error) {
	guard := &guard{next: handler(m, dataDir, log)}
	if _, ok := ln.Addr().(*net.TCPAddr); ok {
		tok, err := readToken(tokenFile)
		if err != nil {
			return nil, err
		}
		guard.hosts, guard.token = listenerHosts(ln.Addr()), tok
	}
	return serve(ln, guard, log), nil
}

// serve serves h on ln until shutdown.
func serve(ln net.Listener, h http.Handler, log *slog.Logger) *Server {
	base, cancel := context.WithCancel(context.Background())
	a := &Server{drain: &drainHandler{next: h}, cancel: cancel, log: log}
	a.hs = &http.Server{Handler: a.drain, ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return base },
		ErrorLog:    slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	go a.hs.Serve(ln)
	return a
}

// drainWait is the last part of the shutdown grace, kept for admin
// requests to end once cancelled: an import rolls back in that time.
const drainWait = 5 * time.Second

// Shutdown lets admin requests in progress finish, then cancels those
// left and waits for their handlers to return, so that none touches the
// store after it closes: all by ctx's deadline, the last drainWait of
// it kept for the cancelled ones, so that the whole shutdown stays within
// the grace that supervisors give. It is safe to call more than once.
func (a *Server) Shutdown(ctx context.Context) {
	a.once.Do(func() {
		finish := ctx
		if deadline, ok := ctx.Deadline(); ok {
			var cancel context.CancelFunc
			finish, cancel = context.WithDeadline(ctx, deadline.Add(-drainWait))
			defer cancel()
		}
		if err := a.hs.Shutdown(finish); err != nil {
			a.log.Warn("admin requests still running at shutdown are cancelled", "err", err)
		}
		// Cancelled before their connections close, so that a cancelled
		// import can tell its client it kept nothing, rather than the
		// client seeing the connection end.
		a.cancel()
		done := make(chan struct{})
		go func() { a.drain.close(); close(done) }()
		select {
		case <-done:
		case <-ctx.Done():
			a.log.Warn("admin requests did not end after being cancelled; closing the store under them")
		}
		a.hs.Close()
	})
}

// drainHandler tracks the handlers running, so that close can wait for
// them; after close it refuses new requests.
type drainHandler struct {
	mu     sync.RWMutex
	closed bool
	next   http.Handler
}

func (d *drainHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		http.Error(w, "admin endpoint: shutting down", http.StatusServiceUnavailable)
		return
	}
	d.next.ServeHTTP(w, r)
}

// close waits for the handlers running to return.
func (d *drainHandler) close() {
	d.mu.Lock()
	d.closed = true
	d.mu.Unlock()
}
