package upstream

import (
	"context"
	"errors"
	"net"
	"net/http"
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
	p := newPipe(maxConns, 0.5, func() *lane { return &lane{} }, discardLogger, prometheus.NewGauge(prometheus.GaugeOpts{Name: "limit"}),
		prometheus.NewGauge(prometheus.GaugeOpts{Name: "in_flight"}))
	p.roundTrip = func() time.Duration { return time.Millisecond }
	return p
}

// simulatePath runs workers of one blob through p for d on a path where one
// connection moves perConn bytes/s (set-up and slow start limit it) and all
// together at most capacity, each chunk being chunk bytes. It returns the
// most connections in flight at once.
func simulatePath(t *testing.T, p *pipe, workers int, perConn, capacity float64, chunk int64, d time.Duration) int {
	t.Helper()
	return simulateChangingPath(t, p, workers, perConn, func() float64 { return capacity }, chunk, d)
}

// simulateChangingPath is simulatePath on a path whose capacity changes:
// capacity says what it is now.
func simulateChangingPath(t *testing.T, p *pipe, workers int, perConn float64, capacity func() float64, chunk int64, d time.Duration) int {
	t.Helper()
	return simulateOwnerPath(t, p, &source{blobFetch: &blobFetch{}}, workers, perConn, capacity, chunk, d)
}

// simulateOwnerPath is simulateChangingPath with owner's workers.
func simulateOwnerPath(t *testing.T, p *pipe, owner *source, workers int, perConn float64, capacity func() float64, chunk int64, d time.Duration) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
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
				// Bytes arrive as the chunk goes, as from a socket, at a
				// pace set by the connections in flight meanwhile.
				var took time.Duration
				for range 8 {
					p.mu.Lock()
					n := p.inflight
					p.mu.Unlock()
					rate := min(perConn, capacity()/float64(n))
					step := time.Duration(float64(chunk/8) / rate * float64(time.Second))
					time.Sleep(step)
					took += step
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
// take long to open (a long path, which starts at the ceiling and stays
// there). The limit checked is the median of those
// sampled over the second half-minute: at its ceiling, the limit tries a
// step down every growthHold.
func TestPipeGrowsToFillThePath(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		perConn   float64
		roundTrip time.Duration // a request to its first byte
		min, max  int           // the limit after a minute
	}{
		{"long path", 1e6, time.Millisecond, 60, 64},
		// 16 fill the link; 15 keep 94% of it, which a window's goodput
		// does not always tell from full.
		{"medium path", 4e6, time.Millisecond, 15, 32},
		{"short path", 16e6, time.Millisecond, 4, 8},
		// A long path starts at the ceiling (see startLongLocked).
		{"few connections fill a long path: not trimmed", 16e6, 100 * time.Millisecond, 64, 64},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				p := newTestPipe(64)
				p.roundTrip = func() time.Duration { return tt.roundTrip }
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
		a, b := &source{blobFetch: &blobFetch{}}, &source{blobFetch: &blobFetch{}}
		ctx := t.Context()
		for range 4 {
			if _, err := p.acquire(ctx, a); err != nil {
				t.Fatal(err)
			}
		}
		// Both wait: a for three more, b for three.
		granted := make(chan *source, 6)
		for _, o := range []*source{a, a, a, b, b, b} {
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
		held := map[*source]int{}
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
			p.release(<-func() chan *source { c := make(chan *source, 1); c <- a; return c }(), &lane{}, 0)
		}
	})
}

