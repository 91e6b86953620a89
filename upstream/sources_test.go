package upstream

import (
	"bytes"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// sourcesConfig makes a blob many chunks, each connection carrying one.
var sourcesConfig = FetchConfig{ConnectionBudget: 64 << 10, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 64 << 10,
	MaxConnections: 4, MaxAttempts: 3}

// TestFetchBlobFromSeveralEndpoints: endpoints that share content fetch
// chunks of one blob together; an endpoint that lacks the blob, or fails,
// leaves it to the others without failing the fetch, and only a failing
// one is left aside; one kept for failover only is asked for nothing while
// the others bring the blob.
func TestFetchBlobFromSeveralEndpoints(t *testing.T) {
	t.Parallel()
	blob := randomBlob(2 << 20)
	d := digest.FromBytes(blob)
	serving := func() *rangeServer { return &rangeServer{blob: blob} }
	refusing := func(status int) *rangeServer {
		return &rangeServer{blob: blob, refuse: func(int) int { return status }}
	}
	tests := []struct {
		name     string
		servers  []*rangeServer // nil: a closed port
		failover []bool         // kept for failover only
		brought  []bool         // which endpoints bring bytes
		down     []bool         // which endpoints are left aside after
	}{
		{name: "two that share content: both bring bytes",
			servers: []*rangeServer{serving(), serving()}, brought: []bool{true, true}, down: []bool{false, false}},
		{name: "three: all bring bytes",
			servers: []*rangeServer{serving(), serving(), serving()}, brought: []bool{true, true, true}, down: []bool{false, false, false}},
		{name: "the first lacks the blob: the second brings it, and the first is not left aside",
			servers: []*rangeServer{refusing(http.StatusNotFound), serving()}, brought: []bool{false, true}, down: []bool{false, false}},
		{name: "the second fails: the first brings it, and the second is left aside",
			servers: []*rangeServer{serving(), refusing(http.StatusServiceUnavailable)}, brought: []bool{true, false}, down: []bool{false, true}},
		{name: "the second unreachable: the first brings it",
			servers: []*rangeServer{serving(), nil}, brought: []bool{true, false}, down: []bool{false, true}},
		{name: "the second kept for failover: asked for nothing",
			servers: []*rangeServer{serving(), serving()}, failover: []bool{false, true}, brought: []bool{true, false}, down: []bool{false, false}},
		{name: "the first down, the second kept for failover: the second brings it",
			servers: []*rangeServer{nil, serving()}, failover: []bool{false, true}, brought: []bool{false, true}, down: []bool{true, false}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var urls []string
			var opts []Option
			for i, s := range tt.servers {
				u := closedURL(t)
				if s != nil {
					srv := httptest.NewServer(s)
					t.Cleanup(srv.Close)
					u = srv.URL
				}
				urls = append(urls, u)
				if len(tt.failover) > i && tt.failover[i] {
					opts = append(opts, WithFailoverOnly(u))
				}
			}
			r := newFetchRegistry(t, sourcesConfig, urls, opts...)
			w := newMemBlobWriter(int64(len(blob)))
			report, err := r.FetchBlob(t.Context(), "org/app", d, w)
			if err != nil {
				t.Fatalf("FetchBlob: %v", err)
			}
			checkBlob(t, w, blob)
			var sum int64
			brought := make([]bool, len(urls))
			for _, s := range report.Sources {
				sum += s.Bytes
				brought[slices.Index(r.Endpoints(), s.Endpoint)] = true
			}
			if !slices.Equal(brought, tt.brought) {
				t.Errorf("endpoints that brought bytes: got %v, want %v (report %+v)", brought, tt.brought, report.Sources)
			}
			if sum < int64(len(blob)) {
				t.Errorf("sources brought %d bytes in all, fewer than the blob's %d", sum, len(blob))
			}
			if report.Endpoint != report.Sources[0].Endpoint {
				t.Errorf("report's endpoint %q, not its first source's %q", report.Endpoint, report.Sources[0].Endpoint)
			}
			for i, st := range r.Status().Endpoints {
				if got := !st.Up; got != tt.down[i] {
					t.Errorf("endpoint %d left aside: got %v, want %v", i, got, tt.down[i])
				}
			}
			for i, s := range tt.servers {
				if s != nil && len(tt.failover) > i && tt.failover[i] && tt.brought[i] == false && len(s.all()) > 0 {
					t.Errorf("endpoint %d, failover only, was asked %d requests while the others brought the blob", i, len(s.all()))
				}
			}
		})
	}
}

