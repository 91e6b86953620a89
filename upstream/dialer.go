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
	"syscall"
	"time"

	"github.com/pullproxy/pullproxy/internal/rawsock"
	"github.com/pullproxy/pullproxy/upstream/plan"
)

// chunkDialer opens the connections blob chunks travel on. A connection
// carries chunks until it has used its byte budget (see lane), so over a
// long path its set-up (TCP, then TLS) is paid once per budget. Two things
// shorten it further:
//
//   - TLS sessions are resumed from a cache: with TLS 1.2 a resumed
//     handshake saves a round trip, with TLS 1.3 the certificate chain's
//     transfer and verification;
//   - a connection can be opened ahead of need (warm): a chunk that will
//     use up its connection's budget asks for one as it ends, so that the
//     next chunk's request goes out on a connection whose set-up overlapped
//     the transfer. A warm connection has carried nothing, so it holds its
//     whole byte budget; one not taken within warmMaxAge is closed (servers
//     drop connections that send nothing).
//
// Every connection it opens is a chunkConn, which counts the bytes it
// receives: what a degraded carrier counts before it kills the session.
type chunkDialer struct {
	proxy       func(*http.Request) (*url.URL, error) // the transport's; nil: none
	dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	tls         *tls.Config // for https; its ClientSessionCache resumes sessions
	first, idle time.Duration

	warmTaken atomic.Int64 // chunks sent on a warm connection, for tests

	mu     sync.Mutex
	warm   map[dialKey][]warmConn // oldest first
	setup  map[dialKey]time.Duration
	recent leastByKey // connections' set-ups (see noteSetup)
	// firstByte holds the least time from a request's sending to its
	// answer's first byte (see noteFirstByte).
	firstByte leastByKey
}

// setupTimes holds the least of the times something took on the path to an
// address within setupMemory (a connection's set-up, a request's first
// byte): how long the path itself is. Others take longer than the path:
// those of a burst of connections, or on a busy CPU, and, on a path its own
// chunks keep full, every one, as it queues behind their data (by tens of
// milliseconds at 64 MB/s), much as at a real bottleneck.
type setupTimes struct {
	least time.Duration
	at    time.Time // when least was seen
}

// setupMemory is how long a least set-up time stands: a path that grew
// longer (a route change) is seen as such after it.
const setupMemory = 5 * time.Minute

func (s *setupTimes) add(took time.Duration, now time.Time) {
	if s.least == 0 || took <= s.least || now.Sub(s.at) > setupMemory {
		s.least, s.at = took, now
	}
}

// leastByKey holds setupTimes per address.
type leastByKey map[dialKey]*setupTimes

func (m leastByKey) add(key dialKey, took time.Duration, now time.Time) {
	r := m[key]
	if r == nil {
		r = &setupTimes{}
		m[key] = r
	}
	r.add(max(took, 1), now) // 0 marks none seen in setupTimes
}

// least returns key's least time lately, 0 when none was seen.
func (m leastByKey) least(key dialKey) time.Duration {
	if r := m[key]; r != nil {
		return r.least
	}
	return 0
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

// get returns a warm connection for key, or opens one. A probe in ctx (see
// withProbe) goes to the connection returned, if no other took it yet.
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
	} else {
		var err error
		if c, err = d.open(ctx, network, key); err != nil {
			return nil, err
		}
	}
	if p := probeFrom(ctx); p != nil && p.attached.CompareAndSwap(false, true) {
		if cc := asChunkConn(c); cc != nil {
			cc.probe.Store(p)
		}
	}
	return c, nil
}

// open dials key's address, with a TLS handshake when secure, and records
// how long set-up took.
func (d *chunkDialer) open(ctx context.Context, network string, key dialKey) (net.Conn, error) {
	start := time.Now()
	raw, err := d.dial(ctx, network, key.addr)
	if err != nil {
		return nil, err
	}
	cc := &chunkConn{idleTimeoutConn: idleTimeoutConn{Conn: raw, first: d.first, idle: d.idle}}
	if tcp, ok := raw.(*net.TCPConn); ok {
		cc.rd, _ = rawsock.NewReader(tcp)
		if lowatSupported {
			cc.sock, _ = tcp.SyscallConn()
		}
	}
	var c net.Conn = cc
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
		d.setup[key] = (3*prev + took) / 4
	} else {
		d.setup[key] = took
	}
	d.mu.Unlock()
	d.noteSetup(key, took)
	return c, nil
}

// noteSetup records that opening a connection to key (TCP, and TLS for
// https) took took: the chunks' own, and the metadata client's, which
// opens the first connections to an endpoint, for its manifests, before any
// chunk (see metaTransport).
func (d *chunkDialer) noteSetup(key dialKey, took time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.recent.add(key, took, time.Now())
}

// noteFirstByte records that a request to key brought its answer's first
// byte took after it was sent: a round trip of the path and the server's
// answer, whatever answered the connect. A middlebox that accepts TCP
// itself (as carrier equipment counting bytes per session often does)
// makes a long path's connects look short; its requests do not.
func (d *chunkDialer) noteFirstByte(key dialKey, took time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.firstByte.add(key, took, time.Now())
}

