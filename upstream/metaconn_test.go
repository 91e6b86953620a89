package upstream

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// connLog serves a manifest to every request and notes which client
// connection each came on, and how many connections were opened.
type connLog struct {
	manifest []byte

	mu      sync.Mutex
	remotes []string
	opened  atomic.Int64
}

func (c *connLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c.mu.Lock()
	c.remotes = append(c.remotes, r.RemoteAddr)
	c.mu.Unlock()
	w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
	w.Write(c.manifest)
}

func (c *connLog) connState(_ net.Conn, s http.ConnState) {
	if s == http.StateNew {
		c.opened.Add(1)
	}
}

// runs returns how many requests in a row came on each connection since the
// from-th request.
func (c *connLog) runs(from int) []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	var runs []int
	for i := from; i < len(c.remotes); i++ {
		if i == from || c.remotes[i] != c.remotes[i-1] {
			runs = append(runs, 0)
		}
		runs[len(runs)-1]++
	}
	return runs
}

// TestMetadataConnRetired: a kept-alive connection that has carried more
// than half its endpoint's budget takes no further request; the request goes
// on a new connection and succeeds, without a retry of ours. The threshold
// follows the budget as it moves.
func TestMetadataConnRetired(t *testing.T) {
	t.Parallel()
	// About 3.1 KiB an answer: two fit under half of a 16 KiB budget, three do not.
	c := &connLog{manifest: bytes.Repeat([]byte("m"), 3000)}
	srv := httptest.NewUnstartedServer(c)
	srv.Config.ConnState = c.connState
	srv.Start()
	t.Cleanup(srv.Close)
	m, reg := newTestMetrics(t)
	tr := NewTransport()
	t.Cleanup(tr.CloseIdleConnections)
	r, err := New(testUpstream, []string{srv.URL}, WithTransport(tr), WithLogger(discardLogger), WithMetrics(m),
		WithFetchConfig(FetchConfig{ConnectionBudget: 16 << 10, MinConnectionBudget: 8 << 10, MaxConnectionBudget: 32 << 10}))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(r.client.CloseIdleConnections)
	get := func(n int) {
		t.Helper()
		for range n {
			desc, _, err := r.GetManifest(t.Context(), "org/app", "latest", nil)
			if err != nil || desc.Digest != digest.FromBytes(c.manifest) {
				t.Fatalf("GetManifest: got %v, %v, want %v", desc.Digest, err, digest.FromBytes(c.manifest))
			}
		}
	}
	get(6)
	if got, want := c.runs(0), []int{3, 3}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("requests per connection at a 16 KiB budget: got %v, want %v", got, want)
	}
	// Cuts lower the budget to its floor, 8 KiB: one answer per 4 KiB.
	for range cutOutliers + 1 {
		r.endpoints[0].budget.cut(10<<10, false, "reset", time.Now())
	}
	get(4)
	if got, want := c.runs(6), []int{2, 2}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("requests per connection at an 8 KiB budget: got %v, want %v", got, want)
	}
	if got := c.opened.Load(); got != 4 {
		t.Errorf("connections opened: got %v, want 4", got)
	}
	if got := metricValue(t, reg, "pullproxy_upstream_retries_total", nil); got != 0 {
		t.Errorf("retries: got %v, want 0 (net/http sends a refused request again by itself)", got)
	}
}

// cutServer answers registry requests, the first cuts of them cut as cut
// says, after reading the request.
type cutServer struct {
	cuts   int
	cut    func(conn net.Conn, buf *bufio.ReadWriter, r *http.Request)
	answer http.Handler

	mu       sync.Mutex
	requests map[string]int // by path
}

func (s *cutServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.requests[r.URL.Path]++
	n := 0
	for _, v := range s.requests {
		n += v
	}
	s.mu.Unlock()
	if n > s.cuts {
		s.answer.ServeHTTP(w, r)
		return
	}
	conn, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(err)
	}
	s.cut(conn, buf, r)
}

func (s *cutServer) count(path string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requests[path]
}

