package plan

import (
	"testing"
	"time"
)

// TestClaimSharesTheEndByPace: with several sources, a chunk near the
// blob's end is the connection's share of what is left by pace, at least
// endgameMin; a connection much slower than the fastest source's claims
// nothing there, and one source alone plans as before.
func TestClaimSharesTheEndByPace(t *testing.T) {
	t.Parallel()
	const size = 100 * mib
	tests := []struct {
		name         string
		written      int64   // the blob's first bytes written
		rate, best   float64 // the blob's pace, its fastest source's per connection
		conn         float64 // the claiming connection's pace
		start, end   int64
		got          Outcome
		wantDeclined bool
	}{
		{name: "far from the end at the blob's pace: the whole chunk", written: 10 * mib, rate: 8e6, best: 2e6, conn: 2e6,
			start: 10 * mib, end: 14 * mib, got: Claimed},
		{name: "within a round of chunks at the blob's pace: a slow connection's share", written: 10 * mib, rate: 48e6, best: 2e6, conn: 1e6,
			start: 10 * mib, end: 10*mib + 90*mib/48, got: Claimed},
		{name: "near the end: its share by pace", written: 88 * mib, rate: 48e6, best: 2e6, conn: 2e6,
			start: 88 * mib, end: 88*mib + 12*mib/24, got: Claimed},
		{name: "share under the least piece, fast connection: the least piece", written: 98 * mib, rate: 48e6, best: 2e6, conn: 2e6,
			start: 98 * mib, end: 98*mib + endgameMin, got: Claimed},
		{name: "share under the least piece, a little slower: the least piece", written: 98 * mib, rate: 48e6, best: 2e6, conn: 1.5e6,
			start: 98 * mib, end: 98*mib + endgameMin, got: Claimed},
		{name: "share under the least piece, much slower: nothing", written: 98 * mib, rate: 48e6, best: 2e6, conn: 0.9e6,
			got: None},
		{name: "one source: the endgame alone, by count", written: 98 * mib, conn: 0.9e6,
			start: 98 * mib, end: 98*mib + endgameMin, got: Claimed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var p Planner
			b := blob(prefix(size, tt.written))
			b.Rate, b.BestConnRate = tt.rate, tt.best
			c := Conn{Size: 4 * mib, Room: 4 * mib, Several: true, Rate: tt.conn}
			ch, got := p.Claim(t0, b, Source{Free: 1, Workers: 8, HedgeAfter: MinHedge}, c)
			if got != tt.got {
				t.Fatalf("outcome %v, want %v", got, tt.got)
			}
			if got == Claimed && (ch.Start != tt.start || ch.End != tt.end) {
				t.Errorf("claimed [%d, %d), want [%d, %d)", ch.Start, ch.End, tt.start, tt.end)
			}
		})
	}
}

// TestClaimSplitsTheSlowestChunk: once nothing is left to claim, a faster
// connection takes the back of the chunk that would end last, from where
// both end together; not a chunk too young to have a pace, nor a back too
// short for a request, nor where the faster connection gains too little.
func TestClaimSplitsTheSlowestChunk(t *testing.T) {
	t.Parallel()
	const size = 8 * mib
	hedge := 600 * time.Millisecond // a new request's first byte: 200 ms
	src := Source{Workers: 8, HedgeAfter: hedge}
	tests := []struct {
		name       string
		after      time.Duration // from the claims to the split's
		brought    [2]int64      // what the two chunks in flight brought by then
		conn       float64
		start, end int64
		split      bool
	}{
		// The slow chunk [4, 8) MiB brought 1 MiB in 2 s (512 KiB/s): its
		// 3 MiB left take 6 s. A 4 MiB/s connection starting in 200 ms
		// ends with it from (5 MiB + 512 KiB/s × 0.2 s + 8 MiB / 8) / (1 + 1/8).
		{name: "slow chunk, fast connection: its back", after: 2 * time.Second, brought: [2]int64{4 * mib, mib},
			conn: 4 * mib, start: 5685612, end: 8 * mib, split: true},
		{name: "too young to have a pace", after: 500 * time.Millisecond, brought: [2]int64{4 * mib, 100 << 10},
			conn: 4 * mib},
		{name: "a much slower connection: the back it could take is too short", after: 2 * time.Second,
			brought: [2]int64{4 * mib, mib}, conn: 100 << 10},
		{name: "nearly done: the back is too short", after: 2 * time.Second, brought: [2]int64{4 * mib, 3*mib + 600<<10},
			conn: 4 * mib},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var p Planner
			w := &written{size: size}
			b := Blob{Size: size, Written: w}
			c := Conn{Size: 4 * mib, Room: 4 * mib}
			first := claimOK(t, &p, t0, b, src, c)
			second := claimOK(t, &p, t0, b, src, c)
			b.Rate, b.BestConnRate = 8*mib, 4*mib
			if first.Start != 0 || second.Start != 4*mib || second.End != size {
				t.Fatalf("claims [%d, %d) and [%d, %d), want the blob's halves", first.Start, first.End, second.Start, second.End)
			}
			w.spans = [][2]int64{{0, tt.brought[0]}, {4 * mib, 4*mib + tt.brought[1]}}
			c.Rate = tt.conn
			ch, got := p.Claim(t0.Add(tt.after), b, src, c)
			if !tt.split {
				if got != None {
					t.Fatalf("claimed [%d, %d) (split %v), want nothing", ch.Start, ch.End, ch.Split)
				}
				return
			}
			if got != Claimed || !ch.Split {
				t.Fatalf("outcome %v, split %v: want a split", got, ch.Split)
			}
			if d := ch.Start - tt.start; d < -1 || d > 1 || ch.End != tt.end {
				t.Errorf("split off [%d, %d), want [%d, %d)", ch.Start, ch.End, tt.start, tt.end)
			}
			// The chunk split now ends where the back begins: nothing is
			// left to claim, and a release of the back frees it again.
			if _, got := p.Claim(t0.Add(tt.after), b, src, Conn{Size: 4 * mib, Room: 4 * mib}); got != None {
				t.Errorf("after the split, a claim got %v, want nothing", got)
			}
			p.Release(ch)
			again, got := p.Claim(t0.Add(tt.after), b, Source{Workers: 8, HedgeAfter: time.Hour}, Conn{Size: 4 * mib, Room: 4 * mib})
			if got != Claimed || again.Start != ch.Start {
				t.Errorf("after releasing the back: claimed [%d, %d) (%v), want it from %d", again.Start, again.End, got, ch.Start)
			}
		})
	}
}
