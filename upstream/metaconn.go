package upstream

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Manifests, HEADs and tokens ("metadata") share a kept-alive pool of
// connections per registry. On a degraded carrier path a TCP session dies
// once it has carried some number of bytes, and a pooled session keeps
// carrying requests until it does: whatever is in flight on it then fails.
// Two defences, both here:
//
//   - a pooled connection is retired before it carries its endpoint's
//     connection budget: past half of it, it refuses its next request
//     without writing a byte, and net/http sends that request on another
//     connection;
//   - a request cut before its answer is complete is sent again on a fresh
//     connection, and the cut, when the connection had carried bytes, is
//     recorded in the endpoint's budget as a cut chunk is: it is evidence
//     about the path, not an outage of the endpoint.

// metaRetries is how many times a metadata request cut before a complete
// answer is sent again.
const metaRetries = 3

// errRetired is what a retired connection's Write returns.
var errRetired = errors.New("connection retired: it has carried half its byte budget")

// metaTransport sends a registry's metadata requests. GET and HEAD are
// idempotent and their answers small, so one cut before the answer is
// complete is retried rather than passed on to the caller.
type metaTransport struct {
	pooled  http.RoundTripper      // kept-alive connections, retired before their budget
	fresh   http.RoundTripper      // a new connection per request, for retries
	meter   *meter                 // nil with a caller's own RoundTripper: no byte counts
	retries *prometheus.CounterVec // by reason, curried with the upstream
	log     *slog.Logger
	// paths is told how long opening each new connection took, and each
	// request's first byte; nil: not wanted.
	paths *chunkDialer
}

// newMetaTransport returns the transport of r's metadata client over base.
// It needs r's endpoints, whose budgets it reads.
func (r *Registry) newMetaTransport(base http.RoundTripper) *metaTransport {
	mt := &metaTransport{pooled: base, fresh: base, log: r.log,
		retries: r.metrics.retries.MustCurryWith(prometheus.Labels{"upstream": r.name})}
	t, ok := base.(*http.Transport)
	if !ok {
		return mt // a caller's own RoundTripper: used as it is, with retries
	}
	mt.meter = newMeter(r.endpoints, r.fetch.MinConnectionBudget)
	mt.paths = r.dialer
	mt.pooled = mt.meter.transport(t, true, r.targets.guard)
	mt.fresh = mt.meter.transport(t, false, r.targets.guard)
	return mt
}

// RoundTrip sends a GET or HEAD with retries, anything else as it is.
func (t *metaTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if (req.Method != http.MethodGet && req.Method != http.MethodHead) || (req.Body != nil && req.Body != http.NoBody) {
		return t.pooled.RoundTrip(req)
	}
	ctx := req.Context()
	rt := t.pooled
	for attempt := 0; ; attempt++ {
		resp, conn, err := t.try(req, rt)
		if err == nil {
			return resp, nil
		}
		if !retryable(ctx, err) {
			return nil, err
		}
		reason := t.evidence(conn, err)
		if attempt == metaRetries {
			return nil, fmt.Errorf("%d attempts failed before a complete answer, the last: %w", attempt+1, err)
		}
		t.retries.WithLabelValues(reason).Inc()
		t.log.Debug("metadata request cut, sending it again on a fresh connection",
			"host", req.URL.Host, "method", req.Method, "path", req.URL.Path, "err", err)
		if err := sleep(ctx, metaBackoff(attempt)); err != nil {
			return nil, err
		}
		rt = t.fresh
	}
}

// CloseIdleConnections closes the kept-alive connections, as
// http.Client.CloseIdleConnections expects of its transport.
func (t *metaTransport) CloseIdleConnections() {
	if c, ok := t.pooled.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// try sends req once with rt and reads a GET's answer into memory, so that a
// cut part-way through the answer fails here, where it can be retried. It
// also returns the connection the request last went out on, when known.
func (t *metaTransport) try(req *http.Request, rt http.RoundTripper) (*http.Response, *meteredConn, error) {
	var on connTrace
	sent := req
	if t.meter != nil {
		sent = req.WithContext(httptrace.WithClientTrace(req.Context(), on.trace(req.URL, t.paths)))
	}
	resp, err := rt.RoundTrip(sent)
	if err != nil {
		return nil, on.conn, err
	}
	resp.Request = req
	if err := readAhead(req.Method, resp); err != nil {
		return nil, on.conn, err
	}
	return resp, on.conn, nil
}

// evidence records a cut of a connection that had carried bytes in its
// endpoint's budget, and returns the cut's kind.
func (t *metaTransport) evidence(c *meteredConn, err error) string {
	if errors.Is(err, errRetired) {
		return "retired" // refused by us, not cut by the path
	}
	kind := cutKind(err)
	if c == nil || c.ep == nil {
		return kind
	}
	n := c.read.Load()
	if n <= 0 {
		return kind // died before carrying anything: an error, not a byte-count cut
	}
	if next := c.ep.budget.cut(n, false, kind, time.Now()); next > 0 {
		t.log.Info("connection budget lowered after a cut of a metadata connection", "endpoint", c.ep.host,
			"cut_at", n, "kind", kind, "budget", next)
	}
	return kind
}

// retryable reports whether err, from sending a request or reading its
// answer, may be a cut on the path. Not when the caller gave up; not a
// failed dial, which carried nothing (the next endpoint is the remedy); not
// a TLS peer the client refuses or that refuses the client, which another
// connection will not change.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil || errors.Is(err, errTargetRefused) {
		return false
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return false
	}
	var cert *tls.CertificateVerificationError
	var alert tls.AlertError
	return !errors.As(err, &cert) && !errors.As(err, &alert)
}