// TestPipeShortPathStartsFew: at its first measurement a short path's limit
// goes straight to minTrimmed, where a long path's grows; where a few
// connections do not keep the short path full (each moves 1 MB/s), the
// limit goes back up.
func TestPipeShortPathStartsFew(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		perConn   float64
		roundTrip time.Duration
		at        time.Duration // when the limit is looked at
		min, max  int
	}{
		{"short path", 16e6, time.Millisecond, 2 * time.Second, minTrimmed, minTrimmed},
		{"long path", 16e6, 100 * time.Millisecond, 2 * time.Second, initialConnections, 64},
		// Judged after a window at minTrimmed that settles, and one more.
		{"short path that few connections do not fill", 1e6, time.Millisecond, 8 * time.Second, initialConnections, 64},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				p := newTestPipe(64)
				p.roundTrip = func() time.Duration { return tt.roundTrip }
				var got int
				sampled := make(chan struct{})
				go func() {
					defer close(sampled)
					time.Sleep(tt.at)
					got = p.current()
				}()
				simulatePath(t, p, 100, tt.perConn, 64e6, 1<<20, tt.at+time.Second)
				<-sampled
				if got < tt.min || got > tt.max {
					t.Errorf("limit %v in: %v, want %v to %v", tt.at, got, tt.min, tt.max)
				}
			})
		})
	}
}

// TestPipeStartsByThePathsLength: before its first chunk, a pipe to a path
// known to be short (its metadata connections opened quickly) goes to
// minTrimmed connections, and one to a long path to the ceiling; to a path
// in between, or one not known yet, it opens initialConnections. A stall
// takes a short start back to initialConnections.
func TestPipeStartsByThePathsLength(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		roundTrip time.Duration // 0: none seen yet
		want      int
	}{
		{"short path", time.Millisecond, minTrimmed},
		{"40 ms path", 40 * time.Millisecond, initialConnections},
		{"long path", 100 * time.Millisecond, 64},
		{"not known yet", 0, initialConnections},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p := newTestPipe(64)
			p.roundTrip = func() time.Duration { return tt.roundTrip }
			owner := &source{blobFetch: &blobFetch{finished: make(chan struct{})}}
			l, err := p.acquire(t.Context(), owner)
			if err != nil {
				t.Fatalf("acquire: %v", err)
			}
			if got := p.current(); got != tt.want {
				t.Errorf("limit at the first chunk: got %v, want %v", got, tt.want)
			}
			p.release(owner, l, time.Millisecond)
			// Only the first chunk decides: a path found short later is
			// left to the measurements.
			p.roundTrip = func() time.Duration { return time.Millisecond }
			if l, err = p.acquire(t.Context(), owner); err != nil {
				t.Fatalf("acquire: %v", err)
			}
			if got := p.current(); got != tt.want {
				t.Errorf("limit at the second chunk: got %v, want %v", got, tt.want)
			}
			p.release(owner, l, time.Millisecond)
			// A stall takes a short start back, as it does a trimmed limit.
			p.failed(pipeProbeStall)
			if got, want := p.current(), max(tt.want, initialConnections); got != want {
				t.Errorf("limit after a stall: got %v, want %v", got, want)
			}
		})
	}
}

// TestPipeWaitEndsWithTheBlob: a worker waiting for a lane stops waiting,
// and takes none, once its blob is complete.
func TestPipeWaitEndsWithTheBlob(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		p := newTestPipe(1)
		other, owner := &source{blobFetch: &blobFetch{}}, &source{blobFetch: &blobFetch{finished: make(chan struct{})}}
		l, err := p.acquire(t.Context(), other)
		if err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		go func() { _, err := p.acquire(t.Context(), owner); errc <- err }()
		synctest.Wait()
		close(owner.finished)
		if err := <-errc; !errors.Is(err, errFinished) {
			t.Errorf("waiting for a lane as the blob completed: got %v, want errFinished", err)
		}
		p.release(other, l, 0)
		if _, err := p.acquire(t.Context(), other); err != nil {
			t.Errorf("the slot was not free again: %v", err)
		}
	})
}

