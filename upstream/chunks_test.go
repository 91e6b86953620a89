package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Tests of the chunked fetch: connection budgets, stalls, redirects reused,
// upstreams that ignore Range or hold more bytes, priorities and bounds.

// headerAllowance bounds the bytes of a response's status line and headers.
const headerAllowance = 1024

// askedLen returns how many bytes of a blob of size bytes a GET asked for.
func askedLen(g served, size int64) int64 {
	start, end, ok := parseRangeHeader(g.rng)
	if !ok {
		return size
	}
	if end < 0 || end > size {
		end = size
	}
	return end - start
}

// TestFetchBlobChunksWithinBudget checks that with a fixed budget every
// chunk is a closed range of at most the budget, on a connection of its own
// that carries at most the budget and its headers.
func TestFetchBlobChunksWithinBudget(t *testing.T) {
	t.Parallel()
	const (
		budget = 64 << 10
		size   = 1<<20 + 12345
	)
	blob := randomBlob(size)
	s := &rangeServer{blob: blob}
	srv := newCountingServer(t, s)
	r := newFetchRegistry(t, fixedBudget(budget, 4), []string{srv.URL})
	w := newMemBlobWriter(-1)
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	gets := s.getRequests()
	checkChunks(t, gets, size, budget)
	if want := (size + budget - 1) / budget; len(gets) != want {
		t.Errorf("GETs: got %v, want %v", len(gets), want)
	}
	perConn := map[*countingConn]int{}
	for _, g := range gets {
		if g.conn == nil {
			t.Fatalf("GET %q: got no connection recorded, want one", g.rng)
		}
		perConn[g.conn]++
		if got := g.conn.written.Load(); got > budget+headerAllowance {
			t.Errorf("connection of GET %q: got %v bytes, want at most %v", g.rng, got, budget+headerAllowance)
		}
	}
	for _, g := range gets {
		if n := perConn[g.conn]; n != 1 {
			t.Errorf("requests on the connection of GET %q: got %v, want %v", g.rng, n, 1)
		}
	}
}

// TestFetchBlobReusesConnections: a connection carries chunks of at most
// maxChunkTarget one after another while its budget has room, never more than
// the budget in all; a session the path cuts is recorded at the bytes it
// carried in all chunks, so the budget settles under the session's cut-off,
// not under a chunk's share of it.
func TestFetchBlobReusesConnections(t *testing.T) {
	t.Parallel()
	const (
		size     = 64 << 20
		budget   = 16 << 20
		parallel = 2
	)
	tests := []struct {
		name  string
		cutAt int64 // bytes a session carries before the path cuts it; 0: never
		cfg   FetchConfig
	}{
		{"clean path, fixed budget", 0,
			FetchConfig{ConnectionBudget: budget, MaxConnectionBudget: budget, ParallelChunks: parallel}},
		{"sessions cut at 2.5 MB", 2_500_000,
			FetchConfig{ConnectionBudget: budget, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 2 * budget, ParallelChunks: parallel}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			blob := randomBlob(size)
			s := &rangeServer{blob: blob}
			srv := newCuttingServer(t, s, tt.cutAt)
			r := newFetchRegistry(t, tt.cfg, []string{srv.URL})
			w := newMemBlobWriter(-1)
			if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			checkBlob(t, w, blob)
			gets := s.getRequests()
			if tt.cutAt == 0 {
				checkChunks(t, gets, size, maxChunkTarget+minChunk)
			} // else the server counts bytes it wrote past the cut as delivered
			perConn := map[*countingConn]int{}
			for _, g := range gets {
				perConn[g.conn]++
			}
			reused := 0
			for c, n := range perConn {
				if got := c.written.Load(); got > budget+int64(n)*headerAllowance {
					t.Errorf("a connection carried %v bytes in %v answers, want at most the budget, %v, and their headers", got, n, budget)
				}
				if n > 1 {
					reused++
				}
			}
			if reused == 0 {
				t.Errorf("connections that carried more than one chunk: got none of %v, want some", len(perConn))
			}
			got := r.endpoints[0].budget.get()
			if tt.cutAt == 0 {
				if most := size/(budget-maxChunkTarget) + 2*parallel; len(perConn) > most {
					t.Errorf("connections: got %v for %v chunks, want at most %v", len(perConn), len(gets), most)
				}
				if got != budget {
					t.Errorf("budget: got %v, want %v", got, budget)
				}
				return
			}
			// A cut recorded at a chunk's own bytes would put the budget
			// under half the cut-off.
			if got >= tt.cutAt || got < tt.cutAt/2 {
				t.Errorf("budget: got %v, want %v to %v", got, tt.cutAt/2, tt.cutAt-1)
			}
		})
	}
}

// TestFetchBlobLearnsBudgetFromCuts: every connection whose answer would
// carry more than cutAt bytes is killed there. The fetch completes, and the
// endpoint's budget ends below cutAt.
func TestFetchBlobLearnsBudgetFromCuts(t *testing.T) {
	t.Parallel()
	const (
		cutAt    = 100_000
		initial  = 256 << 10
		size     = 1 << 20
		parallel = 4
	)
	blob := randomBlob(size)
	s := &rangeServer{blob: blob, cutAfter: cutAt}
	srv := newCountingServer(t, s)
	m, reg := newTestMetrics(t)
	cfg := FetchConfig{ConnectionBudget: initial, MinConnectionBudget: 16 << 10, MaxConnectionBudget: 4 << 20, ParallelChunks: parallel}
	r := newFetchRegistry(t, cfg, []string{srv.URL}, WithMetrics(m))
	w := newMemBlobWriter(-1)
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)

	labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv)}
	budget := metricValue(t, reg, "pullproxy_upstream_connection_budget_bytes", labels)
	if budget >= cutAt || budget < float64(cfg.MinConnectionBudget) {
		t.Errorf("budget: got %v, want %v to %v", budget, cfg.MinConnectionBudget, cutAt-1)
	}
	if got := r.endpoints[0].budget.get(); float64(got) != budget {
		t.Errorf("endpoint budget: got %v, want the gauge's %v", got, budget)
	}
	gets := s.getRequests()
	// A probe before the first cut may ask for cleanGrowth times the budget.
	checkChunks(t, gets, size, cleanGrowth*initial)
	// Only chunks claimed before the cut-off was learned can be cut: it
	// takes cutOutliers+1 regular chunks cut, whose workers claim again at
	// once, at the old budget, and a probe's cut does not count: each
	// worker's first two chunks at most.
	cut := 0
	for _, g := range gets {
		if g.sent < askedLen(g, size) {
			cut++
		}
	}
	if most := 2 * parallel; cut == 0 || cut > most {
		t.Errorf("chunks cut: got %v, want 1 to %v", cut, most)
	}
	if got := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", labels); got != float64(cut) {
		t.Errorf("pullproxy_upstream_connection_cuts_total: got %v, want %v", got, cut)
	}
	cutLabels := map[string]string{"upstream": testUpstream, "endpoint": host(srv), "result": "cut"}
	if got := metricValue(t, reg, "pullproxy_upstream_chunks_total", cutLabels); got != float64(cut) {
		t.Errorf("pullproxy_upstream_chunks_total{result=cut}: got %v, want %v", got, cut)
	}
	if got := metricValue(t, reg, "pullproxy_upstream_blob_bytes_total", nil); got < size {
		t.Errorf("pullproxy_upstream_blob_bytes_total: got %v, want at least %v", got, size)
	}
}

