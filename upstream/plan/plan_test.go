package plan

import (
	"cmp"
	"testing"
	"time"
)

const mib = 1 << 20

// written is a blob's written ranges, ascending and apart.
type written struct {
	size  int64
	spans [][2]int64
}

func (w *written) Missing(off int64) (int64, int64) {
	start := off
	for _, s := range w.spans {
		switch {
		case s[1] <= start:
		case s[0] <= start:
			start = s[1]
		default:
			return start, s[0]
		}
	}
	if start >= w.size {
		return w.size, w.size
	}
	return start, w.size
}

// prefix returns a blob of size bytes with its first n written.
func prefix(size, n int64) *written {
	w := &written{size: size}
	if n > 0 {
		w.spans = [][2]int64{{0, n}}
	}
	return w
}

// wire is a chunk connection as the planner sees it.
type wire struct {
	received int64
	pending  int
}

func (w *wire) Received() int64 { return w.received }
func (w *wire) Pending() int    { return w.pending }

var (
	t0  = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	src = Source{Free: 0, Workers: 8, HedgeAfter: MinHedge}
	one = Conn{Size: mib, Room: mib}
)

func blob(w *written) Blob { return Blob{Size: w.size, Written: w} }

func claimOK(t *testing.T, p *Planner, now time.Time, b Blob, s Source, c Conn) Chunk {
	t.Helper()
	ch, got := p.Claim(now, b, s, c)
	if got != Claimed {
		t.Fatalf("claim: got outcome %v, want Claimed", got)
	}
	return ch
}

// TestClaim: the chunk each claim, in turn, comes to.
func TestClaim(t *testing.T) {
	t.Parallel()
	type claim struct {
		conn       Conn
		written    [][2]int64 // the writer's ranges, from this claim on; nil: as before
		release    int        // before claiming, the chunk the nth claim (1-based) got is released; 0: none
		start, end int64
		got        Outcome
	}
	tests := []struct {
		name   string
		size   int64
		claims []claim
	}{
		{"the first claim", 8 * mib, []claim{{conn: one, end: mib, got: Claimed}}},
		{"contiguous claims", 8 * mib, []claim{
			{conn: one, start: 0, end: mib, got: Claimed},
			{conn: one, start: mib, end: 2 * mib, got: Claimed},
			{conn: one, start: 2 * mib, end: 3 * mib, got: Claimed},
		}},
		{"written ranges are skipped", 8 * mib, []claim{
			{conn: one, written: [][2]int64{{0, 2 * mib}}, start: 2 * mib, end: 3 * mib, got: Claimed},
		}},
		{"a chunk cut mid-way resumes at its offset", 8 * mib, []claim{
			{conn: one, start: 0, end: mib, got: Claimed},
			{conn: one, start: mib, end: 2 * mib, got: Claimed},
			// The first chunk broke off after 300 KiB: its rest, up to
			// the chunk in flight after it.
			{conn: one, written: [][2]int64{{0, 300 << 10}}, release: 1, start: 300 << 10, end: mib, got: Claimed},
		}},
		{"a blob smaller than one chunk", 300 << 10, []claim{
			{conn: one, start: 0, end: 300 << 10, got: Claimed},
			{conn: one, got: None},
		}},
		{"the budget caps a claim", 8 * mib, []claim{
			{conn: Conn{Size: 600 << 10, Room: 600 << 10}, start: 0, end: 600 << 10, got: Claimed},
		}},
		{"a short rest joins the chunk, up to the budget", 8*mib + 100<<10, []claim{
			{conn: Conn{Size: mib, Room: 2 * mib}, written: [][2]int64{{0, 7 * mib}}, start: 7 * mib, end: 8*mib + 100<<10, got: Claimed},
		}},
		{"a short rest past the budget stays", 8*mib + 100<<10, []claim{
			{conn: one, written: [][2]int64{{0, 7 * mib}}, start: 7 * mib, end: 8 * mib, got: Claimed},
		}},
		{"all written", 2 * mib, []claim{
			{conn: one, written: [][2]int64{{0, 2 * mib}}, got: None},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &written{size: tt.size}
			var p Planner
			var got []Chunk
			for i, c := range tt.claims {
				if c.written != nil {
					w.spans = c.written
				}
				if c.release > 0 {
					p.Release(got[c.release-1])
				}
				ch, out := p.Claim(t0, blob(w), src, c.conn)
				got = append(got, ch)
				if out != c.got || out == Claimed && (ch.Start != c.start || ch.End != c.end) {
					t.Errorf("claim %d: got %d-%d (%v), want %d-%d (%v)", i+1, ch.Start, ch.End, out, c.start, c.end, c.got)
				}
			}
		})
	}
}

