package proxy

import (
	"net/http"
	"strings"
	"testing"

	"github.com/distribution/reference"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

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
