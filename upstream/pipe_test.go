package upstream

import (
	"context"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// newTestPipe returns a pipe to an endpoint whose connections open in a
// millisecond: a short path, which may be trimmed.
func newTestPipe(maxConns int) *pipe {
	p := newPipe(maxConns, func() *lane { return &lane{} }, discardLogger, prometheus.NewGauge(prometheus.GaugeOpts{Name: "limit"}),
		prometheus.NewGauge(prometheus.GaugeOpts{Name: "in_flight"}))
	p.setup = func() time.Duration { return time.Millisecond }
	return p
}

// simulatePath runs workers of one blob through p for d on a path where one
// connection moves perConn bytes/s (set-up and slow start limit it) and all
// together at most capacity, each chunk being chunk bytes. It returns the
// most connections in flight at once.
func simulatePath(t *testing.T, p *pipe, workers int, perConn, capacity float64, chunk int64, d time.Duration) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	owner := &blobFetch{}
	var mu sync.Mutex
	peak := 0
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				l, err := p.acquire(ctx, owner)
				if err != nil {
					return
				}
				p.mu.Lock()
				n := p.inflight
				p.mu.Unlock()
				mu.Lock()
				peak = max(peak, n)
				mu.Unlock()
				rate := min(perConn, capacity/float64(n))
				took := time.Duration(float64(chunk) / rate * float64(time.Second))
				for range 8 { // bytes arrive as the chunk goes, as from a socket
					time.Sleep(took / 8)
					p.add(int(chunk / 8))
				}
				p.release(owner, l, took)
			}
		})
	}
	wg.Wait()
	return peak
}

// TestPipeGrowsToFillThePath: on a long path, where one connection moves
// 1 MB/s and the link 64 MB/s, the limit grows from its start towards the
// 64 connections that fill the link; on a short one, where 4 connections
// fill it (or 16), a step that brings nothing is taken back, and the limit
// then shrinks towards the few that keep the link full, unless connections
// take long to open (a long path). The limit checked is the median of those
// sampled over the second half-minute: at its ceiling, the limit tries a
// step down every growthHold.
func TestPipeGrowsToFillThePath(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		perConn  float64
		setup    time.Duration // to open a connection
		min, max int           // the limit after a minute
	}{
		{"long path", 1e6, time.Millisecond, 60, 64},
		// 16 fill the link; 15 keep 94% of it, which a window's goodput
		// does not always tell from full.
		{"medium path", 4e6, time.Millisecond, 15, 32},
		{"short path", 16e6, time.Millisecond, 4, 8},
		{"few connections fill a path with long set-up: not trimmed", 16e6, 200 * time.Millisecond,
			initialConnections, initialConnections},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				p := newTestPipe(64)
				p.setup = func() time.Duration { return tt.setup }
				var samples []int
				sampled := make(chan struct{})
				go func() {
					defer close(sampled)
					time.Sleep(30 * time.Second)
					for range 30 {
						time.Sleep(time.Second)
						samples = append(samples, p.current())
					}
				}()
				simulatePath(t, p, 100, tt.perConn, 64e6, 1<<20, time.Minute)
				<-sampled
				slices.Sort(samples)
				if got := samples[len(samples)/2]; got < tt.min || got > tt.max {
					t.Errorf("limit in the second half-minute: median %v, want %v to %v (samples %v)", got, tt.min, tt.max, samples)
				}
			})
		})
	}
}

// TestPipeShrinks: stalls take a quarter off the limit, 429 and 503 half,
// cuts one, never below minConnections.
func TestPipeShrinks(t *testing.T) {
	t.Parallel()
	p := newTestPipe(64)
	steps := []struct {
		kind int
		want int
	}{
		{pipeCut, 31}, {pipeStall, 23}, {pipeBusy, 11}, {pipeBusy, 5}, {pipeBusy, 2}, {pipeBusy, 2}, {pipeCut, 2},
	}
	for _, s := range steps {
		p.failed(s.kind)
		if got := p.current(); got != s.want {
			t.Fatalf("after failure kind %d: got %v, want %v", s.kind, got, s.want)
		}
	}
}

// TestPipeShares: one blob alone gets every slot; blobs waiting together
// are served so that each holds as many as the others.
func TestPipeShares(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		p := newTestPipe(4)
		a, b := &blobFetch{}, &blobFetch{}
		ctx := t.Context()
		for range 4 {
			if _, err := p.acquire(ctx, a); err != nil {
				t.Fatal(err)
			}
		}
		// Both wait: a for three more, b for three.
		granted := make(chan *blobFetch, 6)
		for _, o := range []*blobFetch{a, a, a, b, b, b} {
			go func() {
				if _, err := p.acquire(ctx, o); err == nil {
					granted <- o
				}
			}()
			synctest.Wait() // queued in this order
		}
		for range 4 {
			p.release(a, &lane{}, 0)
		}
		synctest.Wait()
		held := map[*blobFetch]int{}
		for range 4 {
			held[<-granted]++
		}
		if held[a] != 2 || held[b] != 2 {
			t.Errorf("slots after a's four were freed: a %v, b %v, want 2 each", held[a], held[b])
		}
		// A cancelled waiter takes nothing.
		cctx, cancel := context.WithCancel(ctx)
		errc := make(chan error)
		go func() { _, err := p.acquire(cctx, b); errc <- err }()
		synctest.Wait()
		cancel()
		if err := <-errc; err == nil {
			t.Errorf("cancelled acquire: got no error")
		}
		for range 4 {
			p.release(<-func() chan *blobFetch { c := make(chan *blobFetch, 1); c <- a; return c }(), &lane{}, 0)
		}
	})
}