// TestFetchBlobBudgetAdapts checks the budget on a clean path: it grows
// (by probes of larger chunks) towards MaxBudget, and stays put when
// MaxBudget is Budget.
func TestFetchBlobBudgetAdapts(t *testing.T) {
	t.Parallel()
	const (
		initial = 16 << 10
		size    = 1 << 20
	)
	tests := []struct {
		name      string
		maxBudget int64
	}{
		{"adaptive", 256 << 10},
		{"fixed", initial},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			blob := randomBlob(size)
			s := &rangeServer{blob: blob}
			srv := newCountingServer(t, s)
			m, reg := newTestMetrics(t)
			cfg := FetchConfig{ConnectionBudget: initial, MinConnectionBudget: initial, MaxConnectionBudget: tt.maxBudget, ParallelChunks: 1}
			r := newFetchRegistry(t, cfg, []string{srv.URL}, WithMetrics(m))
			w := newMemBlobWriter(-1)
			if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			checkBlob(t, w, blob)
			gets := s.getRequests()
			checkChunks(t, gets, size, tt.maxBudget)
			var longest int64
			for _, g := range gets {
				longest = max(longest, askedLen(g, size))
				if got := g.conn.written.Load(); got > tt.maxBudget+headerAllowance {
					t.Errorf("connection of GET %q: got %v bytes, want at most %v", g.rng, got, tt.maxBudget+headerAllowance)
				}
			}
			got := r.endpoints[0].budget.get()
			labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv)}
			if gauge := metricValue(t, reg, "pullproxy_upstream_connection_budget_bytes", labels); gauge != float64(got) {
				t.Errorf("pullproxy_upstream_connection_budget_bytes: got %v, want the budget, %v", gauge, got)
			}
			if tt.maxBudget == initial {
				if got != initial {
					t.Errorf("budget: got %v, want %v", got, initial)
				}
				if want := size / initial; len(gets) != want {
					t.Errorf("GETs: got %v, want %v", len(gets), want)
				}
				return
			}
			if got <= initial || got > tt.maxBudget {
				t.Errorf("budget: got %v, want above %v, at most %v", got, initial, tt.maxBudget)
			}
			if longest <= initial {
				t.Errorf("longest chunk: got %v, want above %v", longest, initial)
			}
		})
	}
}

// TestFetchBlobRenewsConnectionsOnACleanPath: once probes have grown the
// budget and no session was cut, a connection that used its allowance
// carries on with another budget's worth instead of being replaced by one
// in slow start, never past max_connection_budget. (That a cut stops it is
// TestBudget's "renewal".)
func TestFetchBlobRenewsConnectionsOnACleanPath(t *testing.T) {
	t.Parallel()
	const (
		initial   = 16 << 10
		maxBudget = 4 << 20
		size      = 4 << 20
	)
	blob := randomBlob(size)
	s := &rangeServer{blob: blob}
	srv := newCountingServer(t, s)
	cfg := FetchConfig{ConnectionBudget: initial, MinConnectionBudget: initial, MaxConnectionBudget: maxBudget, ParallelChunks: 1}
	r := newFetchRegistry(t, cfg, []string{srv.URL})
	w := newMemBlobWriter(-1)
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	budget := r.endpoints[0].budget.get()
	conns := map[*countingConn]bool{}
	var most int64
	for _, g := range s.getRequests() {
		conns[g.conn] = true
		most = max(most, g.conn.written.Load())
	}
	if most > maxBudget+headerAllowance {
		t.Errorf("a connection carried %v bytes, want at most max_connection_budget, %v, and its headers", most, maxBudget)
	}
	if most <= cleanGrowth*budget+headerAllowance {
		t.Errorf("the most a connection carried: %v bytes, want more than a probe of the budget, %v, could (%d connections)",
			most, cleanGrowth*budget, len(conns))
	}
}

// TestFetchBlobStallResumes: the first answer stops sending part-way; the
// chunk is abandoned after StallTimeout and asked for again from its first
// missing byte.
func TestFetchBlobStallResumes(t *testing.T) {
	t.Parallel()
	const (
		size    = 100_000
		stallAt = 30_000
	)
	blob := randomBlob(size)
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	s := &rangeServer{blob: blob, hold: func(i int) (int, <-chan struct{}) {
		if i == 0 {
			return stallAt, release
		}
		unblock() // the stalled answer was given up: let its handler end
		return 0, nil
	}}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	t.Cleanup(unblock) // before Close, which waits for handlers
	m, reg := newTestMetrics(t)
	r := newFetchRegistry(t, FetchConfig{ParallelChunks: 1, StallTimeout: 200 * time.Millisecond}, []string{srv.URL}, WithMetrics(m))
	w := newMemBlobWriter(-1)
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	gets := s.getRequests()
	if len(gets) < 2 {
		t.Fatalf("GETs: got %q, want at least two", ranges(gets))
	}
	if got, want := gets[0].rng, "bytes=0-99999"; got != want {
		t.Errorf("first Range: got %v, want %v", got, want)
	}
	if start, _, _ := parseRangeHeader(gets[1].rng); start != stallAt {
		t.Errorf("second Range: got %q, want one from %v", gets[1].rng, stallAt)
	}
	checkChunks(t, gets, size, 1<<20)
	labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv), "kind": "stall"}
	if got := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", labels); got != 1 {
		t.Errorf("pullproxy_upstream_connection_cuts_total{kind=stall}: got %v, want %v", got, 1)
	}
}

// TestFetchBlobHedgesASilentEnd: the only chunk in flight stops sending
// part-way, with nothing else left to claim; another worker asks for its
// rest after hedgeAfter, long before StallTimeout, and the silent request is
// ended with the blob, counted as no stall. Near a blob's end bytes are
// written tailGather at a time, so the rest asked for again starts at most
// that far before where the silent answer stopped.
func TestFetchBlobHedgesASilentEnd(t *testing.T) {
	t.Parallel()
	const (
		size    = 100_000
		stallAt = 70_000
	)
	blob := randomBlob(size)
	release := make(chan struct{})
	s := &rangeServer{blob: blob, hold: func(i int) (int, <-chan struct{}) {
		if i == 0 {
			return stallAt, release
		}
		return 0, nil
	}}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) }) // before Close, which waits for handlers
	m, reg := newTestMetrics(t)
	// Were the silent chunk left to StallTimeout, the test would run for a
	// minute and count a stall.
	r := newFetchRegistry(t, FetchConfig{ParallelChunks: 2, StallTimeout: time.Minute}, []string{srv.URL}, WithMetrics(m))
	w := newMemBlobWriter(-1)
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	gets := s.getRequests()
	if len(gets) != 2 {
		t.Fatalf("GETs: got %q, want two", ranges(gets))
	}
	// The silent answer's last bytes may still be held for a write (see
	// gather): the rest is asked for from the first byte not written.
	if start, end, _ := parseRangeHeader(gets[1].rng); start > stallAt || start < stallAt-tailGather || end != size {
		t.Errorf("second Range: got %q, want one from between %v and %v to the end", gets[1].rng, stallAt-tailGather, stallAt)
	}
	labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv), "kind": "stall"}
	if got := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", labels); got != 0 {
		t.Errorf("pullproxy_upstream_connection_cuts_total{kind=stall}: got %v, want 0", got)
	}
}

