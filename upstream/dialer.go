package upstream

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// chunkDialer opens the connections blob chunks travel on. Each carries one
// chunk, so over a long path its set-up (TCP, then TLS) is paid per chunk.
// Two things shorten it:
//
//   - TLS sessions are resumed from a cache: with TLS 1.2 a resumed
//     handshake saves a round trip, with TLS 1.3 the certificate chain's
//     transfer and verification;
//   - a connection can be opened ahead of need (warm): a chunk about to end
//     asks for one, so that the next chunk's request goes out on a connection
//     whose set-up overlapped the transfer. A warm connection has carried
//     nothing, so it holds its whole byte budget; one not taken within
//     warmMaxAge is closed (servers drop connections that send nothing).
type chunkDialer struct {
	proxy       func(*http.Request) (*url.URL, error) // the transport's; nil: none
	dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	tls         *tls.Config // for https; its ClientSessionCache resumes sessions
	first, idle time.Duration

	warmTaken atomic.Int64 // chunks sent on a warm connection, for tests

	mu    sync.Mutex
	warm  map[dialKey][]warmConn // oldest first
	setup map[dialKey]time.Duration
}

// dialKey is where a connection goes, and whether it speaks TLS.
type dialKey struct {
	secure bool
	addr   string // host:port
}

type warmConn struct {
	conn net.Conn
	at   time.Time
}

const (
	warmMaxAge = 5 * time.Second
	// maxWarm bounds the warm connections kept per address.
	maxWarm = 64
)

// dialTCP is the transport's DialContext: plain http, and the connection to
// an HTTP proxy.
func (d *chunkDialer) dialTCP(ctx context.Context, network, addr string) (net.Conn, error) {
	return d.get(ctx, network, dialKey{false, addr})
}

// dialTLS is the transport's DialTLSContext: https without a proxy.
func (d *chunkDialer) dialTLS(ctx context.Context, network, addr string) (net.Conn, error) {
	return d.get(ctx, network, dialKey{true, addr})
}

// get returns a warm connection for key, or opens one.
func (d *chunkDialer) get(ctx context.Context, network string, key dialKey) (net.Conn, error) {
	d.prune(key)
	d.mu.Lock()
	var c net.Conn
	if conns := d.warm[key]; len(conns) > 0 {
		c = conns[len(conns)-1].conn // the newest: least likely to be dropped
		d.warm[key] = conns[:len(conns)-1]
	}
	d.mu.Unlock()
	if c != nil {
		d.warmTaken.Add(1)
		return c, nil
	}
	return d.open(ctx, network, key)
}

// open dials key's address, with a TLS handshake when secure, and records
// how long set-up took.
func (d *chunkDialer) open(ctx context.Context, network string, key dialKey) (net.Conn, error) {
	start := time.Now()
	raw, err := d.dial(ctx, network, key.addr)
	if err != nil {
		return nil, err
	}
	var c net.Conn = &idleTimeoutConn{Conn: raw, first: d.first, idle: d.idle}
	if key.secure {
		cfg := d.tls.Clone()
		if cfg.ServerName == "" {
			host, _, err := net.SplitHostPort(key.addr)
			if err != nil {
				host = key.addr
			}
			cfg.ServerName = host
		}
		tc := tls.Client(c, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, err
		}
		c = tc
	}
	took := time.Since(start)
	d.mu.Lock()
	if prev, ok := d.setup[key]; ok {
		took = (3*prev + took) / 4
	}
	d.setup[key] = took
	d.mu.Unlock()
	return c, nil
}

// setupTime returns how long opening a connection to key took lately, or 0
// when none was opened yet.
func (d *chunkDialer) setupTime(key dialKey) time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.setup[key]
}

// prewarm opens a connection for key in the background, within ctx and at
// most timeout, and keeps it warm for the next chunk. Failures are not
// reported: the chunk that would have used it dials as usual.
func (d *chunkDialer) prewarm(ctx context.Context, key dialKey, timeout time.Duration) {
	go func() {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		c, err := d.open(ctx, "tcp", key)
		if err != nil {
			return
		}
		d.mu.Lock()
		kept := len(d.warm[key]) < maxWarm
		if kept {
			d.warm[key] = append(d.warm[key], warmConn{conn: c, at: time.Now()})
		}
		d.mu.Unlock()
		if !kept {
			c.Close()
			return
		}
		time.AfterFunc(warmMaxAge, func() { d.prune(key) })
	}()
}

// prune closes key's warm connections that have expired, outside the lock.
func (d *chunkDialer) prune(key dialKey) {
	now := time.Now()
	d.mu.Lock()
	conns := d.warm[key]
	n := 0
	for n < len(conns) && now.Sub(conns[n].at) >= warmMaxAge {
		n++
	}
	expired := conns[:n:n]
	if n == len(conns) {
		delete(d.warm, key)
	} else if n > 0 {
		d.warm[key] = conns[n:]
	}
	d.mu.Unlock()
	for _, w := range expired {
		w.conn.Close()
	}
}

// proxied reports whether req goes through an HTTP proxy, which the
// transport dials itself.
func (d *chunkDialer) proxied(req *http.Request) bool {
	if d.proxy == nil {
		return false
	}
	u, err := d.proxy(req)
	return err != nil || u != nil
}

// hostPort returns u's host with its port, the default for the scheme where
// none is given, as the transport dials it.
func hostPort(scheme, host string) string {
	if _, _, err := net.SplitHostPort(host); err == nil {
		return host
	}
	port := "80"
	if strings.EqualFold(scheme, "https") {
		port = "443"
	}
	return net.JoinHostPort(strings.Trim(host, "[]"), port)
}