// closeAfter writes head, then closes the connection. A FIN rather than an
// RST: an RST may discard what is not yet sent, and the client must see
// exactly head. (Resets are the carrier test's.)
func closeAfter(head string) func(net.Conn, *bufio.ReadWriter, *http.Request) {
	return func(conn net.Conn, buf *bufio.ReadWriter, _ *http.Request) {
		buf.WriteString(head)
		buf.Flush()
		conn.Close()
	}
}

// tokenAnswer serves a manifest, and when realm is not "" a token at /token
// and a bearer challenge to requests without the token.
func tokenAnswer(manifest []byte, realm string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/token":
			io.WriteString(w, `{"token":"tok","expires_in":300}`)
		case realm != "" && r.Header.Get("Authorization") != "Bearer tok":
			w.Header().Set("WWW-Authenticate", `Bearer realm="`+realm+`",service="registry.test"`)
			w.WriteHeader(http.StatusUnauthorized)
		default:
			w.Header().Set("Docker-Content-Digest", digest.FromBytes(manifest).String())
			w.Write(manifest)
		}
	})
}

// hijackedWriter writes an HTTP/1.1 answer on a hijacked connection.
type hijackedWriter struct {
	buf    *bufio.ReadWriter
	header http.Header
}

func (w hijackedWriter) Header() http.Header         { return w.header }
func (w hijackedWriter) Write(p []byte) (int, error) { return w.buf.Write(p) }
func (w hijackedWriter) WriteHeader(status int) {
	fmt.Fprintf(w.buf, "HTTP/1.1 %d %s\r\n", status, http.StatusText(status))
	w.header.Set("Content-Length", "0")
	w.header.Write(w.buf)
	w.buf.WriteString("\r\n")
}

// TestMetadataRetriedAfterCut: a manifest or token request cut before its
// answer is complete is sent again on a fresh connection, and answered; the
// endpoint is not left aside, and a cut after some bytes teaches the
// endpoint's budget. A request cut every time fails after its retries, and
// only then is the endpoint left aside.
func TestMetadataRetriedAfterCut(t *testing.T) {
	t.Parallel()
	manifest := bytes.Repeat([]byte("m"), 3000)
	const manifestPath = "/v2/org/app/manifests/latest"
	head := "HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n"
	tests := []struct {
		name   string
		method string
		cuts   int    // how many requests are cut
		path   string // the request cut
		cut    func(net.Conn, *bufio.ReadWriter, *http.Request)
		kind   string // the cut's kind
		taught bool   // the cut came after some bytes: the budget drops
	}{
		{"GET cut in the body", http.MethodGet, 1, manifestPath, closeAfter(head + strings.Repeat("m", 1000)), "eof", true},
		// net/http reads the partial line as a header: "malformed MIME header".
		{"GET cut in the headers", http.MethodGet, 1, manifestPath, closeAfter("HTTP/1.1 200 OK\r\nContent-Le"), "error", true},
		{"HEAD cut before the answer", http.MethodHead, 1, manifestPath, closeAfter(""), "eof", false},
		{"token cut in the body", http.MethodHead, 2, "/token",
			closeAfter("HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n{\"token\":"), "eof", true},
		{"cut every time", http.MethodGet, 100, manifestPath, closeAfter(head + "mm"), "eof", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := &cutServer{cuts: tt.cuts, requests: map[string]int{}, cut: tt.cut}
			srv := httptest.NewUnstartedServer(s)
			s.answer = tokenAnswer(manifest, "")
			if tt.path == "/token" { // the request before collects the challenge
				s.answer = tokenAnswer(manifest, "http://"+srv.Listener.Addr().String()+"/token")
				s.cut = func(conn net.Conn, buf *bufio.ReadWriter, r *http.Request) {
					if r.URL.Path == "/token" {
						tt.cut(conn, buf, r)
						return
					}
					s.answer.ServeHTTP(hijackedWriter{buf, http.Header{}}, r)
					buf.Flush()
					conn.Close()
				}
			}
			srv.Start()
			t.Cleanup(srv.Close)
			spare := &countingHandler{h: statusHandler(http.StatusServiceUnavailable)}
			spareSrv := httptest.NewServer(spare)
			t.Cleanup(spareSrv.Close)
			m, reg := newTestMetrics(t)
			tr := NewTransport()
			t.Cleanup(tr.CloseIdleConnections)
			r, err := New(testUpstream, []string{srv.URL, spareSrv.URL}, WithTransport(tr), WithLogger(discardLogger), WithMetrics(m))
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			t.Cleanup(r.client.CloseIdleConnections)

			var desc Descriptor
			if tt.method == http.MethodHead {
				desc, err = r.HeadManifest(t.Context(), "org/app", "latest", nil)
			} else {
				desc, _, err = r.GetManifest(t.Context(), "org/app", "latest", nil)
			}
			ep := r.endpoints[0]
			cuts := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", map[string]string{"endpoint": ep.host, "kind": tt.kind})
			retries := metricValue(t, reg, "pullproxy_upstream_retries_total", map[string]string{"reason": tt.kind})
			wantCuts := 0.0
			if tt.taught {
				wantCuts = 1
			}
			if tt.cuts > metaRetries+1 {
				checkKind(t, err, ErrUnavailable)
				if got := s.count(tt.path); got != metaRetries+1 {
					t.Errorf("requests: got %v, want %v", got, metaRetries+1)
				}
				if got := spare.n.Load(); got != 1 {
					t.Errorf("requests to the spare endpoint: got %v, want 1", got)
				}
				if !ep.health.down(time.Now()) {
					t.Errorf("the endpoint is up, want it left aside after failing its retries")
				}
				if retries != metaRetries || cuts != metaRetries+1 {
					t.Errorf("retries, cuts: got %v, %v, want %v, %v", retries, cuts, metaRetries, metaRetries+1)
				}
				return
			}
			if err != nil || desc.Digest != digest.FromBytes(manifest) {
				t.Fatalf("got %v, %v, want %v", desc.Digest, err, digest.FromBytes(manifest))
			}
			if got := s.count(tt.path); got != 2 {
				t.Errorf("requests for %s: got %v, want 2", tt.path, got)
			}
			if got := spare.n.Load(); got != 0 {
				t.Errorf("requests to the spare endpoint: got %v, want 0", got)
			}
			if ep.health.down(time.Now()) || testutil.ToFloat64(ep.up) != 1 {
				t.Errorf("the endpoint is left aside, want it up")
			}
			if retries != 1 || cuts != wantCuts {
				t.Errorf("retries, cuts: got %v, %v, want 1, %v", retries, cuts, wantCuts)
			}
			// One cut, even within a few KiB, does not move the budget.
			if got, wantBudget := ep.budget.get(), int64(1<<20); got != wantBudget {
				t.Errorf("budget: got %v, want %v", got, wantBudget)
			}
		})
	}
}