// TestFetchBlobHedgeRaceEndsEarly: the only chunk in flight goes silent,
// its rest is asked for again, and the silent answer then resumes, so that
// two requests race for the same bytes. The one behind ends as soon as it
// finds its next bytes written (counted as overtaken), instead of both
// bringing the rest: the upstream sends the blob's bytes about once.
func TestFetchBlobHedgeRaceEndsEarly(t *testing.T) {
	t.Parallel()
	const (
		size    = minChunkTarget + minChunk // shared by the two workers
		stallAt = 64 << 10
		piece   = 16 << 10
	)
	blob := randomBlob(size)
	var (
		gets      atomic.Int32
		silentEnd atomic.Int64
		sent      atomic.Int64
		hedged    = make(chan struct{})
		hedgeOnce sync.Once
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			gets.Add(1)
		}
		start, end, ok := startRange(w, r, size)
		if !ok {
			return
		}
		// The answer from byte 0 goes silent; a request within its range
		// after that is its rest asked for again.
		silent := start == 0
		if start >= stallAt && start < silentEnd.Load() {
			hedgeOnce.Do(func() { close(hedged) })
		}
		if silent {
			silentEnd.Store(end)
		}
		w.WriteHeader(http.StatusPartialContent)
		// Paced, so that what the socket buffers hold stays small next to
		// what a request that read on to the end would bring twice.
		for off := start; off < end; off += piece {
			if silent && off == stallAt {
				select { // silent until the rest is asked for again
				case <-hedged:
				case <-r.Context().Done():
					return
				}
			}
			n, err := w.Write(blob[off:min(off+piece, end)])
			sent.Add(int64(n))
			if err != nil {
				return
			}
			w.(http.Flusher).Flush()
			time.Sleep(2 * time.Millisecond)
		}
	}))
	t.Cleanup(srv.Close)
	m, reg := newTestMetrics(t)
	cfg := fixedBudget(size, 2)
	cfg.StallTimeout = time.Minute
	r := newFetchRegistry(t, cfg, []string{srv.URL}, WithMetrics(m))
	w := newMemBlobWriter(-1)
	rep, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w)
	if err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	if got := gets.Load(); got != 3 {
		t.Fatalf("GETs: got %d, want three (two chunks, and the silent one's rest asked for again)", got)
	}
	// Without the early end, the race sends the 0.7 MiB after the stall
	// twice.
	if got, most := sent.Load(), int64(size+384<<10); got > most {
		t.Errorf("bytes sent: got %d, want at most %d (the blob, and what the requests held when one overtook the other)", got, most)
	}
	labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv), "result": "overtaken"}
	if got := metricValue(t, reg, "pullproxy_upstream_chunks_total", labels); got != 1 {
		t.Errorf("pullproxy_upstream_chunks_total{result=overtaken}: got %v, want 1", got)
	}
	if rep.Hedges != 1 || rep.Overtaken != 1 {
		t.Errorf("report: got %d hedges, %d overtaken, want 1 and 1", rep.Hedges, rep.Overtaken)
	}
	// What the server sent beyond the blob was received and dropped, or
	// was part of what the request given up had not received yet.
	extra := sent.Load() - size
	if rep.DiscardedBytes > extra || rep.DiscardedBytes+rep.AbandonedBytes < extra {
		t.Errorf("report: got %d bytes discarded and %d abandoned, want at most and at least the %d sent beyond the blob, in all",
			rep.DiscardedBytes, rep.AbandonedBytes, extra)
	}
	for kind, want := range map[string]int64{"discarded": rep.DiscardedBytes, "abandoned": rep.AbandonedBytes} {
		labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv), "kind": kind}
		if got := metricValue(t, reg, "pullproxy_upstream_wasted_bytes_total", labels); got != float64(want) {
			t.Errorf("pullproxy_upstream_wasted_bytes_total{kind=%s}: got %v, want the report's %d", kind, got, want)
		}
	}
	t.Logf("bytes sent: %d for a %d-byte blob (%.3fx); %d discarded, %d abandoned", sent.Load(), size,
		float64(sent.Load())/size, rep.DiscardedBytes, rep.AbandonedBytes)
}

// startRange answers a HEAD for a blob of size bytes, or sets the headers
// of a GET's 206 for the Range it asks for (to the blob's end when open or
// past it) and returns that range, for the caller to send; ok is false when
// the request is answered already.
func startRange(w http.ResponseWriter, r *http.Request, size int64) (start, end int64, ok bool) {
	w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
	if r.Method != http.MethodGet {
		return 0, 0, false
	}
	start, end, ok = parseRangeHeader(r.Header.Get("Range"))
	if !ok || start >= size {
		w.WriteHeader(http.StatusRequestedRangeNotSatisfiable)
		return 0, 0, false
	}
	if end < 0 || end > size {
		end = size
	}
	w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end-1, size))
	w.Header().Set("Content-Length", strconv.FormatInt(end-start, 10))
	return start, end, true
}

// TestFetchBlobRangeIgnored: an upstream that answers every range with the
// whole blob (200) is read as one stream.
func TestFetchBlobRangeIgnored(t *testing.T) {
	t.Parallel()
	const (
		size   = 200_000
		budget = 16 << 10
	)
	tests := []struct {
		name     string
		parallel int
		noLength bool
		known    bool
	}{
		{"one chunk at a time", 1, false, false},
		{"four at a time", 4, false, false},
		{"no Content-Length, size known", 4, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			blob := randomBlob(size)
			s := &rangeServer{blob: blob, ignoreRange: true, noLength: tt.noLength}
			srv := httptest.NewServer(s)
			t.Cleanup(srv.Close)
			r := newFetchRegistry(t, fixedBudget(budget, tt.parallel), []string{srv.URL})
			w := newMemBlobWriter(-1)
			if tt.known {
				w = newMemBlobWriter(size)
			}
			if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			checkBlob(t, w, blob)
			// Chunks claimed before the first 200 came back, no more.
			gets := s.getRequests()
			if len(gets) < 1 || len(gets) > tt.parallel {
				t.Errorf("GETs: got %q, want 1 to %v", ranges(gets), tt.parallel)
			}
			if tt.parallel == 1 && (len(gets) != 1 || gets[0].rng != "bytes=0-16383") {
				t.Errorf("Range headers: got %q, want %q", ranges(gets), []string{"bytes=0-16383"})
			}
		})
	}
}