// TestPipeStallUndoesTrimming: a stall, a probe's too, takes a trimmed limit
// back to where trimming started, and stops trimming; untrimmed, a probe's
// stall leaves the limit alone and another takes a quarter off, down to
// minStalled.
func TestPipeStallUndoesTrimming(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name             string
		limit, untrimmed int
		kind             int
		want             int
	}{
		{"probe stall, trimmed", 6, 32, pipeProbeStall, 32},
		{"stall, trimmed", 6, 32, pipeStall, 32},
		{"probe stall", 32, 0, pipeProbeStall, 32},
		{"stall", 32, 0, pipeStall, 24},
		{"stall near minStalled", 20, 0, pipeStall, minStalled},
		{"stall below minStalled", 6, 0, pipeStall, 6},
		{"cut, trimmed", 6, 32, pipeCut, 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPipe(64)
			p.mu.Lock()
			p.limit, p.untrimmed, p.trimming = tt.limit, tt.untrimmed, tt.untrimmed > 0
			p.mu.Unlock()
			p.failed(tt.kind)
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.limit != tt.want || p.trimming {
				t.Errorf("limit %v, trimming %v; want %v, not trimming", p.limit, p.trimming, tt.want)
			}
		})
	}
}

// TestPipeClosesParkedProbes: a lane the limit leaves unused after it
// shrank, whose connection carries a probe, is closed at the next release:
// the probe settles, and the budget's growth, which waits for every probe
// in flight, does not wait for the connection to time out idle. A lane
// without a probe keeps its connection.
func TestPipeClosesParkedProbes(t *testing.T) {
	t.Parallel()
	cfg, err := FetchConfig{}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	b := newBudget(cfg, discardLogger, prometheus.NewGauge(prometheus.GaugeOpts{Name: "budget"}),
		prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cuts"}, []string{"kind"}))
	probing := func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.probing > 0
	}
	allowance, probe := b.next(time.Now(), initialConnections)
	if !probe {
		t.Fatal("next: got no probe, want one")
	}
	newConn := func(p *probeConn) *chunkConn {
		c, peer := net.Pipe()
		t.Cleanup(func() { c.Close(); peer.Close() })
		cc := &chunkConn{idleTimeoutConn: idleTimeoutConn{Conn: c}}
		cc.probe.Store(p)
		return cc
	}
	probed := &probeConn{budget: b, allowance: allowance}
	withProbe := &lane{client: &http.Client{Transport: &http.Transport{}}, conns: map[dialKey]*chunkConn{{addr: "a:443"}: newConn(probed)}}
	plain := newConn(nil)
	without := &lane{client: &http.Client{Transport: &http.Transport{}}, conns: map[dialKey]*chunkConn{{addr: "a:443"}: plain}}
	lanes := []*lane{withProbe, without, {}, {}}
	p := newTestPipe(4)
	p.newLane = func() *lane { l := lanes[0]; lanes = lanes[1:]; return l }

	owner := &source{blobFetch: &blobFetch{}}
	var held []*lane
	for range 4 {
		l, err := p.acquire(t.Context(), owner)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	for _, l := range held { // the probe's lane first: the bottom of the idle stack
		p.release(owner, l, 0)
	}
	if !probing() {
		t.Fatal("before the limit shrank: the probe settled already")
	}
	p.mu.Lock()
	p.setLimitLocked(2)
	p.mu.Unlock()
	l, err := p.acquire(t.Context(), owner)
	if err != nil {
		t.Fatal(err)
	}
	p.release(owner, l, 0)
	if probing() {
		t.Errorf("after a release below the smaller limit: the parked probe is still in flight")
	}
	if !probed.settled.Load() {
		t.Errorf("the parked probe did not settle")
	}
	if plain.retired.Load() {
		t.Errorf("a parked lane without a probe lost its connection")
	}
	if slices.Contains(p.idle, withProbe) {
		t.Errorf("the probe's lane is still idle in the pipe")
	}
}

// TestPipeJudgesALongPathsStepLate: on a long path the window right after
// a step has the new connections opening, and brings no more goodput than
// before; the step is judged by the window after it. A short path's step
// is judged at once.
func TestPipeJudgesALongPathsStepLate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		roundTrip time.Duration
		rates     []float64 // goodput of each window, bytes/s
		wantLimit int
	}{
		{"long path, the step pays off a window late", 100 * time.Millisecond, []float64{30e6, 30e6, 60e6}, 64},
		{"long path, the step never pays off", 100 * time.Millisecond, []float64{30e6, 30e6, 31e6}, 32},
		{"short path, judged at once", time.Millisecond, []float64{30e6, 30e6}, 32},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				p := newTestPipe(64)
				p.roundTrip = func() time.Duration { return tt.roundTrip }
				p.shortTried = true // not the short path's first jump: the step is what is tested
				p.mu.Lock()
				defer p.mu.Unlock()
				p.tickLocked(time.Now()) // the first window starts
				for i, rate := range tt.rates {
					time.Sleep(time.Second)
					p.received.Add(int64(rate))
					p.saturated = true
					why, _ := p.tickLocked(time.Now())
					if i == 0 && p.limit != 64 {
						t.Fatalf("after the first window: limit %d (%q), want a step to 64", p.limit, why)
					}
				}
				if p.limit != tt.wantLimit {
					t.Errorf("limit: got %d, want %d", p.limit, tt.wantLimit)
				}
			})
		})
	}
}