// roundTrip returns the least time a request to key took to its answer's
// first byte lately (see setupTimes), or 0 when none was answered yet: how
// long the path is, as its data shows.
func (d *chunkDialer) roundTrip(key dialKey) time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.firstByte.least(key)
}

// newConnFirstByte returns how long a request on a new connection to key
// takes to its answer's first byte at least, lately: the least set-up and
// the least round trip; 0 when neither is known.
func (d *chunkDialer) newConnFirstByte(key dialKey) time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.recent.least(key) + d.firstByte.least(key)
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

// chunkConn is a chunk connection: it counts the bytes it receives, and
// knows the probe it carries, if any.
type chunkConn struct {
	idleTimeoutConn
	read    atomic.Int64
	retired atomic.Bool               // closed, or to be closed: no chunk is planned on it
	inUse   atomic.Bool               // a chunk's request went out on it and is not done
	probe   atomic.Pointer[probeConn] // nil: held to its endpoint's current budget (or to granted)
	granted atomic.Int64              // the allowance the budget renewed it with (see lane.spent); 0: none

	// The socket's receive low-water mark (see lowat.go).
	sock     syscall.RawConn // the TCP socket; nil: no mark is set
	left     atomic.Int64    // body bytes the answer being read has still to come, as far as known
	expected atomic.Int64    // left when the fetcher said it (see expect)
	began    atomic.Int64    // when it did, in Unix nanoseconds
	lowat    atomic.Int32    // the mark set on the socket; 0: none
	slow     atomic.Bool     // the answer came slower than the mark: read without it
	markSize atomic.Int32    // the mark the receive buffer allows (see mark)
	markNext atomic.Int64    // read at which the receive buffer is looked at again
}

func (c *chunkConn) Read(p []byte) (int, error) {
	var n int
	var err error
	if c.sock != nil && c.left.Load() > 0 {
		n, err = c.readMarked(p)
		c.left.Add(-int64(n))
	} else {
		n, err = c.idleTimeoutConn.Read(p)
	}
	c.read.Add(int64(n))
	if err != nil {
		c.retired.Store(true) // net/http closes a connection whose read failed
	}
	return n, err
}

// queued returns how many bytes wait unread in the socket's receive queue
// (0 where that is not known): bytes the path delivered that a reader
// starved of CPU has not taken yet.
func (c *chunkConn) queued() int {
	if c.sock == nil {
		return 0
	}
	return rcvQueued(c.sock)
}

// The planner watches a chunk's connection through plan.Wire: bytes read,
// and bytes queued unread.
var _ plan.Wire = (*chunkConn)(nil)

// Received returns the bytes read from c, ever.
func (c *chunkConn) Received() int64 { return c.read.Load() }

// Pending returns the bytes waiting unread in c's socket (see queued).
func (c *chunkConn) Pending() int { return c.queued() }

// Close settles a probe the connection carried, if nothing else did: a
// connection closed idle, or by the server, says nothing about the budget.
// While a chunk is in flight on it the chunk settles it (see done): net/http
// closes a connection whose answer broke off before the chunk's fetcher
// learns of the break, which is a cut.
func (c *chunkConn) Close() error {
	c.retired.Store(true)
	if p := c.probe.Load(); p != nil && !c.inUse.Load() {
		p.failed()
	}
	return c.idleTimeoutConn.Close()
}

// done ends the chunk in flight on c: if c is closed by now, a probe it
// carried that nothing settled settles as failed. The order of the stores
// and loads here and in Close makes one of them see the other.
func (c *chunkConn) done() {
	c.inUse.Store(false)
	if p := c.probe.Load(); p != nil && c.retired.Load() {
		p.failed()
	}
}

// asChunkConn returns the chunkConn under c (a TLS connection's, or c
// itself), or nil when c is not one.
func asChunkConn(c net.Conn) *chunkConn {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	cc, _ := c.(*chunkConn)
	return cc
}

// probeConn is a connection allowed more than its endpoint's budget, to
// find whether the path lets sessions carry that much (see budget). It is
// settled once: won when the connection carried its allowance, cut when
// the path cut it first, failed when it ended without evidence either way.
type probeConn struct {
	budget    *budget
	allowance int64
	attached  atomic.Bool // a connection took it
	settled   atomic.Bool
}

type probeKey struct{}

// withProbe returns ctx carrying p for the next connection the chunk
// dialer opens or hands out under it.
func withProbe(ctx context.Context, p *probeConn) context.Context {
	return context.WithValue(ctx, probeKey{}, p)
}

func probeFrom(ctx context.Context) *probeConn {
	p, _ := ctx.Value(probeKey{}).(*probeConn)
	return p
}

func (p *probeConn) won(carried int64) int64 {
	if !p.settled.CompareAndSwap(false, true) {
		return 0
	}
	return p.budget.completed(carried, true)
}

func (p *probeConn) cut(carried int64, kind string) int64 {
	if !p.settled.CompareAndSwap(false, true) {
		return 0
	}
	return p.budget.cut(carried, true, kind, time.Now())
}

func (p *probeConn) failed() {
	if p.settled.CompareAndSwap(false, true) {
		p.budget.failed(true)
	}
}