// TestFetchBlobUpstreamLarger: the upstream holds more bytes than the
// manifest declares (an upload stored twice). The declared bytes are fetched
// and the disagreement is logged once, with its likely cause.
func TestFetchBlobUpstreamLarger(t *testing.T) {
	t.Parallel()
	const (
		declared = 50_000
		budget   = 16 << 10
	)
	blob := randomBlob(declared)
	tests := []struct {
		name   string
		stored []byte
		want   string
	}{
		{"stored twice", slices.Concat(blob, blob), "exactly twice the 50000 the manifest declares"},
		{"stored three times", slices.Concat(blob, blob, blob), "exactly 3 times the 50000 the manifest declares"},
		{"larger, not a multiple", slices.Concat(blob, randomBlob(1234)), "but the manifest declares 50000"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s := &rangeServer{blob: tt.stored}
			srv := httptest.NewServer(s)
			t.Cleanup(srv.Close)
			var logs syncBuffer
			logger := slog.New(slog.NewTextHandler(&logs, nil))
			r := newFetchRegistry(t, fixedBudget(budget, 0), []string{srv.URL}, WithLogger(logger))
			w := newMemBlobWriter(declared)
			if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			checkBlob(t, w, blob)
			checkChunks(t, s.getRequests(), declared, budget)
			if got := strings.Count(logs.String(), tt.want); got != 1 {
				t.Errorf("log lines saying %q: got %v, want %v; log:\n%s", tt.want, got, 1, logs.String())
			}
		})
	}
}

// TestFetchBlobWantedFirst: the chunk a client waits for is fetched first.
func TestFetchBlobWantedFirst(t *testing.T) {
	t.Parallel()
	const (
		size   = 1 << 20
		budget = 64 << 10
	)
	tests := []struct {
		name      string
		prefill   int
		wanted    []int64
		wantFirst int64
	}{
		{"a client waits in the middle", 0, []int64{600_000}, 600_000},
		{"two clients wait", 0, []int64{300_000, 900_000}, 300_000},
		{"the byte waited for is written", 700_000, []int64{600_000}, 700_000},
		{"no one waits", 0, nil, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			blob := randomBlob(size)
			s := &rangeServer{blob: blob}
			srv := httptest.NewServer(s)
			t.Cleanup(srv.Close)
			r := newFetchRegistry(t, fixedBudget(budget, 1), []string{srv.URL})
			w := newPrefilled(t, -1, blob, tt.prefill)
			w.wanted = tt.wanted
			if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			checkBlob(t, w, blob)
			gets := s.getRequests()
			checkChunksFrom(t, gets, int64(tt.prefill), size, budget)
			if len(gets) < 2 {
				t.Fatalf("GETs: got %q, want more than one", ranges(gets))
			}
			if start, _, _ := parseRangeHeader(gets[0].rng); start != tt.wantFirst {
				t.Errorf("first Range: got %q, want one from %v", gets[0].rng, tt.wantFirst)
			}
			// The next chunk carries on from there.
			if start, _, _ := parseRangeHeader(gets[1].rng); start != tt.wantFirst+budget {
				t.Errorf("second Range: got %q, want one from %v", gets[1].rng, tt.wantFirst+budget)
			}
		})
	}
}

// inflightGate holds every GET until the test releases it, counting the GETs
// held: the connections open at once.
type inflightGate struct {
	h       http.Handler
	release chan struct{}

	mu             sync.Mutex
	inflight, peak int
}

func newInflightGate(h http.Handler) *inflightGate {
	return &inflightGate{h: h, release: make(chan struct{})}
}

func (g *inflightGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet {
		g.mu.Lock()
		g.inflight++
		g.peak = max(g.peak, g.inflight)
		g.mu.Unlock()
		<-g.release
		g.mu.Lock()
		g.inflight--
		g.mu.Unlock()
	}
	g.h.ServeHTTP(w, r)
}

func (g *inflightGate) count() (inflight, peak int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.inflight, g.peak
}

// drive runs in a bubble: until n results have come in errs, it waits for
// the bubble to settle, checks the GETs held, and releases one.
func (g *inflightGate) drive(t *testing.T, errs <-chan error, n, maxInflight int) {
	t.Helper()
	for done := 0; done < n; {
		synctest.Wait()
		select {
		case err := <-errs:
			if err != nil {
				t.Errorf("FetchBlob: got %v, want no error", err)
			}
			done++
			continue
		default:
		}
		inflight, _ := g.count()
		if inflight > maxInflight {
			t.Errorf("GETs in flight: got %v, want at most %v", inflight, maxInflight)
		}
		if inflight == 0 {
			t.Fatalf("no GET in flight and %d fetches not done: stuck", n-done)
		}
		g.release <- struct{}{}
	}
}

// TestFetchBlobMaxConnections checks that two blobs fetched at once share
// MaxConnections connections. In a bubble, so that every request that can be
// in flight is before the next is let through.
func TestFetchBlobMaxConnections(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const (
			maxConns = 3
			budget   = 8 << 10
		)
		blobs := [][]byte{randomBlob(64 << 10), randomBlob(64<<10 + 1)}
		servers := map[string]*rangeServer{}
		for _, b := range blobs {
			servers["/v2/org/app/blobs/"+digest.FromBytes(b).String()] = &rangeServer{blob: b}
		}
		gate := newInflightGate(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s, ok := servers[r.URL.Path]
			if !ok {
				http.NotFound(w, r)
				return
			}
			s.ServeHTTP(w, r)
		}))
		cfg := fixedBudget(budget, 4)
		cfg.MaxConnections = maxConns
		r := newMemFetchRegistry(t, memNet{"registry.test": handlerRT{gate}}, cfg, "https://registry.test")
		errs := make(chan error, len(blobs))
		writers := make([]*memBlobWriter, len(blobs))
		for i, b := range blobs {
			writers[i] = newMemBlobWriter(-1)
			go func() { _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(b), writers[i]); errs <- err }()
		}
		gate.drive(t, errs, len(blobs), maxConns)
		if _, peak := gate.count(); peak != maxConns {
			t.Errorf("most GETs in flight at once: got %v, want %v", peak, maxConns)
		}
		for i, b := range blobs {
			checkBlob(t, writers[i], b)
		}
	})
}