// metaBackoff is the wait before retry attempt+1: short, as the retry goes
// on a fresh connection, and jittered so that requests cut together do not
// come back together. 50–100 ms, then 100–200 ms.
func metaBackoff(attempt int) time.Duration {
	d := min(100*time.Millisecond<<attempt, 200*time.Millisecond)
	return d/2 + rand.N(d/2+1)
}

// readAhead reads a GET's answer into memory. Metadata answers are small: one
// over MaxManifestSize is left to stream after what was read.
func readAhead(method string, resp *http.Response) error {
	if method == http.MethodHead || resp.Body == nil || resp.Body == http.NoBody || resp.ContentLength > MaxManifestSize {
		return nil
	}
	size := bytes.MinRead
	if resp.ContentLength > 0 {
		size += int(resp.ContentLength)
	}
	buf := bytes.NewBuffer(make([]byte, 0, size))
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, MaxManifestSize+1)); err != nil {
		resp.Body.Close()
		return fmt.Errorf("reading the answer after %d bytes: %w", buf.Len(), err)
	}
	if buf.Len() > MaxManifestSize {
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(buf, resp.Body), resp.Body}
		return nil
	}
	resp.Body.Close()
	resp.Body = io.NopCloser(buf)
	return nil
}

// connTrace remembers the connection a request last went out on: net/http
// may send it on more than one when a reused connection fails before a
// byte of the request is written.
type connTrace struct{ conn *meteredConn }

// trace returns the hooks that record the connection a request went out
// on and, with paths, how long opening a new one took (see setupClock) and
// the request's first byte (see firstByteClock).
func (c *connTrace) trace(u *url.URL, paths *chunkDialer) *httptrace.ClientTrace {
	t := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) { c.conn = metered(info.Conn) }}
	if paths != nil {
		key := keyOf(u)
		clock := &setupClock{key: key, note: paths.noteSetup}
		first := &firstByteClock{paths: paths, key: key}
		t.WroteRequest, t.GotFirstResponseByte = first.wroteRequest, first.gotFirstByte
		t.ConnectStart = clock.connectStart
		if clock.key.secure {
			t.TLSHandshakeDone = func(_ tls.ConnectionState, err error) { clock.done(err) }
		} else {
			t.ConnectDone = func(_, _ string, err error) { clock.done(err) }
		}
	}
	return t
}

// setupClock times the set-up of a connection a metadata request opens,
// from its first connect to the end of its TLS handshake (its connect, for
// http), and passes it to note. The metadata client opens an endpoint's
// first connections, for the manifests a pull starts with: its set-ups tell
// the chunk pipe how long the path is before the first chunk goes out (see
// pipe.startShortLocked). The hooks run on net/http's dialling goroutine, which
// may outlive the request.
type setupClock struct {
	key  dialKey
	note func(dialKey, time.Duration)

	mu    sync.Mutex
	start time.Time
}

func (s *setupClock) connectStart(string, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.start.IsZero() { // the first of parallel attempts (IPv4 and IPv6)
		s.start = time.Now()
	}
}

func (s *setupClock) done(err error) {
	s.mu.Lock()
	start := s.start
	s.mu.Unlock()
	if err == nil && !start.IsZero() {
		s.note(s.key, time.Since(start))
	}
}

// firstByteClock times a request from its last byte sent to its answer's
// first byte received, and notes it in paths for key: a round trip of the
// path, where a connection's set-up may not be (see
// chunkDialer.noteFirstByte). Its hooks run on net/http's writing and
// reading goroutines.
type firstByteClock struct {
	paths *chunkDialer // nil: nothing is timed
	key   dialKey
	wrote atomic.Int64 // Unix nanoseconds; 0: not yet, or timed already
}