// TestPipeRetriesAStepSoonWhileRamping: a step that brought no goodput is
// taken back and the limit holds, the first time minGrowthHold; within
// rampTime of the first evidence, when a window's goodput says as much
// about a client's requests still arriving as about the path, it holds only
// rampHold.
func TestPipeRetriesAStepSoonWhileRamping(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		judgedAt time.Duration // after the window that stepped
		wantHold time.Duration
	}{
		{"while ramping", time.Second, rampHold},
		{"after the ramp", rampTime, minGrowthHold},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				p := newTestPipe(64)
				p.shortTried = true // not the short path's first jump: the step is what is tested
				p.mu.Lock()
				defer p.mu.Unlock()
				p.tickLocked(time.Now()) // the first window starts
				window := func(d time.Duration, rate float64) string {
					time.Sleep(d)
					p.received.Add(int64(rate * d.Seconds()))
					p.saturated = true
					why, _ := p.tickLocked(time.Now())
					return why
				}
				window(time.Second, 30e6)
				if p.limit != 64 {
					t.Fatalf("after the first window: limit %d, want a step to 64", p.limit)
				}
				why := window(tt.judgedAt, 30e6)
				if p.limit != 32 {
					t.Fatalf("after the step brought nothing: limit %d (%q), want 32", p.limit, why)
				}
				if got := time.Until(p.holdUntil); got != tt.wantHold {
					t.Errorf("hold: got %v, want %v", got, tt.wantHold)
				}
			})
		})
	}
}

// TestPipeNearestEndFirst: a free slot goes to a blob holding none, else to
// the blob with the fewest bytes left, whatever the order they wait in.
func TestPipeNearestEndFirst(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const mib = 1 << 20
		blob := func(size, written int64) *source {
			f := &blobFetch{}
			f.size.Store(size)
			f.written.Store(written)
			return &source{blobFetch: f}
		}
		near, far, fresh := blob(100*mib, 90*mib), blob(100*mib, 10*mib), blob(200*mib, 0)
		p := newTestPipe(4)
		ctx := t.Context()
		for _, o := range []*source{near, far, far, far} {
			if _, err := p.acquire(ctx, o); err != nil {
				t.Fatal(err)
			}
		}
		granted := make(chan *source, 4)
		for _, o := range []*source{far, near, near, fresh} {
			go func() {
				if _, err := p.acquire(ctx, o); err == nil {
					granted <- o
				}
			}()
			synctest.Wait() // queued in this order
		}
		var got []*source
		for _, o := range []*source{far, far, fresh} { // far keeps one
			p.release(o, &lane{}, 0)
			synctest.Wait()
			got = append(got, <-granted)
		}
		if want := []*source{fresh, near, near}; !slices.Equal(got, want) {
			name := map[*source]string{near: "near", far: "far", fresh: "fresh"}
			t.Errorf("slots went to %v, want fresh (it held none), then near twice (10 MiB left, against 90)",
				[]string{name[got[0]], name[got[1]], name[got[2]]})
		}
		p.release(near, &lane{}, 0) // far's waiter takes it, and the test ends
		<-granted
	})
}