// TestFetchBlobOneBlobFillsThePipe: a blob fetched alone uses every
// connection its endpoint allows, with no per-blob cap by default.
func TestFetchBlobOneBlobFillsThePipe(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const (
			maxConns = 6
			budget   = 8 << 10
		)
		blob := randomBlob(128 << 10)
		s := &rangeServer{blob: blob}
		gate := newInflightGate(s)
		cfg := FetchConfig{ConnectionBudget: budget, MaxConnectionBudget: budget, MaxConnections: maxConns}
		r := newMemFetchRegistry(t, memNet{"registry.test": handlerRT{gate}}, cfg, "https://registry.test")
		errs := make(chan error, 1)
		w := newMemBlobWriter(-1)
		go func() { _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); errs <- err }()
		gate.drive(t, errs, 1, maxConns)
		if _, peak := gate.count(); peak != maxConns {
			t.Errorf("most GETs in flight at once: got %v, want %v", peak, maxConns)
		}
		checkBlob(t, w, blob)
	})
}

// TestFetchBlobParallelWithoutHeadSize: when the HEAD does not give the
// size, the first chunk learns it; then Parallel chunks are in flight.
func TestFetchBlobParallelWithoutHeadSize(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const parallel = 4
		blob := randomBlob(64 << 10)
		s := &rangeServer{blob: blob}
		gate := newInflightGate(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodHead {
				w.WriteHeader(http.StatusMethodNotAllowed)
				return
			}
			s.ServeHTTP(w, r)
		}))
		r := newMemFetchRegistry(t, memNet{"registry.test": handlerRT{gate}}, fixedBudget(8<<10, parallel), "https://registry.test")
		w := newMemBlobWriter(-1)
		errs := make(chan error, 1)
		go func() { _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); errs <- err }()
		gate.drive(t, errs, 1, parallel)
		if _, peak := gate.count(); peak != parallel {
			t.Errorf("most GETs in flight at once: got %v, want %v", peak, parallel)
		}
		checkBlob(t, w, blob)
	})
}

// TestFetchBlobHeadFailureRetried: a connection reset on the size HEAD is a
// failed attempt like any other, not the end of the fetch.
func TestFetchBlobHeadFailureRetried(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		blob := randomBlob(3000)
		s := &scriptedBlob{size: int64(len(blob)), get: func(_ int, rng string) *http.Response {
			return partialResponse(blob, rng, len(blob))
		}}
		var mu sync.Mutex
		heads := 0
		rt := roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if req.Method == http.MethodHead {
				mu.Lock()
				heads++
				first := heads == 1
				mu.Unlock()
				if first {
					return nil, &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
				}
			}
			return s.RoundTrip(req)
		})
		r := newMemFetchRegistry(t, memNet{"registry.test": rt}, FetchConfig{ParallelChunks: 1}, "https://registry.test")
		w := newMemBlobWriter(-1)
		if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
			t.Fatalf("got %v, want no error", err)
		}
		checkBlob(t, w, blob)
	})
}

// cancellingWriter cancels a context once a byte at or past at is written.
type cancellingWriter struct {
	*memBlobWriter
	at     int64
	cancel context.CancelFunc
}

func (w cancellingWriter) WriteAt(p []byte, off int64) (int, error) {
	n, err := w.memBlobWriter.WriteAt(p, off)
	if off+int64(n) > w.at {
		w.cancel()
	}
	return n, err
}

// TestFetchBlobCancelKeepsBudget: a chunk ended by the caller's context is
// not a cut of the network path, and leaves the budget alone.
func TestFetchBlobCancelKeepsBudget(t *testing.T) {
	t.Parallel()
	const (
		size    = 200_000
		initial = 256 << 10
	)
	blob := randomBlob(size)
	release := make(chan struct{})
	s := &rangeServer{blob: blob, hold: func(int) (int, <-chan struct{}) { return 150_000, release }}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	m, reg := newTestMetrics(t)
	cfg := FetchConfig{ConnectionBudget: initial, MinConnectionBudget: 16 << 10, MaxConnectionBudget: 1 << 20, ParallelChunks: 1}
	r := newFetchRegistry(t, cfg, []string{srv.URL}, WithMetrics(m))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	w := cancellingWriter{memBlobWriter: newMemBlobWriter(-1), at: 100_000, cancel: cancel}
	if _, err := r.FetchBlob(ctx, "org/app", digest.FromBytes(blob), w); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want %v", err, context.Canceled)
	}
	if got := r.endpoints[0].budget.get(); got != initial {
		t.Errorf("budget: got %v, want %v", got, initial)
	}
	labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv)}
	if got := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", labels); got != 0 {
		t.Errorf("pullproxy_upstream_connection_cuts_total: got %v, want %v", got, 0)
	}
}

// TestFetchBlobProbeFreedOnCancel: a probe chunk whose fetch is cancelled
// while it waits for a connection slot must not keep the endpoint's budget
// from probing again.
func TestFetchBlobProbeFreedOnCancel(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const budget = 8 << 10
		small, large := randomBlob(100), randomBlob(64<<10)
		servers := map[string]*rangeServer{}
		for _, b := range [][]byte{small, large} {
			servers["/v2/org/app/blobs/"+digest.FromBytes(b).String()] = &rangeServer{blob: b}
		}
		hold := make(chan struct{})
		smallPath := "/v2/org/app/blobs/" + digest.FromBytes(small).String()
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && r.URL.Path == smallPath {
				<-hold
			}
			servers[r.URL.Path].ServeHTTP(w, r)
		})
		cfg := FetchConfig{ConnectionBudget: budget, MinConnectionBudget: budget, MaxConnectionBudget: 1 << 20, ParallelChunks: 1, MaxConnections: 1}
		r := newPipeFetchRegistry(t, newPipeNet(t, h), cfg, "http://registry.test")

		// The small blob's one chunk (too short to be a probe) holds the
		// only connection; the large blob's first chunk, a probe, waits
		// for it and is cancelled.
		smallDone := make(chan error, 1)
		go func() {
			_, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(small), newMemBlobWriter(-1))
			smallDone <- err
		}()
		synctest.Wait()
		ctx, cancel := context.WithCancel(t.Context())
		largeDone := make(chan error, 1)
		go func() {
			_, err := r.FetchBlob(ctx, "org/app", digest.FromBytes(large), newMemBlobWriter(-1))
			largeDone <- err
		}()
		synctest.Wait()
		cancel()
		if err := <-largeDone; !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled fetch: got %v, want %v", err, context.Canceled)
		}
		close(hold)
		if err := <-smallDone; err != nil {
			t.Errorf("small blob: got %v, want no error", err)
		}

		// The next fetch probes: its first chunk asks for cleanGrowth times
		// the budget.
		w := newMemBlobWriter(-1)
		if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(large), w); err != nil {
			t.Fatalf("got %v, want no error", err)
		}
		checkBlob(t, w, large)
		gets := servers["/v2/org/app/blobs/"+digest.FromBytes(large).String()].getRequests()
		if len(gets) == 0 {
			t.Fatalf("GETs of the large blob: got none, want some")
		}
		if got, want := askedLen(gets[0], int64(len(large))), int64(cleanGrowth*budget); got != want {
			t.Errorf("first chunk after the cancel: got %v bytes, want %v (a probe)", got, want)
		}
	})
}