// TestClaimUnknownSize: while the size is unknown, one chunk from the start
// learns it and the others wait; released, the blob is claimed as usual.
func TestClaimUnknownSize(t *testing.T) {
	t.Parallel()
	var p Planner
	w := &written{size: -1}
	first := claimOK(t, &p, t0, blob(w), src, one)
	if !first.Sizing || first.Start != 0 || first.End != mib {
		t.Fatalf("first claim: got %+v, want the sizing chunk 0-%d", first, mib)
	}
	if _, got := p.Claim(t0, blob(w), src, one); got != Wait {
		t.Fatalf("second claim: got %v, want Wait", got)
	}
	w.size, w.spans = 300<<10, [][2]int64{{0, 100 << 10}} // a small blob, cut after 100 KiB
	p.Release(first)
	if c := claimOK(t, &p, t0, blob(w), src, one); c.Sizing || c.Start != 100<<10 || c.End != 300<<10 {
		t.Errorf("after the size: got %+v, want %d-%d", c, 100<<10, 300<<10)
	}
}

// TestClaimStream: an upstream that ignores Range sends one stream from the
// first missing byte at a time, and is never hedged.
func TestClaimStream(t *testing.T) {
	t.Parallel()
	var p Planner
	w := prefix(4*mib, 0)
	c := claimOK(t, &p, t0, blob(w), src, one)
	p.Stream(c.Start) // answered 200
	if _, got := p.Claim(t0, blob(w), src, one); got != None {
		t.Fatalf("while the stream is held: got %v, want None", got)
	}
	p.Release(c)
	w.spans = [][2]int64{{0, mib + 5}}
	s := claimOK(t, &p, t0, blob(w), src, one)
	if !s.Open || s.ID != 0 || s.Start != mib+5 || s.End != 4*mib {
		t.Errorf("the stream again: got %+v, want an open stream %d-%d", s, mib+5, 4*mib)
	}
	if d := p.Watch(1, time.Second); d != 0 {
		t.Errorf("watch a stream: got %v, want 0", d)
	}
	if p.Unclaimed(blob(w)) {
		t.Error("unclaimed with a stream: got true, want false")
	}
}

// TestClaimStopped: once stopped, nothing is claimed.
func TestClaimStopped(t *testing.T) {
	t.Parallel()
	var p Planner
	p.Stop()
	if _, got := p.Claim(t0, blob(prefix(4*mib, 0)), src, one); got != None {
		t.Errorf("got %v, want None", got)
	}
}