// TestFetchBlobSeveralEndpointsAllFail: when every endpoint fails, the
// error says what each found, and is of their kind.
func TestFetchBlobSeveralEndpointsAllFail(t *testing.T) {
	t.Parallel()
	blob := randomBlob(256 << 10)
	var urls []string
	for range 2 {
		srv := httptest.NewServer(&rangeServer{blob: blob, refuse: func(int) int { return http.StatusNotFound }})
		t.Cleanup(srv.Close)
		urls = append(urls, srv.URL)
	}
	r := newFetchRegistry(t, sourcesConfig, urls)
	_, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), newMemBlobWriter(int64(len(blob))))
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("got %v, want ErrNotFound", err)
	}
	for _, u := range urls {
		if h := strings.TrimPrefix(u, "http://"); !strings.Contains(err.Error(), h) {
			t.Errorf("error %q does not name endpoint %s", err, h)
		}
	}
}

// TestFetchBlobCorruptFromSeveral: a blob that failed verification with
// bytes from several endpoints in it, and no endpoint to suspect (the
// report names no ranges), comes from one endpoint at a time next, so that
// a failure names the one serving it corrupt; once that one is reported
// alone, the other brings it.
func TestFetchBlobCorruptFromSeveral(t *testing.T) {
	t.Parallel()
	blob := randomBlob(1 << 20)
	corrupt := slices.Clone(blob)
	corrupt[len(corrupt)-1] ^= 0xff
	d := digest.FromBytes(blob)
	servers := []*rangeServer{{blob: corrupt}, {blob: blob}}
	urls := serveAll(t, servers...)
	r := newFetchRegistry(t, sourcesConfig, urls)
	cause := errors.New("digest mismatch")
	r.ReportCorrupt(d, fetchedFrom(r.Endpoints()...), cause)
	for attempt, want := range []struct {
		from int
		blob []byte
	}{{0, corrupt}, {1, blob}} {
		before := [2]int{len(servers[0].all()), len(servers[1].all())}
		w := newMemBlobWriter(int64(len(blob)))
		report, err := r.FetchBlob(t.Context(), "org/app", d, w)
		if err != nil {
			t.Fatalf("attempt %d: %v", attempt+1, err)
		}
		checkBlob(t, w, want.blob)
		if len(report.Sources) != 1 || report.Endpoint != r.Endpoints()[want.from] {
			t.Fatalf("attempt %d: sources %+v, want endpoint %d alone", attempt+1, report.Sources, want.from)
		}
		if other := 1 - want.from; len(servers[other].all()) != before[other] {
			t.Errorf("attempt %d: endpoint %d was asked too", attempt+1, other)
		}
		if !slices.Equal(want.blob, blob) {
			r.ReportCorrupt(d, report, cause) // as the download does when the digest fails
		}
	}
}

// TestFetchBlobSuspectRefetched: a blob that failed verification with
// bytes from two endpoints, one serving it corrupt throughout, keeps the
// bytes but the suspect's ranges, which the next fetch brings from the
// other alone; the rounds end with the blob intact and the corrupt
// endpoint, and only it, kept from the blob.
func TestFetchBlobSuspectRefetched(t *testing.T) {
	t.Parallel()
	blob := randomBlob(1 << 20)
	corrupt := slices.Clone(blob)
	for i := range corrupt {
		corrupt[i] ^= 0x5a
	}
	d := digest.FromBytes(blob)
	servers := []*rangeServer{{blob: corrupt}, {blob: blob}}
	urls := serveAll(t, servers...)
	r := newFetchRegistry(t, sourcesConfig, urls)
	w := newMemBlobWriter(int64(len(blob)))
	cause := errors.New("digest mismatch")
	for round := 1; ; round++ {
		if round > 3 {
			t.Fatal("the blob did not verify within three fetches")
		}
		suspect := r.corrupt.suspected(d, r.now())
		before := [2]int{len(servers[0].all()), len(servers[1].all())}
		report, err := r.FetchBlob(t.Context(), "org/app", d, w)
		if err != nil {
			t.Fatalf("fetch %d: %v", round, err)
		}
		for i, u := range urls {
			if u == suspect && len(servers[i].all()) != before[i] {
				t.Errorf("fetch %d: the suspect, endpoint %d, was asked", round, i)
			}
		}
		if bytes.Equal(w.Bytes(), blob) {
			r.ReportVerified(d, report)
			break
		}
		redo := r.ReportCorrupt(d, report, cause) // as the download does when the digest fails
		if len(redo) == 0 {
			w = newMemBlobWriter(int64(len(blob))) // discarded whole
			continue
		}
		w.retract(redo)
	}
	st := r.Status().Corrupt
	if len(st) != 1 || st[0].Endpoint != urls[0] {
		t.Errorf("kept from the blob: got %+v, want endpoint 0 alone", st)
	}
}