// TestFetchBlobAvoidsCorruptEndpoints: once an endpoint is reported to have
// served a blob corrupt, the blob is fetched from the others, whatever the
// health order; with none left FetchBlob fails at once, asking nobody, and
// says which endpoint served it corrupt and what was found. The endpoint that
// completed a fetch is returned.
func TestFetchBlobAvoidsCorruptEndpoints(t *testing.T) {
	t.Parallel()
	blob := randomBlob(5000)
	corrupt := slices.Clone(blob)
	corrupt[100] ^= 0xff
	cause := fmt.Errorf("the 5000 bytes received hash to %s: %w", digest.FromBytes(corrupt), errors.New("digest mismatch"))
	tests := []struct {
		name     string
		reported []int // endpoint indexes reported corrupt
		want     []byte
		served   int // endpoint index returned; -1: none
		asked    [2]bool
	}{
		{"none reported", nil, corrupt, 0, [2]bool{true, false}},
		{"the first reported", []int{0}, blob, 1, [2]bool{false, true}},
		{"both reported", []int{0, 1}, nil, -1, [2]bool{false, false}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			servers := [2]*rangeServer{{blob: corrupt}, {blob: blob}}
			s1, s2 := httptest.NewServer(servers[0]), httptest.NewServer(servers[1])
			t.Cleanup(s1.Close)
			t.Cleanup(s2.Close)
			// The second for failover only: the endpoints are asked in turn.
			r := newFetchRegistry(t, FetchConfig{}, []string{s1.URL, s2.URL}, WithFailoverOnly(s2.URL))
			d := digest.FromBytes(blob)
			for _, i := range tt.reported {
				r.ReportCorrupt(d, fetchedFrom(r.Endpoints()[i]), cause)
			}
			w := newMemBlobWriter(-1)
			report, err := r.FetchBlob(t.Context(), "org/app", d, w)
			served := report.Endpoint
			if tt.want == nil {
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), cause.Error()) ||
					!strings.Contains(err.Error(), "corrupt") {
					t.Errorf("got %v, want ErrInvalid saying the blob was served corrupt and what was found", err)
				}
			} else {
				if err != nil {
					t.Fatalf("got %v, want no error", err)
				}
				checkBlob(t, w, tt.want)
			}
			wantServed := ""
			if tt.served >= 0 {
				wantServed = r.Endpoints()[tt.served]
			}
			if served != wantServed {
				t.Errorf("endpoint returned: got %q, want %q", served, wantServed)
			}
			for i, s := range servers {
				if got := len(s.all()) > 0; got != tt.asked[i] {
					t.Errorf("endpoint %d asked: got %v, want %v", i, got, tt.asked[i])
				}
			}
		})
	}
}

