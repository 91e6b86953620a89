package proxy

import (
	"bytes"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/upstream"
)

// blobGate holds the upstream's blob GETs while armed, until opened,
// telling arrived how many it holds at each arrival.
type blobGate struct {
	next    http.Handler
	armed   atomic.Bool
	open    chan struct{}
	arrived chan int

	mu   sync.Mutex
	held int
}

func (g *blobGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !g.armed.Load() || r.Method != http.MethodGet || !strings.Contains(r.URL.Path, "/blobs/") {
		g.next.ServeHTTP(w, r)
		return
	}
	g.mu.Lock()
	g.held++
	held := g.held
	g.mu.Unlock()
	g.arrived <- held
	select {
	case <-g.open:
	case <-r.Context().Done():
	}
	g.mu.Lock()
	g.held--
	g.mu.Unlock()
	g.next.ServeHTTP(w, r)
}

// runningPriority is the priority of d's download in flight; nil if none.
func runningPriority(s *Server, d digest.Digest) *upstream.Priority {
	s.downloads.mu.Lock()
	defer s.downloads.mu.Unlock()
	if dl := s.downloads.m[d]; dl != nil {
		return dl.prio
	}
	return nil
}

// TestBackgroundDownloadPromoted: a blob download started by background
// work holds half the endpoint's connections (2 of 4) at most; a client
// asking for the same blob joins it, which promotes it, and it then takes
// all four. Counted at the upstream, whose blob GETs are held meanwhile.
func TestBackgroundDownloadPromoted(t *testing.T) {
	t.Parallel()
	gate := &blobGate{next: registry.New(registry.Logger(log.New(io.Discard, "", 0))), open: make(chan struct{}), arrived: make(chan int, 64)}
	e := &env{t: t, counter: &counter{next: gate, counts: map[string]int{}}, dir: t.TempDir(),
		upOpts: []upstream.Option{upstream.WithFetchConfig(upstream.FetchConfig{MaxConnections: 4, BackgroundShare: 0.5,
			ConnectionBudget: 128 << 10, MaxAttempts: 3, FirstByteTimeout: time.Minute})}}
	e.upstream = httptest.NewServer(e.counter)
	t.Cleanup(e.upstream.Close)
	e.start(e.upstream.URL)
	img := e.push("test/app", "v1", 1<<20, 1) // eight chunks of the 128 KiB budget
	layer, layerBytes := layerDigest(t, img, 0)
	gate.armed.Store(true)

	// held waits for the next blob GET to arrive and returns how many are
	// held then.
	held := func(what string) int {
		t.Helper()
		select {
		case n := <-gate.arrived:
			if p := runningPriority(e.srv, layer); n > 2 && p.Background() {
				t.Errorf("%d chunk requests at once for a background download, want at most 2", n)
			}
			return n
		case <-time.After(time.Minute):
			t.Fatalf("waiting for %s: no chunk request came", what)
			return 0
		}
	}

	bgDone := make(chan error, 1)
	go func() {
		_, err := e.srv.EnsureBlob(upstream.WithBackground(t.Context()), upstreamName, "test/app", layer, nil)
		bgDone <- err
	}()
	held("the background download's first chunk")
	held("its second chunk")
	if p := runningPriority(e.srv, layer); !p.Background() {
		t.Fatalf("the download started by a background caller is not background")
	}

	type answer struct {
		status int
		body   []byte
		err    error
	}
	client := make(chan answer, 1)
	go func() {
		resp, err := http.Get(e.proxy.URL + "/v2/test/app/blobs/" + layer.String() + "?ns=" + upstreamName)
		if err != nil {
			client <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		client <- answer{resp.StatusCode, body, err}
	}()
	held("a third chunk, once a client joined")
	if n := held("a fourth chunk"); n != 4 {
		t.Errorf("chunk requests at once after the client joined: got %d, want 4", n)
	}
	if p := runningPriority(e.srv, layer); p.Background() {
		t.Errorf("the download is still background with a client waiting on it")
	}

	close(gate.open)
	if err := <-bgDone; err != nil {
		t.Errorf("EnsureBlob: %v", err)
	}
	if a := <-client; a.err != nil || a.status != http.StatusOK || !bytes.Equal(a.body, layerBytes) {
		t.Errorf("the client's GET: status %d, %d bytes, %v; want 200 and the layer's %d", a.status, len(a.body), a.err, len(layerBytes))
	}
}