// TestSourceGivesWay: a source gives way once a tenth of the bytes its
// recent chunks asked for or more were lost to cuts, twice the share of
// another source still fetching; not with too few outcomes to judge, nor
// alone, nor to a source as bad, nor to one that stopped; a path cut often
// but late in each request, losing little, does not.
func TestSourceGivesWay(t *testing.T) {
	t.Parallel()
	now := time.Now()
	const chunk = 1 << 20
	tests := []struct {
		name         string
		outcomes     [][2]int // per source: chunks, of which cut
		stopped      []bool
		lostOfCut    []int64 // per source: what a cut chunk lost of its MiB; half where not given
		wantGivesWay bool    // the first source's
	}{
		{"alone", [][2]int{{20, 20}}, nil, nil, false},
		{"too few outcomes to judge", [][2]int{{7, 7}, {20, 0}}, nil, nil, false},
		{"the other too few to judge", [][2]int{{20, 20}, {7, 0}}, nil, nil, false},
		{"a tenth lost, the other nothing", [][2]int{{20, 4}, {20, 0}}, nil, nil, true},
		{"under a tenth lost", [][2]int{{20, 3}, {20, 0}}, nil, nil, false},
		{"a quarter lost, the other an eighth", [][2]int{{20, 10}, {20, 5}}, nil, nil, true},
		{"a quarter lost, the other nearly as much", [][2]int{{20, 10}, {20, 6}}, nil, nil, false},
		{"the sound one stopped", [][2]int{{20, 10}, {20, 0}}, []bool{false, true}, nil, false},
		{"one of two others sound", [][2]int{{20, 10}, {20, 10}, {20, 0}}, nil, nil, true},
		{"cut often, late in each request", [][2]int{{20, 10}, {20, 0}}, nil, []int64{chunk / 20}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &blobFetch{}
			for i, o := range tt.outcomes {
				ep := &endpoint{}
				lost := int64(chunk / 2)
				if i < len(tt.lostOfCut) {
					lost = tt.lostOfCut[i]
				}
				for k := range o[0] {
					at := now.Add(-time.Duration(k) * time.Second)
					if k < o[1] {
						ep.health.chunk(at, true, chunk-lost, lost)
					} else {
						ep.health.chunk(at, false, chunk, 0)
					}
				}
				s := &source{blobFetch: f, ep: ep, stopped: make(chan struct{})}
				if len(tt.stopped) > i && tt.stopped[i] {
					close(s.stopped)
				}
				f.sources = append(f.sources, s)
			}
			if got := f.sources[0].givesWay(now); got != tt.wantGivesWay {
				t.Errorf("gives way: got %v, want %v", got, tt.wantGivesWay)
			}
		})
	}
}

// TestSourcesScoutUnknownPaths: endpoints sharing a blob whose paths'
// round trips are not known yet (asked for blobs only) each send one
// request first, and their other workers follow its answer, so that the
// pipe starts them by their path's length; then they fetch together.
func TestSourcesScoutUnknownPaths(t *testing.T) {
	t.Parallel()
	blob := randomBlob(8 << 20)
	d := digest.FromBytes(blob)
	type scouted struct {
		mu       sync.Mutex
		answered bool
		early    int // GETs that arrived before the first was answered
		gets     int
	}
	var urls []string
	var seen []*scouted
	for range 2 {
		sc := &scouted{}
		seen = append(seen, sc)
		s := &rangeServer{blob: blob, refuse: func(i int) int {
			if i == 0 {
				time.Sleep(100 * time.Millisecond)
			} else {
				time.Sleep(10 * time.Millisecond) // the blob takes a while: both fetch
			}
			sc.mu.Lock()
			defer sc.mu.Unlock()
			sc.gets++
			if i == 0 {
				sc.answered = true
			} else if !sc.answered {
				sc.early++
			}
			return 0
		}}
		srv := httptest.NewServer(s)
		t.Cleanup(srv.Close)
		urls = append(urls, srv.URL)
	}
	r := newFetchRegistry(t, sourcesConfig, urls)
	w := newMemBlobWriter(int64(len(blob)))
	if _, err := r.FetchBlob(t.Context(), "org/app", d, w); err != nil {
		t.Fatal(err)
	}
	checkBlob(t, w, blob)
	for i, sc := range seen {
		sc.mu.Lock()
		if sc.early > 0 || sc.gets < 2 {
			t.Errorf("endpoint %d: %d GETs, %d of them before the first was answered; want several, none before", i, sc.gets, sc.early)
		}
		sc.mu.Unlock()
	}
}

// serveAll serves each of servers on a test server of its own, closed when
// the test ends, and returns their URLs in order.
func serveAll(t *testing.T, servers ...*rangeServer) []string {
	t.Helper()
	urls := make([]string, len(servers))
	for i, s := range servers {
		srv := httptest.NewServer(s)
		t.Cleanup(srv.Close)
		urls[i] = srv.URL
	}
	return urls
}