// TestMetadataRetryOwnTransport: a caller's own RoundTripper is used as it
// is, with the retries: a cut is sent again, a refused dial is not.
func TestMetadataRetryOwnTransport(t *testing.T) {
	t.Parallel()
	manifest := []byte(`{"schemaVersion":2}`)
	ok := func() *http.Response {
		return response(http.StatusOK, nil, int64(len(manifest)), bytes.NewReader(manifest))
	}
	tests := []struct {
		name  string
		first func() (*http.Response, error)
		calls int
		want  error // nil: the manifest
	}{
		{"reset", func() (*http.Response, error) {
			return nil, &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
		}, 2, nil},
		{"body cut", func() (*http.Response, error) {
			return response(http.StatusOK, nil, int64(len(manifest)), cutBody(manifest, 5)), nil
		}, 2, nil},
		{"dial refused", func() (*http.Response, error) {
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
		}, 1, syscall.ECONNREFUSED},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				var calls atomic.Int64
				rt := roundTripFunc(func(req *http.Request) (*http.Response, error) {
					if calls.Add(1) == 1 {
						return tt.first()
					}
					return ok(), nil
				})
				r := newMemRegistry(t, memNet{"registry.test": rt}, "https://registry.test")
				desc, _, err := r.GetManifest(t.Context(), "org/app", "latest", nil)
				if tt.want == nil && (err != nil || desc.Digest != digest.FromBytes(manifest)) {
					t.Errorf("got %v, %v, want %v", desc.Digest, err, digest.FromBytes(manifest))
				}
				if tt.want != nil && !errors.Is(err, tt.want) {
					t.Errorf("got %v, want %v", err, tt.want)
				}
				if got := calls.Load(); got != int64(tt.calls) {
					t.Errorf("requests: got %v, want %v", got, tt.calls)
				}
			})
		})
	}
}

