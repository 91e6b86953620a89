package upstream

import (
	"context"
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

func TestPriority(t *testing.T) {
	t.Parallel()
	promoted := NewPriority(true)
	promoted.Promote()
	promoted.Promote() // twice is harmless
	tests := []struct {
		name string
		ctx  context.Context
		want bool
	}{
		{"unmarked", context.Background(), false},
		{"WithBackground", WithBackground(context.Background()), true},
		{"background Priority", WithPriority(context.Background(), NewPriority(true)), true},
		{"foreground Priority", WithPriority(context.Background(), NewPriority(false)), false},
		{"promoted", WithPriority(context.Background(), promoted), false},
		{"nil Priority", WithPriority(context.Background(), nil), false},
		{"a foreground Priority over a background mark", WithPriority(WithBackground(context.Background()), NewPriority(false)), false},
	}
	for _, tt := range tests {
		if got := IsBackground(tt.ctx); got != tt.want {
			t.Errorf("%s: IsBackground got %v, want %v", tt.name, got, tt.want)
		}
	}
}

// backgroundSource is a blob's source fetched at background priority.
func backgroundSource() *source {
	return &source{blobFetch: &blobFetch{prio: NewPriority(true)}}
}

// backgroundHeld is how many slots background sources hold in p.
func backgroundHeld(p *pipe) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.backgroundHeldLocked()
}

// TestPipeBackgroundCap: background blobs together never hold more than
// their share of the limit (at least one slot), however many of their
// workers wait and however often slots are freed; a foreground blob takes
// the rest at once.
func TestPipeBackgroundCap(t *testing.T) {
	t.Parallel()
	tests := []struct {
		limit int
		share float64
		cap   int
	}{
		{4, 0.5, 2},
		{8, 0.5, 4},
		{7, 0.5, 3},
		{2, 0.25, 1}, // at least one
		{6, 1, 6},
	}
	for _, tt := range tests {
		synctest.Test(t, func(t *testing.T) {
			p := newTestPipe(tt.limit)
			p.roundTrip = nil // the path unknown: the limit stays where it starts, at the ceiling
			p.share = tt.share
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			a, b := backgroundSource(), backgroundSource()
			granted := make(chan *source, 4*tt.limit)
			for _, o := range []*source{a, b} {
				for range 2 * tt.limit {
					go func() {
						if _, err := p.acquire(ctx, o); err == nil {
							granted <- o
						}
					}()
				}
			}
			synctest.Wait()
			if got := len(granted); got != tt.cap {
				t.Fatalf("limit %d, share %v: %d background workers of %d got a slot, want %d", tt.limit, tt.share, got, 4*tt.limit, tt.cap)
			}
			for i := range 2 * tt.limit {
				p.release(<-granted, &lane{}, 0)
				synctest.Wait()
				if got := backgroundHeld(p); got != tt.cap {
					t.Fatalf("limit %d, share %v, after %d releases: background holds %d slots, want %d", tt.limit, tt.share, i+1, got, tt.cap)
				}
			}
			fg := &source{blobFetch: &blobFetch{}}
			if got := p.free(fg); got != tt.limit-tt.cap {
				t.Errorf("limit %d, share %v: free for a foreground blob %d, want %d", tt.limit, tt.share, got, tt.limit-tt.cap)
			}
			if got := p.free(a); got != 0 {
				t.Errorf("limit %d, share %v: free for a background blob %d, want 0", tt.limit, tt.share, got)
			}
			for range tt.limit - tt.cap { // at once: a deadlock otherwise
				if _, err := p.acquire(ctx, fg); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// TestPipeForegroundFirst: a freed slot goes to a foreground blob's waiter
// before a background one's that waited longer, holds none and is nearer
// its end; the background one gets the next.
func TestPipeForegroundFirst(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const mib = 1 << 20
		p := newTestPipe(2)
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		fg := &source{blobFetch: &blobFetch{}}
		fg.size.Store(100 * mib)
		bg := backgroundSource()
		bg.size.Store(mib)
		for range 2 {
			if _, err := p.acquire(ctx, fg); err != nil {
				t.Fatal(err)
			}
		}
		granted := make(chan *source, 2)
		for _, o := range []*source{bg, fg} {
			go func() {
				if _, err := p.acquire(ctx, o); err == nil {
					granted <- o
				}
			}()
			synctest.Wait() // queued in this order
		}
		var got []*source
		for range 2 {
			p.release(fg, &lane{}, 0)
			synctest.Wait()
			got = append(got, <-granted)
		}
		if want := []*source{fg, bg}; !slices.Equal(got, want) {
			name := map[*source]string{fg: "foreground", bg: "background"}
			t.Errorf("slots went to %s then %s, want the foreground blob first", name[got[0]], name[got[1]])
		}
	})
}

// TestPipePromotedUncapped: a background blob promoted while its workers
// wait is no longer capped: the slots the cap held back are its at once,
// and it counts as background no more.
func TestPipePromotedUncapped(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		p := newTestPipe(4)
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		bg := backgroundSource()
		granted := make(chan struct{}, 6)
		for range 6 {
			go func() {
				if _, err := p.acquire(ctx, bg); err == nil {
					granted <- struct{}{}
				}
			}()
		}
		synctest.Wait()
		if got := len(granted); got != 2 {
			t.Fatalf("before promotion: %d slots, want 2 (half of 4)", got)
		}
		bg.prio.Promote()
		synctest.Wait()
		if got := len(granted); got != 4 {
			t.Errorf("after promotion: %d slots, want 4 (the limit)", got)
		}
		if got := backgroundHeld(p); got != 0 {
			t.Errorf("after promotion: background holds %d slots, want 0", got)
		}
		p.release(bg, &lane{}, 0)
		synctest.Wait()
		if got := len(granted); got != 5 {
			t.Errorf("after a release: %d slots, want 5", got)
		}
	})
}

// TestPipeGrowsWithBackgroundOnly: with only background work on a path
// with room (each connection 1 MB/s, the link 64 MB/s), the limit still
// grows to the ceiling, background work holding half of it, and the
// goodput a connection brings is measured as 1 MB/s, not halved by the
// slots the cap leaves unused.
func TestPipeGrowsWithBackgroundOnly(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		p := newTestPipe(64)
		// Neither short nor long: the limit starts at initialConnections
		// and has to grow.
		p.roundTrip = func() time.Duration { return 20 * time.Millisecond }
		peak := simulateOwnerPath(t, p, backgroundSource(), 100, 1e6, func() float64 { return 64e6 }, 1<<20, time.Minute)
		if got := p.current(); got != 64 {
			t.Errorf("limit after a minute: got %d, want 64", got)
		}
		if peak > 32 {
			t.Errorf("background connections at once: got %d, want at most 32", peak)
		}
		p.mu.Lock()
		rate := p.connRate
		p.mu.Unlock()
		if rate < 0.9e6 || rate > 1.1e6 {
			t.Errorf("goodput per connection: got %.0f B/s, want about 1e6", rate)
		}
	})
}
