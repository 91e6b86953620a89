package upstream

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/pullproxy/pullproxy/internal/rawsock"
)

// FetchConfig tunes how blobs are fetched. The zero value of a field means
// its default. Its fields are named as the configuration file's fetch keys
// (connection_budget, parallel_chunks, …).
type FetchConfig struct {
	// ConnectionBudget is the initial byte budget of one connection: how
	// much it may receive in all, over however many chunks, before it is
	// replaced (see lane). Default 1 MiB, below the smallest session cut
	// seen on degraded carrier paths (1.3 MB). A kept-alive manifest, HEAD
	// or token connection is retired once it has carried half the budget
	// (see metaconn.go).
	ConnectionBudget int64
	// MaxConnectionBudget is the ceiling an adaptive budget grows to on a
	// clean path. Default 64 MiB. Set it equal to ConnectionBudget for a
	// fixed budget.
	MaxConnectionBudget int64
	// MinConnectionBudget is the floor a budget drops to after cuts; a
	// session that fails before carrying this much is not taken for a
	// byte-count cut. Default 64 KiB, or ConnectionBudget if smaller.
	MinConnectionBudget int64
	// ParallelChunks caps how many chunks of one blob are fetched at once.
	// Default 0: no cap of its own, one blob may use every connection its
	// endpoint's limit allows.
	ParallelChunks int
	// MaxConnections is the ceiling of chunk connections in flight to one
	// endpoint, across all blobs. The limit in force adapts to the path
	// below it (see pipe). Default 64: lower it for an upstream that
	// refuses many connections from one client.
	MaxConnections int
	// StallTimeout abandons a connection that goes silent for this long once
	// it has started answering. Default 2 s: a black hole is caught in
	// seconds, and a false alarm costs only a new connection, since the bytes
	// received are kept. Before the first byte a connection gets
	// FirstByteTimeout instead.
	StallTimeout time.Duration
	// FirstByteTimeout bounds the wait from dialling to the first byte of an
	// answer (TLS handshake, auth, redirect). Default 10 s.
	FirstByteTimeout time.Duration
	// MaxAttempts is how many attempts in a row may fail without a new byte
	// before an endpoint is given up for the blob. Default 8.
	MaxAttempts int
	// MinGoodput is the least a chunk connection must bring, in bytes a
	// second averaged from its answer's start, once it has run for
	// slowAfter stall timeouts: one below it is abandoned as too slow (its
	// bytes kept), as a stall is. A connection trickling a byte a second
	// never goes silent long enough to stall, and would otherwise hold its
	// place, and the download, indefinitely. Default 4 KiB/s; -1: none.
	MinGoodput int64
	// BackgroundShare is the share of an endpoint's chunk connections (of
	// the limit in force, see pipe) that background fetches (see
	// WithBackground) may hold at once, at least one; they get a free
	// connection only after every foreground fetch waiting. Default 0.5;
	// valid in (0, 1].
	BackgroundShare float64
}

// slowAfter is how many stall timeouts a chunk connection runs before its
// goodput is held to MinGoodput: slow start, and a path shared with many
// others, are not slowness.
const slowAfter = 5

func (c FetchConfig) withDefaults() (FetchConfig, error) {
	def := func(v *int64, d int64) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.ConnectionBudget, 1<<20)
	def(&c.MinConnectionBudget, min(64<<10, c.ConnectionBudget))
	def(&c.MaxConnectionBudget, 64<<20)
	if c.MaxConnections == 0 {
		c.MaxConnections = 64
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = 2 * time.Second
	}
	if c.FirstByteTimeout == 0 {
		c.FirstByteTimeout = max(10*time.Second, c.StallTimeout)
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 8
	}
	if c.BackgroundShare == 0 {
		c.BackgroundShare = 0.5
	}
	switch c.MinGoodput {
	case 0:
		c.MinGoodput = 4 << 10
	case -1:
		c.MinGoodput = 0
	}
	switch {
	case c.ConnectionBudget < 0 || c.MinConnectionBudget < 0 || c.MaxConnectionBudget < 0 || c.ParallelChunks < 0 || c.MaxConnections < 0 ||
		c.StallTimeout < 0 || c.FirstByteTimeout < 0 || c.MaxAttempts < 0 || c.MinGoodput < 0:
		return c, errors.New("fetch settings must not be negative")
	case !(c.BackgroundShare > 0 && c.BackgroundShare <= 1): // NaN too
		return c, fmt.Errorf("background_share %v is not in (0, 1]", c.BackgroundShare)
	case c.MinConnectionBudget > c.ConnectionBudget:
		return c, fmt.Errorf("min_connection_budget %d is above connection_budget %d", c.MinConnectionBudget, c.ConnectionBudget)
	case c.MaxConnectionBudget < c.ConnectionBudget:
		return c, fmt.Errorf("max_connection_budget %d is below connection_budget %d", c.MaxConnectionBudget, c.ConnectionBudget)
	}
	return c, nil
}