// TestMetadataConnRetiredTLS: retiring works under TLS too (the count is of
// the bytes under it), and metadata goes over HTTP/1.1 even to a server that
// offers HTTP/2.
func TestMetadataConnRetiredTLS(t *testing.T) {
	t.Parallel()
	c := &connLog{manifest: bytes.Repeat([]byte("m"), 3000)}
	var protos sync.Map
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		protos.Store(r.Proto, true)
		c.ServeHTTP(w, r)
	}))
	srv.Config.ConnState = c.connState
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	tr := NewTransport()
	tr.TLSClientConfig = srv.Client().Transport.(*http.Transport).TLSClientConfig.Clone()
	t.Cleanup(tr.CloseIdleConnections)
	m, reg := newTestMetrics(t)
	r, err := New(testUpstream, []string{srv.URL}, WithTransport(tr), WithLogger(discardLogger), WithMetrics(m),
		WithFetchConfig(FetchConfig{ConnectionBudget: 16 << 10, MinConnectionBudget: 8 << 10, MaxConnectionBudget: 32 << 10}))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(r.client.CloseIdleConnections)
	const requests = 8
	for range requests {
		if _, err := r.HeadManifest(t.Context(), "org/app", "latest", nil); err != nil {
			t.Fatalf("HeadManifest: %v", err)
		}
		if _, _, err := r.GetManifest(t.Context(), "org/app", "latest", nil); err != nil {
			t.Fatalf("GetManifest: %v", err)
		}
	}
	// A GET's answer is 3 KiB and more, a HEAD's a few hundred bytes: under
	// half of 16 KiB, a connection carries at most three of each, handshake aside.
	runs := c.runs(0)
	t.Logf("requests per connection: %v", runs)
	for _, n := range runs {
		if n > 6 {
			t.Errorf("requests per connection: got %v, want none over 6", runs)
			break
		}
	}
	if len(runs) < 2 || c.opened.Load() != int64(len(runs)) {
		t.Errorf("requests per connection: got %v over %d connections, want them spread over several", runs, c.opened.Load())
	}
	protos.Range(func(k, _ any) bool {
		if k != "HTTP/1.1" {
			t.Errorf("protocol: got %v, want HTTP/1.1", k)
		}
		return true
	})
	if got := metricValue(t, reg, "pullproxy_upstream_retries_total", nil); got != 0 {
		t.Errorf("retries: got %v, want 0", got)
	}
}

// TestMeterThreshold: a connection to an endpoint is held to half that
// endpoint's budget, found by host and port whatever their case; one to
// another host to half the smallest budget.
func TestMeterThreshold(t *testing.T) {
	t.Parallel()
	r, err := New(testUpstream, []string{"https://Registry.Example", "http://mirror.example:5000/prefix"},
		WithLogger(discardLogger), WithFetchConfig(FetchConfig{ConnectionBudget: 1 << 20, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 8 << 20}))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	meter := r.client.Transport.(*metaTransport).meter
	primary, mirror := r.endpoints[0], r.endpoints[1]
	for range cutOutliers + 1 {
		mirror.budget.cut(200<<10, false, "reset", time.Now()) // to 150 KiB
	}
	tests := []struct {
		addr string
		want int64
	}{
		{"registry.example:443", 512 << 10},
		{"REGISTRY.example:443", 512 << 10},
		{"mirror.example:5000", 75 << 10},
		{"auth.example:443", 75 << 10},
		{"registry.example:80", 75 << 10},
	}
	for _, tt := range tests {
		ep := meter.byAddr[strings.ToLower(tt.addr)]
		if got := meter.threshold(ep); got != tt.want {
			t.Errorf("threshold for %s: got %v, want %v", tt.addr, got, tt.want)
		}
	}
	for range cutOutliers + 1 {
		primary.budget.cut(100<<10, false, "reset", time.Now()) // to 75 KiB: read at each check
	}
	if got := meter.threshold(nil); got != 75<<10/2 {
		t.Errorf("threshold for another host after a cut: got %v, want %v", got, 75<<10/2)
	}
}