// TestPipeChunkTarget: on a short path a chunk is what a connection brings
// in chunkPace, within [minChunkTarget, maxChunkTarget]; on a long path,
// or with no recent pace, minChunkTarget.
func TestPipeChunkTarget(t *testing.T) {
	now := time.Now()
	tests := []struct {
		name      string
		roundTrip time.Duration
		connRate  float64 // bytes/s
		age       time.Duration
		want      int64
	}{
		{"no pace yet", time.Millisecond, 0, 0, minChunkTarget},
		{"short path, 16 MB/s a connection", time.Millisecond, 16e6, 0, 3_997_696}, // 4 MB, in 64 KiB
		{"short path, 2 MB/s a connection", time.Millisecond, 2e6, 0, minChunkTarget},
		{"short path, 100 MB/s a connection", time.Millisecond, 100e6, 0, maxChunkTarget},
		{"short path, stale pace", time.Millisecond, 16e6, staleRate + time.Second, minChunkTarget},
		{"long path, 16 MB/s a connection", 40 * time.Millisecond, 16e6, 0, minChunkTarget},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPipe(64)
			p.roundTrip = func() time.Duration { return tt.roundTrip }
			p.connRate, p.lastAt = tt.connRate, now.Add(-tt.age)
			if got := p.chunkTarget(now); got != tt.want {
				t.Errorf("got %d, want %d", got, tt.want)
			}
		})
	}
}

// TestPipeRecoversWithinSeconds: a path that carried only what 8
// connections bring for a while (a burst of cuts took the limit there, and
// a step up then brought nothing) and then has room again: the limit climbs
// back within seconds, not after a long hold.
func TestPipeRecoversWithinSeconds(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		p := newTestPipe(64)
		p.roundTrip = func() time.Duration { return 40 * time.Millisecond }
		const perConn = 1e6
		start := time.Now()
		capped := 15 * time.Second
		capacity := func() float64 {
			if time.Since(start) < capped {
				return 8 * perConn
			}
			return 64e6
		}
		for range 24 {
			p.failed(pipeCut) // 32 to 8
		}
		var at []int
		sampled := make(chan struct{})
		go func() {
			defer close(sampled)
			for range 30 {
				time.Sleep(time.Second)
				at = append(at, p.current())
			}
		}()
		simulateChangingPath(t, p, 100, perConn, capacity, 1<<20, 30*time.Second)
		<-sampled
		t.Logf("limit each second: %v", at)
		// The cap lifts at 15 s; by 25 s the limit is to have filled most
		// of the path.
		if got := at[24]; got < 48 {
			t.Errorf("limit 10 s after the path had room again: got %v, want at least 48 (each second: %v)", got, at)
		}
	})
}

// TestPipeBacksOff: each step in a row that brings nothing holds growth
// twice as long as the one before, from minGrowthHold up to growthHold; a
// step that pays off starts it over.
func TestPipeBacksOff(t *testing.T) {
	t.Parallel()
	p := newTestPipe(64)
	now := time.Now()
	var holds []time.Duration
	for range 6 {
		p.backOffLocked(now)
		holds = append(holds, p.holdUntil.Sub(now))
	}
	want := []time.Duration{2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, growthHold, growthHold}
	if !slices.Equal(holds, want) {
		t.Errorf("holds: got %v, want %v", holds, want)
	}
	p.holdFor = 0 // a step paid off (see tickLocked)
	p.backOffLocked(now)
	if got := p.holdUntil.Sub(now); got != minGrowthHold {
		t.Errorf("hold after a step paid off: got %v, want %v", got, minGrowthHold)
	}
}