// TestClaimNearTheEnd: a chunk claimed where what is left of the blob could
// be shared with free slots of the pipe is shortened to the rest's share,
// never below endgameMin; on a clean path (a budget of several chunks) the
// blob's chunks in flight share it too, each in endgameShares claims;
// elsewhere, or with no slot or worker of the blob's free, it keeps the
// size asked for. Where shares would be under endgameMin, the last pieces
// grow towards the blob's end (endgameRamp), past the size asked for as
// far as the connection's budget allows.
func TestClaimNearTheEnd(t *testing.T) {
	t.Parallel()
	type span struct{ start, end int64 }
	threeInFlight := []span{{8 * mib, 9 * mib}, {9 * mib, 10 * mib}, {10 * mib, 11 * mib}}
	var sixteenInFlight []span // 512 KiB each, the blob's first 8 MiB
	for off := int64(0); off < 8*mib; off += 512 << 10 {
		sixteenInFlight = append(sixteenInFlight, span{off, off + 512<<10})
	}
	tests := []struct {
		name      string
		size      int64  // the blob's
		written   int64  // its first bytes already in
		inflight  []span // claimed by other workers
		free      int
		several   bool // the connection's budget holds several chunks
		wantStart int64
		wantEnd   int64
		workers   int   // 0: 64
		room      int64 // the connection's budget left; 0: a MiB
	}{
		{"far from the end", 8 * mib, 0, nil, 4, false, 0, mib, 0, 0},
		{"no free slot", 8 * mib, 7 * mib, nil, 0, false, 7 * mib, 8 * mib, 0, 0},
		{"the last 2 MiB, three free slots", 8 * mib, 6 * mib, nil, 3, false, 6 * mib, 6*mib + 512<<10, 0, 0},
		{"the last MiB, many free slots", 8 * mib, 7 * mib, nil, 63, false, 7 * mib, 7*mib + endgameMin, 0, 0},
		{"what others hold is not shared", 8 * mib, 6 * mib, []span{{6 * mib, 7 * mib}}, 1, false, 7 * mib, 7*mib + 512<<10, 0, 0},
		{"two MiB left, one free slot", 8 * mib, 6 * mib, nil, 1, false, 6 * mib, 7 * mib, 0, 0},
		{"no worker free", 8 * mib, 6 * mib, []span{{6 * mib, 7 * mib}}, 8, false, 7 * mib, 8 * mib, 2, 0},
		// 5 MiB left, shared by this chunk and three in flight, each
		// share in endgameShares (2) claims: 640 KiB.
		{"a clean path: chunks in flight share the rest", 16 * mib, 8 * mib, threeInFlight, 0, true, 11 * mib, 11*mib + 640<<10, 0, 0},
		{"a clean path, far from the end", 64 * mib, 8 * mib, threeInFlight, 0, true, 11 * mib, 12 * mib, 0, 0},
		{"a path that cuts: chunks in flight do not share", 16 * mib, 8 * mib, threeInFlight, 0, false, 11 * mib, 12 * mib, 0, 0},
		{"a clean path, never below endgameMin", 9 * mib, 8 * mib, []span{{8 * mib, 8*mib + 512<<10}}, 0, true, 8*mib + 512<<10, 8*mib + 512<<10 + endgameMin, 0, 0},
		// 4 MiB left, within the last 17 pieces' worth of 512 KiB:
		// 512 KiB times the square root of 8.5/4.
		{"a clean path's last pieces grow", 12 * mib, 0, sixteenInFlight, 0, true, 8 * mib, 8*mib + 764274, 0, 4 * mib},
		{"nearer the end, longer than asked for", 10 * mib, 0, sixteenInFlight, 0, true, 8 * mib, 8*mib + 1080847, 0, 4 * mib},
		{"a rest too short to leave is taken whole", 9*mib + 512<<10, 0, sixteenInFlight, 0, true, 8 * mib, 9*mib + 512<<10, 0, 4 * mib},
		{"but never past the connection's budget", 9*mib + 512<<10, 0, sixteenInFlight, 0, true, 8 * mib, 9 * mib, 0, mib},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var p Planner
			for _, s := range tt.inflight {
				p.track(Chunk{Start: s.start, End: s.end}, Source{}, t0)
			}
			s := Source{Free: tt.free, Workers: cmp.Or(tt.workers, 64), HedgeAfter: MinHedge}
			c, got := p.Claim(t0, blob(prefix(tt.size, tt.written)), s, Conn{Size: mib, Room: cmp.Or(tt.room, mib), Several: tt.several})
			if got != Claimed || c.Start != tt.wantStart || c.End != tt.wantEnd {
				t.Errorf("claimed %d-%d (%v), want %d-%d", c.Start, c.End, got, tt.wantStart, tt.wantEnd)
			}
		})
	}
}

// TestEndgameRamp: past the last pieces' worth of a blob, pieces grow as
// the square root of how much nearer its end they are, up to
// endgameRampMax.
func TestEndgameRamp(t *testing.T) {
	t.Parallel()
	tests := []struct{ left, inflight, want int64 }{
		{64 * mib, 16, endgameMin},
		{8 * mib, 16, endgameMin},
		{2 * mib, 16, 2 * endgameMin},
		{mib / 4, 16, endgameRampMax},
	}
	for _, tt := range tests {
		if got := endgameRamp(tt.left, tt.inflight); got != tt.want {
			t.Errorf("endgameRamp(%d, %d): got %d, want %d", tt.left, tt.inflight, got, tt.want)
		}
	}
}