// TestBudget checks the budget's arithmetic on a clock of its own: growth
// by probes of twice the budget, one at a time, adopted after growAfter in
// a row complete; cuts lowering it to 3/4 of the smallest cut.
func TestBudget(t *testing.T) {
	t.Parallel()
	newTestBudget := func(t *testing.T, cfg FetchConfig) (*budget, prometheus.Gauge, *prometheus.CounterVec) {
		t.Helper()
		cfg, err := cfg.withDefaults()
		if err != nil {
			t.Fatalf("withDefaults: %v", err)
		}
		g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "budget"})
		cuts := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cuts"}, []string{"kind"})
		return newBudget(cfg, discardLogger, g, cuts), g, cuts
	}
	const mib = 1 << 20
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	check := func(t *testing.T, what string, got, want int64) {
		t.Helper()
		if got != want {
			t.Errorf("%s: got %v, want %v", what, got, want)
		}
	}
	checkNext := func(t *testing.T, b *budget, now time.Time, wantSize int64, wantProbe bool) {
		t.Helper()
		if size, probe := b.next(now, initialConnections); size != wantSize || probe != wantProbe {
			t.Errorf("next: got %v, %v, want %v, %v", size, probe, wantSize, wantProbe)
		}
	}
	// probes runs n probes that complete, returning the last completed's result.
	probes := func(t *testing.T, b *budget, n int, now time.Time) (last int64) {
		t.Helper()
		for range n {
			size, probe := b.next(now, initialConnections)
			if !probe {
				t.Fatalf("next: got no probe, want one")
			}
			last = b.completed(size, true)
		}
		return last
	}

	t.Run("how many connections probe at once on a clean path", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			conns, probes int
		}{
			{1, 1},
			{2, 1},
			{4, 2},  // half of few
			{7, 3},  // a short path's pipe, trimmed
			{10, 4}, // half, up to half of growAfter
			{16, 4}, // a quarter
			{24, 6},
			{32, growAfter}, // a quarter, up to the wins needed
			{64, growAfter},
		} {
			b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 4 * mib})
			got := 0
			for range 2 * growAfter {
				if size, probe := b.next(t0, tc.conns); probe {
					if size != 4*mib {
						t.Errorf("through %d connections: a probe of %v, want %v", tc.conns, size, 4*mib)
					}
					got++
				}
			}
			if got != tc.probes {
				t.Errorf("through %d connections: %d probes at once, want %d", tc.conns, got, tc.probes)
			}
		}
	})

	t.Run("growth", func(t *testing.T) {
		t.Parallel()
		b, g, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 32 * mib})
		check(t, "initial", b.get(), mib)
		check(t, "gauge", int64(testutil.ToFloat64(g)), mib)
		// On a clean path a quarter of the connections probe at once,
		// cleanGrowth times the budget.
		const conns, quarter = 16, 4
		for range quarter {
			if size, probe := b.next(t0, conns); size != cleanGrowth*mib || !probe {
				t.Errorf("next: got %v, %v, want a probe of %v", size, probe, cleanGrowth*mib)
			}
		}
		if size, probe := b.next(t0, conns); size != mib || probe {
			t.Errorf("next, a quarter probing: got %v, %v, want %v and no probe", size, probe, mib)
		}
		check(t, "a chunk that is no probe", b.completed(mib, false), 0)
		for range quarter {
			check(t, "a probe completes", b.completed(cleanGrowth*mib, true), 0)
		}
		check(t, "probes short of growAfter", probes(t, b, growAfter-quarter-1, t0), 0)
		check(t, "budget", b.get(), mib)
		check(t, "the growAfter-th probe", probes(t, b, 1, t0), cleanGrowth*mib)
		check(t, "gauge", int64(testutil.ToFloat64(g)), cleanGrowth*mib)
		check(t, "growAfter more", probes(t, b, growAfter, t0), cleanGrowth*cleanGrowth*mib)
		check(t, "growAfter more, up to MaxBudget", probes(t, b, growAfter, t0), 32*mib)
		checkNext(t, b, t0, 32*mib, false) // at MaxBudget
		check(t, "budget", b.get(), 32*mib)
	})
	t.Run("no more probes in flight than wins still needed", func(t *testing.T) {
		t.Parallel()
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 4 * mib})
		probes(t, b, growAfter-2, t0)
		checkNext(t, b, t0, 4*mib, true)
		checkNext(t, b, t0, 4*mib, true)
		checkNext(t, b, t0, mib, false) // two wins to go, two in flight: a third would only hold the adoption
		check(t, "the growAfter-1-th", b.completed(4*mib, true), 0)
		checkNext(t, b, t0, mib, false)
		check(t, "the growAfter-th, the last in flight: adopted", b.completed(4*mib, true), 4*mib)
	})
	t.Run("a cut restarts the count of probes", func(t *testing.T) {
		t.Parallel()
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 64 * mib})
		probes(t, b, growAfter-1, t0)
		check(t, "a cut above the budget", b.cut(3*mib, false, "reset", t0), 0)
		// With a recent cut, growAfter probes in a row, one at a time.
		check(t, "growAfter-1 probes", probes(t, b, growAfter-1, t0), 0)
		check(t, "the growAfter-th", probes(t, b, 1, t0), 2*mib)
		// Probes now stop at 3/4 of the cut.
		checkNext(t, b, t0, 3*mib*3/4, true)
	})
	t.Run("one probe at a time once a cut is recent", func(t *testing.T) {
		t.Parallel()
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 64 * mib})
		b.cut(3*mib, false, "reset", t0)
		checkNext(t, b, t0, 2*mib, true)
		checkNext(t, b, t0, mib, false)
		checkNext(t, b, t0.Add(cutMemory), cleanGrowth*mib, true) // the cut is forgotten: the path is clean
	})
	t.Run("a stalled probe holds the others' wins until it fails", func(t *testing.T) {
		t.Parallel()
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 4 * mib})
		for range 3 {
			checkNext(t, b, t0, 4*mib, true)
		}
		check(t, "a probe completes", b.completed(4*mib, true), 0)
		check(t, "another", b.completed(4*mib, true), 0)
		check(t, "the third stalls after 1.5 MB", b.cut(1_500_000, true, "stall", t0), 0)
		check(t, "budget", b.get(), mib)
		checkNext(t, b, t0, 1_500_000*3/4, true) // probes now stop at 3/4 of the stall
	})
	t.Run("a failed probe frees the next", func(t *testing.T) {
		t.Parallel()
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 4 * mib})
		b.cut(3*mib, false, "reset", t0) // one probe at a time from now on
		checkNext(t, b, t0, 2*mib, true)
		checkNext(t, b, t0, mib, false)
		b.failed(true)
		checkNext(t, b, t0, 2*mib, true)
		check(t, "a probe cut before its first byte", b.cut(0, true, "error", t0), 0)
		checkNext(t, b, t0, 2*mib, true)
		check(t, "budget", b.get(), mib)
	})
	t.Run("cuts", func(t *testing.T) {
		t.Parallel()
		b, g, cuts := newTestBudget(t, FetchConfig{ConnectionBudget: 2 * mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 4 * mib})
		check(t, "a first cut at 1.3 MB below the budget", b.cut(1_300_000, false, "reset", t0), 0)
		check(t, "a second", b.cut(1_400_000, false, "eof", t0), 0)
		check(t, "the third: 3/4 of the third smallest", b.cut(1_500_000, false, "stall", t0), 1_125_000)
		check(t, "gauge", int64(testutil.ToFloat64(g)), 1_125_000)
		check(t, "a larger cut changes nothing", b.cut(2_000_000, false, "eof", t0), 0)
		checkNext(t, b, t0.Add(9*time.Minute), 1_125_000, false) // capped while the cuts are recent
		checkNext(t, b, t0.Add(11*time.Minute), 4*mib, true)     // forgotten: up to cleanGrowth times, within MaxBudget
		check(t, "the probe is cut after 10 kB: a probe never lowers the budget", b.cut(10_000, true, "reset", t0.Add(11*time.Minute)), 0)
		check(t, "budget", b.get(), 1_125_000)
		check(t, "a cut before any byte is no cut", b.cut(0, false, "error", t0.Add(12*time.Minute)), 0)
		for range 3 {
			b.cut(100_000, false, "reset", t0.Add(12*time.Minute))
		}
		check(t, "three cuts at 100 kB: 3/4 of it", b.get(), 75_000)
		for kind, want := range map[string]float64{"reset": 5, "eof": 2, "stall": 1, "error": 1} {
			if got := testutil.ToFloat64(cuts.WithLabelValues(kind)); got != want {
				t.Errorf("cuts{kind=%s}: got %v, want %v", kind, got, want)
			}
		}
	})
	t.Run("one odd cut does not wreck a budget that works", func(t *testing.T) {
		t.Parallel()
		// A 1 MiB budget completes chunk after chunk; one probe of 2 MiB is
		// "cut" at 98,304 bytes (a reader that lagged, or a stray reset),
		// and so is one regular chunk. The carrier itself cuts at 1.3 MB
		// and up.
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 16 << 10, MaxConnectionBudget: 64 * mib})
		checkNext(t, b, t0, cleanGrowth*mib, true)
		check(t, "the probe cut early", b.cut(98_304, true, "reset", t0), 0)
		check(t, "a chunk cut early", b.cut(131_072, false, "reset", t0), 0)
		check(t, "budget", b.get(), mib)
		for _, n := range []int64{1_400_000, 1_500_000, 1_350_000, 2_900_000} {
			check(t, "a probe cut by the carrier", b.cut(n, true, "reset", t0), 0)
		}
		check(t, "budget", b.get(), mib)
		// Growth stops at 3/4 of the carrier's cut-off (the third smallest
		// cut point, past the two odd ones): below the budget, which stays.
		checkNext(t, b, t0, mib, false)
	})
	t.Run("with few cut points growth stops at 3/4 of the smallest", func(t *testing.T) {
		t.Parallel()
		// The carrier cuts at 1.3-3.1 MB; probes were cut at four points.
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 16 << 10, MaxConnectionBudget: 64 * mib})
		cutProbe := func(n int64) {
			if _, probe := b.next(t0, initialConnections); !probe {
				t.Fatalf("next: got no probe, want one")
			}
			b.cut(n, true, "stall", t0)
		}
		for _, n := range []int64{2_900_000, 1_500_000, 2_000_000, 2_600_000} {
			cutProbe(n)
		}
		checkNext(t, b, t0, 1_500_000*3/4, true) // not 3/4 of the third smallest, 2.6 MB
		b.failed(true)
		for _, n := range []int64{2_500_000, 2_400_000, 2_300_000} {
			cutProbe(n)
		}
		// Seven points: 3/4 of the third smallest, past two outliers.
		checkNext(t, b, t0, 2_300_000*3/4, true)
	})
	t.Run("renewal", func(t *testing.T) {
		t.Parallel()
		renewal := func(t *testing.T, b *budget, what string, now time.Time, carried, want int64) {
			t.Helper()
			got, ok := b.renewal(now, carried)
			if ok != (want > 0) || got != want {
				t.Errorf("%s: renewal after %v bytes: got %v, %v, want %v", what, carried, got, ok, want)
			}
		}
		renewable := func(t *testing.T, b *budget, what string, now time.Time, want bool) {
			t.Helper()
			if got := b.renewable(now); got != want {
				t.Errorf("%s: renewable: got %v, want %v", what, got, want)
			}
		}
		b, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 16 * mib})
		renewal(t, b, "the budget where it started", t0, mib, 0)
		renewable(t, b, "the budget where it started", t0, false)
		probes(t, b, growAfter, t0)
		renewable(t, b, "grown on a clean path", t0, true)
		check(t, "budget", b.get(), 4*mib)
		renewal(t, b, "grown on a clean path", t0, 4*mib, 8*mib)
		renewal(t, b, "another budget's worth, up to the ceiling", t0, 14*mib, 16*mib)
		renewal(t, b, "at the ceiling", t0, 16*mib-minChunk+1, 0)
		b.cut(20*mib, false, "reset", t0) // above the budget: it stays, and the path cuts
		check(t, "budget", b.get(), 4*mib)
		renewal(t, b, "a recent cut", t0.Add(cutMemory-time.Second), 4*mib, 0)
		renewable(t, b, "a recent cut", t0.Add(cutMemory-time.Second), false)
		renewal(t, b, "the cut forgotten", t0.Add(cutMemory), 4*mib, 8*mib)

		fixed, _, _ := newTestBudget(t, FetchConfig{ConnectionBudget: 4 * mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: 4 * mib})
		renewal(t, fixed, "a fixed budget", t0, 4*mib, 0)
		renewable(t, fixed, "a fixed budget", t0, false)
	})
	t.Run("fixed", func(t *testing.T) {
		t.Parallel()
		b, g, cuts := newTestBudget(t, FetchConfig{ConnectionBudget: mib, MinConnectionBudget: 64 << 10, MaxConnectionBudget: mib})
		checkNext(t, b, t0, mib, false)
		check(t, "a chunk completes", b.completed(mib, false), 0)
		check(t, "a cut", b.cut(500_000, false, "reset", t0), 0)
		check(t, "budget", b.get(), mib)
		check(t, "gauge", int64(testutil.ToFloat64(g)), mib)
		if got := testutil.ToFloat64(cuts.WithLabelValues("reset")); got != 1 {
			t.Errorf("cuts{kind=reset}: got %v, want %v", got, 1)
		}
	})
}

