package proxy

import (
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestResponseSource: every answer says where it came from in
// Pullproxy-Source, on the blob loop too; errors say nothing.
func TestResponseSource(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 200_000, 1)
	layer, _ := layerDigest(t, img, 0)
	ns := "?ns=" + upstreamName
	for _, tc := range []struct {
		name, path string
		want       string
	}{
		{"manifest, first", "/v2/test/app/manifests/v1", "upstream"},
		{"manifest, again", "/v2/test/app/manifests/v1", "cache"},
		{"layer, first", "/v2/test/app/blobs/" + layer.String(), "download"},
		{"layer, again (the blob loop)", "/v2/test/app/blobs/" + layer.String(), "cache"},
		{"tag list, first", "/v2/test/app/tags/list", "upstream"},
		{"tag list, again", "/v2/test/app/tags/list", "cache"},
		{"referrers, first", "/v2/test/app/referrers/" + layer.String(), "upstream"},
		{"referrers, again", "/v2/test/app/referrers/" + layer.String(), "cache"},
		{"an error", "/v2/test/app/manifests/nope", ""},
	} {
		resp, _ := e.get(http.MethodGet, tc.path+ns, nil)
		if got := resp.Header.Get("Pullproxy-Source"); got != tc.want {
			t.Errorf("%s: Pullproxy-Source %q (status %d), want %q", tc.name, got, resp.StatusCode, tc.want)
		}
	}
}

// TestReady: /readyz answers 200 while the store works, 503 once the
// server shuts down or the store is closed.
func TestReady(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	if resp, body := e.get(http.MethodGet, "/readyz", nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz: %d %s", resp.StatusCode, body)
	}
	e.store.Close()
	if resp, body := e.get(http.MethodGet, "/readyz", nil); resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/readyz with the store closed: %d %s, want 503", resp.StatusCode, body)
	}
	if resp, _ := e.get(http.MethodGet, "/healthz", nil); resp.StatusCode != http.StatusOK {
		t.Errorf("/healthz: %d, want 200 (the process is alive)", resp.StatusCode)
	}
	e.srv.Close()
	if resp, body := e.get(http.MethodGet, "/readyz", nil); resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/readyz shutting down: %d %s, want 503", resp.StatusCode, body)
	}
}

// TestRequestMetrics: durations by kind, cache hits and misses, and
// clients waiting on downloads are counted.
func TestRequestMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 100_000, 1)
	layer, _ := layerDigest(t, img, 0)
	path := "/v2/test/app/blobs/" + layer.String() + "?ns=" + upstreamName
	for range 3 { // a miss, then hits: one through net/http, one on the blob loop
		e.get(http.MethodGet, path, nil)
	}
	// A request is counted, and its download leaves the table, a moment
	// after its client has read the answer.
	settled := func() bool {
		return testutil.ToFloat64(e.srv.metrics.cacheResults[kindBlob][0]) == 2 &&
			e.srv.metrics.waiters.Load() == 0 && e.srv.downloads.running() == 0
	}
	for deadline := time.Now().Add(5 * time.Second); !settled() && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	hits := testutil.ToFloat64(e.srv.metrics.cacheResults[kindBlob][0])
	misses := testutil.ToFloat64(e.srv.metrics.cacheResults[kindBlob][1])
	if hits != 2 || misses != 1 {
		t.Errorf("blob cache hits %v, misses %v; want 2 and 1", hits, misses)
	}
	families, err := e.registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	for _, f := range families {
		if f.GetName() != "pullproxy_http_request_duration_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				counts[l.GetValue()] += m.GetHistogram().GetSampleCount()
			}
		}
	}
	if counts[kindBlob] != 3 {
		t.Errorf("blob request durations observed: %d, want 3", counts[kindBlob])
	}
	if got := e.srv.metrics.waiters.Load(); got != 0 {
		t.Errorf("clients waiting on downloads after the answers: %d, want 0", got)
	}
	if got := e.srv.downloads.running(); got != 0 {
		t.Errorf("downloads in flight after the answers: %d", got)
	}
}