// TestClaimHedgesASilentChunkAClientWaitsOn: a chunk in flight that holds
// the offset a client waits at, silent for HedgeAfter, is claimed again
// before the rest of the blob; a silent one that no client waits on is left
// for the blob's end.
func TestClaimHedgesASilentChunkAClientWaitsOn(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		wanted    []int64
		wantStart int64
		wantEnd   int64
		hedge     bool
	}{
		{"a client waits in the silent chunk", []int64{mib + 100}, mib + 100, 2 * mib, true},
		{"no client waits", nil, 2 * mib, 3 * mib, false},
		{"a client waits elsewhere", []int64{5 * mib}, 5 * mib, 6 * mib, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// 100 bytes of the second MiB in, and nothing since.
			p := Planner{inflight: []flight{{start: mib, end: 2 * mib, id: 1, seen: mib + 100, seenAt: t0}}, lastID: 1}
			b := blob(prefix(8*mib, mib+100))
			b.Wanted = tt.wanted
			c, got := p.Claim(t0.Add(time.Second), b, src, one)
			if got != Claimed || c.Start != tt.wantStart || c.End != tt.wantEnd || c.Hedge != tt.hedge {
				t.Errorf("claimed %d-%d (%v, hedge %v), want %d-%d (hedge %v)", c.Start, c.End, got, c.Hedge, tt.wantStart, tt.wantEnd, tt.hedge)
			}
		})
	}
}

// TestClaimHedgesASilentChunk: in the endgame, with nothing else left to
// claim, the rest of a chunk in flight that has brought nothing for
// HedgeAfter is claimed again (a duplicate of the slow tail), once; one
// still bringing bytes is left alone.
func TestClaimHedgesASilentChunk(t *testing.T) {
	t.Parallel()
	var p Planner
	w := prefix(4*mib, 3*mib)
	last := claimOK(t, &p, t0, blob(w), src, one)
	w.spans = [][2]int64{{0, 3*mib + 100}} // 100 bytes of the last MiB in
	if c, got := p.Claim(t0.Add(time.Second), blob(w), src, one); got != None {
		t.Fatalf("a chunk that brought bytes since last looked at: claimed %d-%d, want nothing", c.Start, c.End)
	}
	at := t0.Add(time.Second + src.HedgeAfter)
	c := claimOK(t, &p, at, blob(w), src, one)
	if !c.Hedge || c.Start != 3*mib+100 || c.End != 4*mib || c.ID == last.ID {
		t.Fatalf("a silent chunk: claimed %+v, want a hedge of its rest %d-%d", c, 3*mib+100, 4*mib)
	}
	if c, got := p.Claim(at, blob(w), src, one); got != None {
		t.Errorf("hedged already: claimed %d-%d, want nothing", c.Start, c.End)
	}
	// The hedge came first and wrote the rest: the original request gives
	// way at its next byte, and the blob is claimed whole.
	w.spans = [][2]int64{{0, 4 * mib}}
	if !Overtaken(w, 3*mib+100) {
		t.Error("the request hedged, its next byte written: got not overtaken, want overtaken")
	}
	p.Release(c)
	p.Release(last)
	if p.Unclaimed(blob(w)) {
		t.Error("every byte written: got unclaimed bytes")
	}
}

// TestClaimLeavesALaggingReader: a chunk whose connection still brings
// bytes (read and held, or waiting unread in the socket) is not silent;
// once nothing moves and nothing waits, it is. The connection that counts
// is the last the chunk's answer was attached to.
func TestClaimLeavesALaggingReader(t *testing.T) {
	t.Parallel()
	var p Planner
	w := prefix(4*mib, 3*mib)
	c := claimOK(t, &p, t0, blob(w), src, one)
	registry, conn := &wire{received: 700}, &wire{received: 40}
	p.Attach(c.ID, registry) // answered with a redirect
	p.Attach(c.ID, conn)
	registry.received = 900 // the registry's connection moves: it does not count
	at := t0
	claim := func(what string, want bool) {
		t.Helper()
		at = at.Add(time.Second)
		ch, got := p.Claim(at, blob(w), src, one)
		if (got == Claimed) != want {
			t.Fatalf("%s: claimed %d-%d (%v), want claimed: %v", what, ch.Start, ch.End, got, want)
		}
	}
	conn.pending = 1000
	claim("bytes waiting unread in the socket", false)
	conn.pending, conn.received = 0, 1040
	claim("bytes read, not written yet", false)
	claim("nothing read, nothing waiting", true)
}

