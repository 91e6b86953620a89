package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// upstreamName is the registry name the tests mirror.
const upstreamName = "registry.test"

// counter counts upstream requests by "METHOD kind", kind being manifests or
// blobs, by "METHOD ref" (a tag or digest) and body bytes by "bytes ref", and
// can make the upstream fail.
type counter struct {
	next       http.Handler
	down       atomic.Bool  // answer downStatus to everything
	downStatus atomic.Int64 // default 503

	mu     sync.Mutex
	counts map[string]int
}

func (c *counter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if c.down.Load() {
		status := int(c.downStatus.Load())
		if status == 0 {
			status = http.StatusServiceUnavailable
		}
		http.Error(w, "down for the test", status)
		return
	}
	kind := "other"
	switch {
	case strings.Contains(r.URL.Path, "/manifests/"):
		kind = "manifests"
	case strings.Contains(r.URL.Path, "/blobs/"):
		kind = "blobs"
	}
	c.mu.Lock()
	c.counts[r.Method+" "+kind]++
	c.counts[r.Method+" "+path.Base(r.URL.Path)]++ // per digest or tag
	c.mu.Unlock()
	cw := &countingWriter{ResponseWriter: w}
	c.next.ServeHTTP(cw, r)
	c.mu.Lock()
	if r.Method == http.MethodGet { // net/http drops what a HEAD handler writes
		c.counts["bytes "+path.Base(r.URL.Path)] += int(cw.n)
	}
	c.mu.Unlock()
}

// countingWriter counts body bytes.
type countingWriter struct {
	http.ResponseWriter
	n int64
}

func (w *countingWriter) Write(b []byte) (int, error) {
	n, err := w.ResponseWriter.Write(b)
	w.n += int64(n)
	return n, err
}

func (c *counter) count(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.counts[key]
}

func (c *counter) reset() {
	c.mu.Lock()
	c.counts = map[string]int{}
	c.mu.Unlock()
}

// env is an upstream registry, a store and a proxy in front of them.
type env struct {
	t        testing.TB
	upstream *httptest.Server
	counter  *counter
	dir      string
	store    *storage.Store
	srv      *Server
	proxy    *liveProxy
	registry *prometheus.Registry
	upOpts   []upstream.Option // the upstream's, besides the test defaults
	up       *upstream.Registry
}

// newEnv starts an in-process registry (go-containerregistry's) as the
// upstream named upstreamName, and a proxy for it with opts added.
func newEnv(t testing.TB, opts ...Option) *env {
	t.Helper()
	return newEnvRegistry(t, registry.New(registry.Logger(log.New(io.Discard, "", 0))), opts...)
}

// newEnvRegistry is newEnv with the given registry handler as the upstream.
func newEnvRegistry(t testing.TB, reg http.Handler, opts ...Option) *env {
	t.Helper()
	c := &counter{next: reg, counts: map[string]int{}}
	e := &env{t: t, counter: c, dir: t.TempDir()}
	e.upstream = httptest.NewServer(c)
	t.Cleanup(e.upstream.Close)
	e.start(e.upstream.URL, opts...)
	return e
}

// start opens the store and starts the proxy, as a (re)started process would.
// upstreamURL may list several endpoints, comma-separated.
func (e *env) start(upstreamURL string, opts ...Option) {
	e.t.Helper()
	ctx := context.Background()
	st, err := storage.Open(ctx, e.dir, storage.WithLogger(testLog(e.t)))
	if err != nil {
		e.t.Fatal(err)
	}
	// Endpoints comma-separated; few attempts, so that giving up is quick.
	upOpts := append([]upstream.Option{upstream.WithLogger(testLog(e.t)),
		upstream.WithFetchConfig(upstream.FetchConfig{MaxAttempts: 3})}, e.upOpts...)
	up, err := upstream.New(upstreamName, strings.Split(upstreamURL, ","), upOpts...)
	if err != nil {
		e.t.Fatal(err)
	}
	e.registry = prometheus.NewRegistry()
	all := append([]Option{WithStore(st), WithUpstream(up), WithLogger(testLog(e.t)), WithMetricsRegistry(e.registry)}, opts...)
	srv, err := New(all...)
	if err != nil {
		e.t.Fatal(err)
	}
	e.store, e.srv, e.up = st, srv, up
	e.proxy = serveProxy(e.t, srv)
	e.t.Cleanup(e.stop)
}

// stop shuts the proxy down and closes the store; safe to call twice.
func (e *env) stop() {
	if e.proxy == nil {
		return
	}
	e.proxy.Close()
	e.store.Close()
	e.proxy = nil
}

// liveProxy is a Server served on a loopback port as cmd/pullproxy serves
// it: through Serve, blob loop included.
type liveProxy struct {
	URL  string
	t    testing.TB
	srv  *Server
	hs   *http.Server
	done chan error
}

func serveProxy(t testing.TB, srv *Server) *liveProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &liveProxy{URL: "http://" + ln.Addr().String(), t: t, srv: srv, done: make(chan error, 1),
		hs: &http.Server{ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}}
	go func() { p.done <- srv.Serve(ln, p.hs) }()
	return p
}

// Close stops the server as cmd/pullproxy does: downloads first, then the
// connections.
func (p *liveProxy) Close() {
	p.srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.srv.Shutdown(ctx, p.hs); err != nil {
		p.t.Errorf("shutting the proxy down: %v", err)
	}
	if err := <-p.done; err != http.ErrServerClosed {
		p.t.Errorf("serving: %v", err)
	}
}

// push writes a random image to the upstream as repo:tag.
func (e *env) push(repo, tag string, layerSize int64, layers int64) v1.Image {
	e.t.Helper()
	img, err := random.Image(layerSize, layers)
	if err != nil {
		e.t.Fatal(err)
	}
	e.write(repo, tag, img)
	return img
}

// write writes img to the upstream as repo:tag.
func (e *env) write(repo, tag string, img v1.Image) {
	e.t.Helper()
	if err := remote.Write(e.ref(repo+":"+tag), img); err != nil {
		e.t.Fatal(err)
	}
}

// ref parses a reference to the upstream's repo:tag or repo@digest.
func (e *env) ref(s string) name.Reference {
	e.t.Helper()
	ref, err := name.ParseReference(strings.TrimPrefix(e.upstream.URL, "http://")+"/"+s, name.Insecure)
	if err != nil {
		e.t.Fatal(err)
	}
	return ref
}

// get sends a request to the proxy and returns the response with its body read.
func (e *env) get(method, path string, header http.Header) (*http.Response, []byte) {
	e.t.Helper()
	req, err := http.NewRequest(method, e.proxy.URL+path, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return resp, body
}

func layerDigest(t testing.TB, img v1.Image, i int) (digest.Digest, []byte) {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	h, err := layers[i].Digest()
	if err != nil {
		t.Fatal(err)
	}
	rc, err := layers[i].Compressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return digest.Digest(h.String()), b
}

func randomBytes(t testing.TB, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// testLog sends the proxy's log to the test's log, shown only on failure.
func testLog(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(string(bytes.TrimRight(b, "\n")))
	return len(b), nil
}
