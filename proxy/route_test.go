package proxy

import (
	"net/http"
	"strings"
	"testing"

	"github.com/distribution/reference"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// TestRouteUpstream: the upstream a request goes to, by ns, by a first path
// component naming it (HOST:PORT or HOST_PORT), else the default.
func TestRouteUpstream(t *testing.T) {
	t.Parallel()
	st, err := storage.Open(t.Context(), t.TempDir(), storage.WithLogger(discard))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	opts := []Option{WithStore(st), WithDefaultUpstream("docker.io"), WithLogger(discard)}
	for _, name := range []string{"docker.io", "registry.internal:5000", "127.0.0.1:5000", "ghcr.io"} {
		up, err := upstream.New(name, []string{"http://127.0.0.1:9"}, upstream.WithLogger(discard))
		if err != nil {
			t.Fatal(err)
		}
		opts = append(opts, WithUpstream(up))
	}
	s, err := New(opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	for _, tc := range []struct {
		path, ns     string
		up, repo     string
		wantNotFound bool
	}{
		{path: "/v2/team/app/manifests/v1", ns: "registry.internal:5000", up: "registry.internal:5000", repo: "team/app"},
		{path: "/v2/registry.internal:5000/team/app/manifests/v1", up: "registry.internal:5000", repo: "team/app"},
		{path: "/v2/registry.internal_5000/team/app/manifests/v1", up: "registry.internal:5000", repo: "team/app"},
		{path: "/v2/REGISTRY.internal_5000/team/app/manifests/v1", up: "registry.internal:5000", repo: "team/app"},
		{path: "/v2/127.0.0.1_5000/app/manifests/v1", up: "127.0.0.1:5000", repo: "app"},
		{path: "/v2/ghcr.io/org/app/manifests/v1", up: "ghcr.io", repo: "org/app"},
		{path: "/v2/docker.io/alpine/manifests/3.20", up: "docker.io", repo: "library/alpine"},
		// Names that are not HOST_PORT of a configured upstream are the
		// default upstream's repositories.
		{path: "/v2/registry.internal_5001/app/manifests/v1", up: "docker.io", repo: "registry.internal_5001/app"},
		{path: "/v2/my_org_2/app/manifests/v1", up: "docker.io", repo: "my_org_2/app"},
		{path: "/v2/registry.internal_50a0/app/manifests/v1", up: "docker.io", repo: "registry.internal_50a0/app"},
		{path: "/v2/ghcr.io_443/app/manifests/v1", up: "docker.io", repo: "ghcr.io_443/app"},
		{path: "/v2/registry.internal_5000/manifests/v1", up: "docker.io", repo: "library/registry.internal_5000"},
		{path: "/v2/team/app/manifests/v1", ns: "registry.internal_5000", wantNotFound: true},
	} {
		rt, err := s.resolve(http.MethodGet, tc.path, tc.ns)
		if tc.wantNotFound {
			if err == nil {
				t.Errorf("%s ns=%q: routed to %s %s, want NAME_UNKNOWN", tc.path, tc.ns, rt.up.Name(), rt.repo)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s ns=%q: %v", tc.path, tc.ns, err)
			continue
		}
		if rt.up.Name() != tc.up || rt.repo != tc.repo {
			t.Errorf("%s ns=%q: got %s %s, want %s %s", tc.path, tc.ns, rt.up.Name(), rt.repo, tc.up, tc.repo)
		}
	}
}

// TestPlainName: the check without regular expressions accepts only names
// reference.WithName accepts, and the plain names clients send.
func TestPlainName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		plain bool
	}{
		{"a", true}, {"node/app", true}, {"library/alpine", true}, {"a.b", true}, {"a__b", true},
		{"a-b", true}, {"a--b", true}, {"a_b.c-d/e__f---g", true}, {"x_y/z.w/v0", true},
		{strings.Repeat("a", 255), true}, {strings.Repeat("a", 256), false},
		{"", false}, {"a..b", false}, {"a._b", false}, {"a___b", false}, {"a-.b", false}, {"-a", false},
		{"a-", false}, {".a", false}, {"a.", false}, {"_", false}, {"a/", false}, {"/a", false},
		{"a//b", false}, {"A", false}, {"a b", false},
		// Valid, but left to reference.WithName: a domain with a port.
		{"localhost:5000/x", false},
	} {
		if got := plainName(tc.name); got != tc.plain {
			t.Errorf("plainName(%q): got %v, want %v", tc.name, got, tc.plain)
		}
		if _, err := reference.WithName(tc.name); tc.plain && err != nil {
			t.Errorf("plainName(%q) is true, but reference.WithName refuses it: %v", tc.name, err)
		}
	}
}

// TestRequestCounters: the counters kept for common labels are the ones
// WithLabelValues gives, and other labels still count.
func TestRequestCounters(t *testing.T) {
	t.Parallel()
	m, err := newMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct {
		kind, method string
		status       int
	}{
		{kindBlob, http.MethodGet, 200}, {kindBlob, http.MethodGet, 200}, {kindManifest, http.MethodHead, 404},
		{kindBlob, http.MethodGet, 500}, {"ping", http.MethodGet, 200}, {kindBlob, "BREW", 200},
	} {
		m.request(r.kind, r.method, r.status).Inc()
	}
	for _, tc := range []struct {
		labels []string
		want   float64
	}{
		{[]string{kindBlob, "GET", "200"}, 2}, {[]string{kindManifest, "HEAD", "404"}, 1},
		{[]string{kindBlob, "GET", "500"}, 1}, {[]string{"ping", "GET", "200"}, 1},
		{[]string{kindBlob, "other", "200"}, 1}, {[]string{kindBlob, "HEAD", "200"}, 0},
	} {
		if got := testutil.ToFloat64(m.requests.WithLabelValues(tc.labels...)); got != tc.want {
			t.Errorf("requests %v: got %v, want %v", tc.labels, got, tc.want)
		}
	}
}