// newChunkTransport returns the transport chunks are fetched with, which
// each lane clones (see lane), and its dialer: HTTP/1.1 only (HTTP/2
// multiplexes every chunk onto one session, the very thing the budget must
// bound), kept-alive connections, at most one idle per host (a lane sends
// one request at a time), and a read deadline renewed on every read, which
// abandons a silent connection without limiting a slow one; it also closes
// a kept-alive connection left idle for as long. See chunkDialer for TLS
// resumption and warm connections.
func newChunkTransport(base *http.Transport, firstByte, stall time.Duration) (*http.Transport, *chunkDialer) {
	t := base.Clone()
	t.DisableKeepAlives = false
	t.MaxIdleConnsPerHost = 1
	t.ForceAttemptHTTP2 = false
	t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	cfg := t.TLSClientConfig
	if cfg == nil {
		cfg = &tls.Config{}
	}
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"http/1.1"}
	if cfg.ClientSessionCache == nil {
		cfg.ClientSessionCache = tls.NewLRUClientSessionCache(sessionCacheSize)
	}
	t.TLSClientConfig = cfg // a proxied https request's handshake is the transport's
	dial := t.DialContext
	if dial == nil {
		dial = (&net.Dialer{Timeout: 10 * time.Second}).DialContext
	}
	d := &chunkDialer{proxy: t.Proxy, dial: dial, tls: cfg, first: firstByte, idle: stall,
		warm: map[dialKey][]warmConn{}, setup: map[dialKey]time.Duration{},
		recent: leastByKey{}, firstByte: leastByKey{}}
	t.DialContext = d.dialTCP
	t.DialTLSContext = d.dialTLS
	t.ResponseHeaderTimeout = max(firstByte, t.ResponseHeaderTimeout)
	return t, d
}

// noRedirects returns redirects to the caller rather than following them,
// so that a signed URL is resolved once and reused.
func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// sessionCacheSize is how many TLS sessions a client keeps for resumption:
// one per server name is what counts.
const sessionCacheSize = 64

// idleTimeoutConn fails a read that waits longer than first for the first
// byte after something was sent (a TLS handshake message, a request), or
// longer than idle for any later byte. Restarting the first-byte wait on
// every write keeps a TLS handshake from spending it: the request's answer
// gets the whole of it.
type idleTimeoutConn struct {
	net.Conn
	first, idle time.Duration
	answered    atomic.Bool // a byte arrived since the last write
	// rd, when set, reads Conn (a TCP socket) with raw system calls: a
	// fetch's reads come as its packets do, and would otherwise keep the
	// runtime's monitor awake (see rawsock).
	rd *rawsock.Reader
}

// recv reads from the connection, with rd when set.
func (c *idleTimeoutConn) recv(p []byte) (int, error) {
	if c.rd != nil {
		return c.rd.Read(p)
	}
	return c.Conn.Read(p)
}

func (c *idleTimeoutConn) Write(p []byte) (int, error) {
	c.answered.Store(false)
	// A kept-alive connection's reader may already wait, with the idle
	// deadline of a connection between requests: the answer to this one
	// gets the first-byte wait.
	if err := c.Conn.SetReadDeadline(time.Now().Add(c.first)); err != nil {
		return 0, err
	}
	return c.Conn.Write(p)
}

func (c *idleTimeoutConn) Read(p []byte) (int, error) {
	wait := c.idle
	if !c.answered.Load() {
		wait = c.first
	}
	if err := c.Conn.SetReadDeadline(time.Now().Add(wait)); err != nil {
		return 0, err
	}
	n, err := c.recv(p)
	if n > 0 {
		c.answered.Store(true)
	}
	return n, err
}
