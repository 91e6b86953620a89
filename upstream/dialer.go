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
	warm  map[string][]warmConn // by key (see dialKey), oldest first
	setup map[string]time.Duration
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

func dialKey(secure bool, addr string) string {
	if secure {
		return "tls|" + addr
	}
	return "tcp|" + addr
}

// dialTCP is the transport's DialContext: plain http, and the connection to
// an HTTP proxy.
func (d *chunkDialer) dialTCP(ctx context.Context, network, addr string) (net.Conn, error) {
	if c := d.take(dialKey(false, addr)); c != nil {
		return c, nil
	}
	return d.open(ctx, network, addr, false)
}

// dialTLS is the transport's DialTLSContext: https without a proxy.
func (d *chunkDialer) dialTLS(ctx context.Context, network, addr string) (net.Conn, error) {
	if c := d.take(dialKey(true, addr)); c != nil {
		return c, nil
	}
	return d.open(ctx, network, addr, true)
}

// open dials addr, with a TLS handshake when secure, and records how long
// set-up took.
func (d *chunkDialer) open(ctx context.Context, network, addr string, secure bool) (net.Conn, error) {
	start := time.Now()
	raw, err := d.dial(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	var c net.Conn = &idleTimeoutConn{Conn: raw, first: d.first, idle: d.idle}
	if secure {
		cfg := d.tls.Clone()
		if cfg.ServerName == "" {
			host, _, err := net.SplitHostPort(addr)
			if err != nil {
				host = addr
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
	key := dialKey(secure, addr)
	d.mu.Lock()
	if prev, ok := d.setup[key]; ok {
		took = (3*prev + took) / 4
	}
	d.setup[key] = took
	d.mu.Unlock()
	return c, nil
}

// take returns a warm connection for key, or nil.
func (d *chunkDialer) take(key string) net.Conn {
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	conns := d.warm[key]
	for len(conns) > 0 {
		w := conns[len(conns)-1] // the newest: least likely to be dropped
		conns = conns[:len(conns)-1]
		if now.Sub(w.at) < warmMaxAge {
			d.warm[key] = conns
			d.warmTaken.Add(1)
			return w.conn
		}
		w.conn.Close()
	}
	delete(d.warm, key)
	return nil
}

// setupTime returns how long opening a connection to key took lately, or 0
// when none was opened yet.
func (d *chunkDialer) setupTime(key string) time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.setup[key]
}

// prewarm opens a connection to addr in the background, within ctx and at
// most timeout, and keeps it warm for the next chunk. Failures are not
// reported: the chunk that would have used it dials as usual.
func (d *chunkDialer) prewarm(ctx context.Context, secure bool, addr string, timeout time.Duration) {
	key := dialKey(secure, addr)
	go func() {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		c, err := d.open(ctx, "tcp", addr, secure)
		if err != nil {
			return
		}
		d.prune(key)
		now := time.Now()
		d.mu.Lock()
		defer d.mu.Unlock()
		conns := d.warm[key]
		if len(conns) >= maxWarm {
			c.Close()
			return
		}
		d.warm[key] = append(conns, warmConn{conn: c, at: now})
		time.AfterFunc(warmMaxAge, func() { d.prune(key) })
	}()
}

// prune closes key's warm connections that have expired.
func (d *chunkDialer) prune(key string) {
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	conns := d.warm[key]
	for len(conns) > 0 && now.Sub(conns[0].at) >= warmMaxAge {
		conns[0].conn.Close()
		conns = conns[1:]
	}
	if len(conns) == 0 {
		delete(d.warm, key)
		return
	}
	d.warm[key] = conns
}

// close closes the warm connections.
func (d *chunkDialer) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for key, conns := range d.warm {
		for _, w := range conns {
			w.conn.Close()
		}
		delete(d.warm, key)
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