func TestFetchConfigDefaults(t *testing.T) {
	t.Parallel()
	got, err := FetchConfig{}.withDefaults()
	if err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	want := FetchConfig{ConnectionBudget: 1 << 20, MaxConnectionBudget: 64 << 20, MinConnectionBudget: 64 << 10, MaxConnections: 64,
		StallTimeout: 2 * time.Second, FirstByteTimeout: 10 * time.Second, MaxAttempts: 8, MinGoodput: 4 << 10, BackgroundShare: 0.5}
	if got != want {
		t.Errorf("defaults: got %+v, want %+v", got, want)
	}
	if none, err := (FetchConfig{MinGoodput: -1}).withDefaults(); err != nil || none.MinGoodput != 0 {
		t.Errorf("MinGoodput -1: got %v, %v, want 0 (none), no error", none.MinGoodput, err)
	}
	// A budget below the default floor is its own floor.
	small, err := FetchConfig{ConnectionBudget: 16 << 10}.withDefaults()
	if err != nil || small.MinConnectionBudget != 16<<10 {
		t.Errorf("a 16 KiB budget: got floor %v, %v, want %v, no error", small.MinConnectionBudget, err, 16<<10)
	}
	kept := FetchConfig{ConnectionBudget: 32 << 10, MaxConnectionBudget: 32 << 10, MinConnectionBudget: 16 << 10, ParallelChunks: 2, MaxConnections: 3,
		StallTimeout: time.Second, FirstByteTimeout: 3 * time.Second, MaxAttempts: 5, MinGoodput: 1000, BackgroundShare: 1}
	if got, err := kept.withDefaults(); err != nil || got != kept {
		t.Errorf("settings given: got %+v, %v, want %+v, no error", got, err, kept)
	}
	bad := []FetchConfig{
		{ConnectionBudget: -1},
		{ParallelChunks: -1},
		{MaxConnections: -1},
		{StallTimeout: -time.Second},
		{FirstByteTimeout: -time.Second},
		{MaxAttempts: -1},
		{MinGoodput: -2},
		{MinConnectionBudget: 2 << 20},                      // above the default budget
		{ConnectionBudget: 128 << 20},                       // above the default maximum
		{ConnectionBudget: 1 << 20, MaxConnectionBudget: 1}, // maximum below the budget
		{BackgroundShare: -0.5},
		{BackgroundShare: 1.5},
		{BackgroundShare: math.NaN()},
	}
	for _, c := range bad {
		if _, err := c.withDefaults(); err == nil {
			t.Errorf("withDefaults(%+v): got no error, want one", c)
		}
		if _, err := New("m", []string{"https://a.example"}, WithLogger(discardLogger), WithFetchConfig(c)); err == nil {
			t.Errorf("New with %+v: got no error, want one", c)
		}
	}
}

// timeoutError is a net.Error that timed out.
type timeoutError struct{}

func (timeoutError) Error() string   { return "i/o timeout" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

func TestCutKind(t *testing.T) {
	t.Parallel()
	tests := []struct {
		err  error
		want string
	}{
		{&net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, "reset"},
		{fmt.Errorf("reading: %w", syscall.ECONNRESET), "reset"},
		{io.ErrUnexpectedEOF, "eof"},
		{io.EOF, "eof"},
		{timeoutError{}, "stall"},
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, "stall"},
		{errors.New("something else"), "error"},
	}
	for _, tt := range tests {
		if got := cutKind(tt.err); got != tt.want {
			t.Errorf("cutKind(%v): got %v, want %v", tt.err, got, tt.want)
		}
	}
}

func TestSizeMismatchMessage(t *testing.T) {
	t.Parallel()
	d := digest.FromString("x")
	tests := []struct {
		claimed, declared int64
		want              []string
	}{
		{200, 100, []string{"as 200 bytes", "exactly twice the 100 the manifest declares", "stored twice"}},
		{300, 100, []string{"exactly 3 times the 100", "stored 3 times"}},
		{150, 100, []string{"as 150 bytes, but the manifest declares 100", "corrupt"}},
		{100, 0, []string{"but the manifest declares 0"}},
	}
	for _, tt := range tests {
		got := SizeMismatchMessage(d, tt.claimed, tt.declared)
		for _, w := range tt.want {
			if !strings.Contains(got, w) {
				t.Errorf("SizeMismatchMessage(%d, %d): got %q, want it to contain %q", tt.claimed, tt.declared, got, w)
			}
		}
		if !strings.Contains(got, d.String()) {
			t.Errorf("SizeMismatchMessage(%d, %d): got %q, want it to name %v", tt.claimed, tt.declared, got, d)
		}
	}
}