// TestOvertaken: a request gives way at a byte written already, never at
// one still missing.
func TestOvertaken(t *testing.T) {
	t.Parallel()
	w := &written{size: 4 * mib, spans: [][2]int64{{0, mib}, {2 * mib, 3 * mib}}}
	tests := []struct {
		off  int64
		want bool
	}{{0, true}, {mib - 1, true}, {mib, false}, {2*mib - 1, false}, {2 * mib, true}, {3 * mib, false}}
	for _, tt := range tests {
		if got := Overtaken(w, tt.off); got != tt.want {
			t.Errorf("Overtaken at %d: got %v, want %v", tt.off, got, tt.want)
		}
	}
}

// TestWatch: one worker watches the chunks in flight, a quarter of
// HedgeAfter at a time, while any are; the others are done.
func TestWatch(t *testing.T) {
	t.Parallel()
	var p Planner
	if d := p.Watch(1, time.Second); d != 0 {
		t.Fatalf("nothing in flight: got %v, want 0", d)
	}
	c := claimOK(t, &p, t0, blob(prefix(4*mib, 0)), src, one)
	if d := p.Watch(1, time.Second); d != 250*time.Millisecond {
		t.Fatalf("the first watcher: got %v, want 250ms", d)
	}
	if d := p.Watch(2, time.Second); d != 0 {
		t.Fatalf("another worker: got %v, want 0", d)
	}
	p.Release(c)
	if d := p.Watch(1, time.Second); d != 0 {
		t.Fatalf("nothing left in flight: got %v, want 0", d)
	}
	if d := p.Watch(2, time.Second); d != 0 {
		t.Fatalf("another worker, nothing in flight: got %v, want 0", d)
	}
}

// TestSizes: the chunk target follows a connection's goodput within its
// bounds; the budget left caps a chunk, and takes a short remainder along;
// a chunk is hedged after a few connection set-ups, within the bounds.
func TestSizes(t *testing.T) {
	t.Parallel()
	targets := []struct {
		rate float64
		want int64
	}{
		{0, MinChunkTarget},
		{2e6, MinChunkTarget},
		{8e6, 30 << 16}, // 2 MB in a ChunkPace, in whole 64 KiB
		{100e6, MaxChunkTarget},
	}
	for _, tt := range targets {
		if got := Target(tt.rate); got != tt.want {
			t.Errorf("Target(%v): got %d, want %d", tt.rate, got, tt.want)
		}
	}
	sizes := []struct{ left, target, want int64 }{
		{64 * mib, mib, mib},
		{600 << 10, mib, 600 << 10},
		{mib + MinChunk, mib, mib + MinChunk},
		{mib + MinChunk + 1, mib, mib},
	}
	for _, tt := range sizes {
		if got := ChunkSize(tt.left, tt.target); got != tt.want {
			t.Errorf("ChunkSize(%d, %d): got %d, want %d", tt.left, tt.target, got, tt.want)
		}
	}
	hedges := []struct{ setup, stall, want time.Duration }{
		{0, 2 * time.Second, MinHedge},
		{50 * time.Millisecond, 2 * time.Second, MinHedge},
		{200 * time.Millisecond, 2 * time.Second, 600 * time.Millisecond},
		{time.Second, 2 * time.Second, time.Second},
		{0, 400 * time.Millisecond, 200 * time.Millisecond},
	}
	for _, tt := range hedges {
		if got := HedgeAfter(tt.setup, tt.stall); got != tt.want {
			t.Errorf("HedgeAfter(%v, %v): got %v, want %v", tt.setup, tt.stall, got, tt.want)
		}
	}
}
