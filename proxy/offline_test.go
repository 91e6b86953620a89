package proxy

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/storage"
)

// startOffline restarts e's proxy with its upstream offline.
func (e *env) startOffline() {
	e.t.Helper()
	e.stop()
	st, err := storage.Open(context.Background(), e.dir, storage.WithLogger(testLog(e.t)))
	if err != nil {
		e.t.Fatal(err)
	}
	e.registry = prometheus.NewRegistry()
	srv, err := New(WithStore(st), WithUpstream(Offline(upstreamName)), WithLogger(testLog(e.t)),
		WithMetricsRegistry(e.registry), WithTagTTL(time.Nanosecond))
	if err != nil {
		e.t.Fatal(err)
	}
	e.store, e.srv = st, srv
	e.proxy = serveProxy(e.t, srv)
}

// TestOffline: an offline upstream is never asked; what the store holds
// is served, tags and tag lists however old; a miss is a 404 that says
// the mirror is offline and names what is missing.
func TestOffline(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 50_000, 1)
	e.push("test/app", "v2", 50_000, 1)
	layer, content := layerDigest(t, img, 0)
	ns := "?ns=" + upstreamName
	for _, p := range []string{"/v2/test/app/manifests/v1", "/v2/test/app/blobs/" + layer.String(), "/v2/test/app/tags/list"} {
		if resp, _ := e.get("GET", p+ns, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d", p, resp.StatusCode)
		}
	}
	e.startOffline()
	e.counter.reset()
	for _, tc := range []struct {
		name, path string
		status     int
		has        string
	}{
		{"a tag pulled before", "/v2/test/app/manifests/v1", 200, ""},
		{"a layer pulled before", "/v2/test/app/blobs/" + layer.String(), 200, ""},
		{"the tag list", "/v2/test/app/tags/list", 200, `"v2"`},
		{"a tag never pulled", "/v2/test/app/manifests/v2", 404, "offline"},
		{"a layer never pulled", "/v2/test/app/blobs/sha256:" + strings.Repeat("ab", 32), 404, "offline"},
		{"the layer under another repository", "/v2/test/other/blobs/" + layer.String(), 404, "offline"},
		{"referrers never asked for", "/v2/test/app/referrers/" + layer.String(), 404, "offline"},
	} {
		resp, body := e.get("GET", tc.path+ns, nil)
		if resp.StatusCode != tc.status || !strings.Contains(string(body), tc.has) {
			t.Errorf("%s: %d %.200q, want %d with %q", tc.name, resp.StatusCode, body, tc.status, tc.has)
		}
		if tc.name == "a layer pulled before" && !bytes.Equal(body, content) {
			t.Errorf("%s: not the layer", tc.name)
		}
	}
	e.counter.mu.Lock()
	asked := len(e.counter.counts)
	e.counter.mu.Unlock()
	if asked != 0 {
		t.Errorf("the upstream was asked %d kinds of thing while offline", asked)
	}
	if got := testutilStale(e); got != 0 {
		t.Errorf("stale answers counted offline: %v", got)
	}
}

func testutilStale(e *env) int {
	families, _ := e.registry.Gather()
	n := 0
	for _, f := range families {
		if f.GetName() == "pullproxy_stale_served_total" {
			n += len(f.GetMetric())
		}
	}
	return n
}
