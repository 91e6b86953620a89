package upstream

import (
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// statusServer answers every request with status, counting them.
type statusServer struct {
	status int
	header http.Header
	n      atomic.Int64
}

func (s *statusServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.n.Add(1)
	for k, v := range s.header {
		w.Header()[k] = v
	}
	w.WriteHeader(s.status)
}

// TestRateLimitHonoured: a 429 with Retry-After holds requests off, without
// asking the upstream again, for as long as it said; its rate-limit headers
// become metrics.
func TestRateLimitHonoured(t *testing.T) {
	t.Parallel()
	s := &statusServer{status: http.StatusTooManyRequests, header: http.Header{
		"Retry-After": {"30"}, "Ratelimit-Remaining": {"0;w=21600"}, "Ratelimit-Limit": {"100;w=21600"}}}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	r, err := New("docker.io", []string{srv.URL}, WithMetrics(m), WithLogger(discardLogger))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, known := r.PullsLeft(); known {
		t.Errorf("PullsLeft before any answer: known, want unknown")
	}
	for i := range 3 {
		_, err := r.HeadManifest(t.Context(), "library/alpine", "latest", nil)
		checkKind(t, err, ErrTooManyRequests)
		if e := asError(t, err); e.RetryAfter < 25*time.Second || e.RetryAfter > 30*time.Second {
			t.Errorf("call %d: RetryAfter %v, want about 30s", i, e.RetryAfter)
		}
	}
	if got := s.n.Load(); got != 1 {
		t.Errorf("requests upstream: got %d, want 1 (then held off)", got)
	}
	if got := testutil.ToFloat64(m.rateRemaining.WithLabelValues("docker.io")); got != 0 {
		t.Errorf("ratelimit remaining: got %v, want 0", got)
	}
	if got := testutil.ToFloat64(m.rateLimit.WithLabelValues("docker.io")); got != 100 {
		t.Errorf("ratelimit limit: got %v, want 100", got)
	}
	if left, limit, known := r.PullsLeft(); left != 0 || limit != 100 || !known {
		t.Errorf("PullsLeft: got %d, %d, %v, want 0, 100, true", left, limit, known)
	}
}

func TestParseRateLimit(t *testing.T) {
	t.Parallel()
	tests := []struct {
		header string
		want   int64
		ok     bool
	}{
		{"76;w=21600", 76, true},
		{"100", 100, true},
		{" 5 ;w=60", 5, true},
		{"0;w=21600", 0, true},
		{"", 0, false},
		{"many;w=60", 0, false},
		{"-1;w=60", 0, false},
		{"1.5", 0, false},
	}
	for _, tt := range tests {
		if got, ok := parseRateLimit(tt.header); got != tt.want || ok != tt.ok {
			t.Errorf("parseRateLimit(%q): got %d, %v, want %d, %v", tt.header, got, ok, tt.want, tt.ok)
		}
	}
}

// TestPullsLeft: each answer's window replaces the last; one that gives
// the pulls left without the limit keeps the last limit.
func TestPullsLeft(t *testing.T) {
	t.Parallel()
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	r := &Registry{name: "docker.io", metrics: m, log: discardLogger}
	steps := []struct {
		header      http.Header
		left, limit int64
		known       bool
	}{
		{http.Header{}, 0, 0, false},
		{http.Header{"Ratelimit-Limit": {"100;w=21600"}}, 0, 0, false}, // no count left: nothing to go by
		{http.Header{"Ratelimit-Remaining": {"76;w=21600"}, "Ratelimit-Limit": {"100;w=21600"}}, 76, 100, true},
		{http.Header{"Ratelimit-Remaining": {"75;w=21600"}}, 75, 100, true},
		{http.Header{"Ratelimit-Remaining": {"junk"}}, 75, 100, true},
		{http.Header{"Ratelimit-Remaining": {"199"}, "Ratelimit-Limit": {"200"}}, 199, 200, true},
	}
	for i, s := range steps {
		r.recordRateLimit(&http.Response{StatusCode: http.StatusOK, Header: s.header})
		if left, limit, known := r.PullsLeft(); left != s.left || limit != s.limit || known != s.known {
			t.Errorf("answer %d: got %d, %d, %v, want %d, %d, %v", i, left, limit, known, s.left, s.limit, s.known)
		}
	}
}

// pushedRegistry is an in-process registry holding one image as team/app:v1.
func pushedRegistry(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	img, err := random.Image(1000, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := name.ParseReference(host(srv)+"/team/app:v1", name.Insecure)
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	return srv
}

// TestDeadEndpointLeftAside: once an endpoint fails, the next requests go to
// the healthy one first instead of waiting on the dead one each time.
func TestDeadEndpointLeftAside(t *testing.T) {
	t.Parallel()
	dead := &statusServer{status: http.StatusServiceUnavailable}
	deadSrv := httptest.NewServer(dead)
	t.Cleanup(deadSrv.Close)
	r := newTestRegistry(t, deadSrv.URL, pushedRegistry(t).URL)
	for i := range 3 {
		if _, err := r.HeadManifest(t.Context(), "team/app", "v1", nil); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if got := dead.n.Load(); got != 1 {
		t.Errorf("requests to the dead endpoint: got %d, want 1 (then left aside)", got)
	}
}

// TestTagMissingOnReplica: a tag the replica lacks, asked for because the
// primary is down, is reported as such.
func TestTagMissingOnReplica(t *testing.T) {
	t.Parallel()
	deadSrv := httptest.NewServer(&statusServer{status: http.StatusBadGateway})
	t.Cleanup(deadSrv.Close)
	replica := pushedRegistry(t)
	r, err := New("ecr", []string{deadSrv.URL, replica.URL}, WithLogger(discardLogger),
		WithEndpointRegion(deadSrv.URL, "us-east-2"), WithEndpointRegion(replica.URL, "us-east-1"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = r.HeadManifest(t.Context(), "team/app", "v0-before-replication", nil)
	checkKind(t, err, ErrNotFound)
	for _, want := range []string{"not on us-east-1", "us-east-2", "replication does not backfill tags pushed before the rule existed"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("got %v, want it to say %q", err, want)
		}
	}
}

// TestDegradedEndpointShares: an endpoint most of whose chunks are cut (a
// degraded path) fetches blobs alongside a clean replica until its cuts are
// counted, then gives way to it, without being left aside: every blob
// completes, the replica bringing part of each.
func TestDegradedEndpointShares(t *testing.T) {
	t.Parallel()
	var blobs [][]byte
	for i := range 3 {
		b := randomBlob(600_000)
		b[0] = byte(i) // three different blobs
		blobs = append(blobs, b)
	}
	var degraded, clean []*rangeServer
	mux := func(list *[]*rangeServer, cut int) http.Handler {
		hs := http.NewServeMux()
		for _, b := range blobs {
			s := &rangeServer{blob: b, cutAfter: cut}
			*list = append(*list, s)
			hs.Handle("/v2/team/app/blobs/"+digest.FromBytes(b).String(), s)
		}
		return hs
	}
	bad := httptest.NewServer(mux(&degraded, 20_000))
	good := httptest.NewServer(mux(&clean, 0))
	t.Cleanup(bad.Close)
	t.Cleanup(good.Close)
	tr := NewTransport()
	r, err := New("ecr", []string{bad.URL, good.URL}, WithTransport(tr), WithLogger(discardLogger),
		WithFetchConfig(FetchConfig{ConnectionBudget: 64 << 10, MinConnectionBudget: 16 << 10, MaxConnectionBudget: 64 << 10, MaxAttempts: 100}))
	if err != nil {
		t.Fatal(err)
	}
	for i, b := range blobs {
		w := newMemBlobWriter(-1)
		if _, err := r.FetchBlob(t.Context(), "team/app", digest.FromBytes(b), w); err != nil {
			t.Fatalf("blob %d: %v", i, err)
		}
		checkBlob(t, w, b)
	}
	if len(degraded[0].all()) == 0 {
		t.Error("the first blob did not use the degraded endpoint")
	}
	for i := range blobs {
		if len(clean[i].all()) == 0 {
			t.Errorf("blob %d: no request to the clean replica", i)
		}
	}
	for i, st := range r.Status().Endpoints {
		if !st.Up {
			t.Errorf("endpoint %d left aside (%s), want it up", i, st.LastError)
		}
	}
}