func (c *firstByteClock) wroteRequest(info httptrace.WroteRequestInfo) {
	if info.Err == nil {
		c.wrote.Store(time.Now().UnixNano())
	}
}

func (c *firstByteClock) gotFirstByte() {
	if at := c.wrote.Swap(0); at != 0 {
		c.paths.noteFirstByte(c.key, time.Duration(time.Now().UnixNano()-at))
	}
}

func metered(c net.Conn) *meteredConn {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	mc, _ := c.(*meteredConn)
	return mc
}

// meter dials a registry's metadata connections and knows the budget each
// is held to: its endpoint's, found by the address dialled, or for another
// host (a token realm, a redirect target, a proxy) the smallest of the
// registry's endpoints'.
type meter struct {
	byAddr map[string]*endpoint // lower-case host:port → endpoint; read-only
	eps    []*endpoint
	floor  int64 // no threshold is lower: half the smallest budget allowed
}

func newMeter(eps []*endpoint, minBudget int64) *meter {
	m := &meter{byAddr: map[string]*endpoint{}, eps: eps, floor: minBudget / 2}
	for _, ep := range eps {
		addr := strings.ToLower(dialAddr(ep.url))
		if _, dup := m.byAddr[addr]; !dup {
			m.byAddr[addr] = ep
		}
	}
	return m
}

// dialAddr is the host:port net/http dials for u.
func dialAddr(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "443"
		if u.Scheme == "http" {
			port = "80"
		}
	}
	return net.JoinHostPort(u.Hostname(), port)
}

// transport returns a clone of base whose connections are metered: kept
// alive and retired past their threshold when pooled, else one per request.
//
// HTTP/1.1 only. HTTP/2 would multiplex every metadata request onto one
// session, the very thing the budget must bound, and a session refusing a
// request would fail the streams in flight on it rather than be replaced.
// Over HTTP/1.1 a cut fails the one request on its connection.
func (m *meter) transport(base *http.Transport, pooled bool, guard func(dialFunc) dialFunc) *http.Transport {
	t := base.Clone()
	t.DisableKeepAlives = !pooled
	t.ForceAttemptHTTP2 = false
	t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	t.Protocols = new(http.Protocols)
	t.Protocols.SetHTTP1(true)
	if c := t.TLSClientConfig; c != nil {
		// Offered "h2", a server would answer in HTTP/2 on this transport,
		// which speaks HTTP/1.1 only.
		c.NextProtos = slices.DeleteFunc(slices.Clone(c.NextProtos), func(p string) bool { return p == "h2" })
	}
	dial := t.DialContext
	if dial == nil {
		dial = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	}
	t.DialContext = m.dialer(guard(dial), pooled)
	if t.DialTLSContext != nil {
		t.DialTLSContext = m.dialer(guard(t.DialTLSContext), pooled)
	}
	return t
}

type dialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

func (m *meter) dialer(dial dialFunc, retire bool) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &meteredConn{Conn: c, m: m, ep: m.byAddr[strings.ToLower(addr)], retire: retire}, nil
	}
}

// threshold is how many bytes a connection to ep (nil: another host) may
// have carried and still take a request: half the budget, so that the
// answer (a manifest, usually a few KiB) fits in the other half. Budgets
// move, so it is read at every check.
func (m *meter) threshold(ep *endpoint) int64 {
	if ep != nil {
		return ep.budget.get() / 2
	}
	least := int64(math.MaxInt64)
	for _, e := range m.eps {
		least = min(least, e.budget.get())
	}
	return least / 2
}

// meteredConn counts the bytes a connection receives: what a degraded
// carrier counts before it kills the session.
type meteredConn struct {
	net.Conn
	m       *meter
	ep      *endpoint // nil: not an endpoint's host
	retire  bool      // refuse requests past the threshold
	read    atomic.Int64
	retired atomic.Bool
}

func (c *meteredConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

// Write refuses, with nothing written, once the connection is retired:
// net/http then sends the request on another connection by itself, as it
// does whenever a reused connection fails before a byte of the request is
// written (shouldRetryRequest and nothingWrittenError in its transport.go).
func (c *meteredConn) Write(p []byte) (int, error) {
	if c.retire && c.spent() {
		return 0, errRetired
	}
	return c.Conn.Write(p)
}

func (c *meteredConn) spent() bool {
	if c.retired.Load() {
		return true
	}
	n := c.read.Load()
	if n <= c.m.floor || n <= c.m.threshold(c.ep) {
		return false
	}
	c.retired.Store(true)
	return true
}
