// Package plan decides how a blob is split into chunks: which span is
// fetched next, on which connection, when a silent chunk's rest is asked for
// again (a hedge), how the blob's end is shared out (the endgame), and when
// a request for bytes another has brought gives way.
//
// It does no I/O, starts no goroutine and reads no clock: every decision is
// made from what the caller passes in (the blob's size and written ranges,
// the time, the facts of the connection and its endpoint), so that it can
// be tested as a table. The transport (package upstream) owns connections,
// budgets and concurrency, and asks a Planner what to do. A Planner is not
// safe for concurrent use: the transport calls it under the lock that
// guards its blob.
//
// The facts that shape a claim are per source (an endpoint: its free
// connection slots, its workers, how soon its silence means a stall) and
// per connection (its budget left, the chunk size its goodput calls for),
// never global, so that several endpoints of one upstream can be planned
// onto at once.
package plan

import "time"

// Written is what the blob's writer holds.
type Written interface {
	// Missing returns the first range at or after off not yet written, as
	// [start, end); start == end when nothing is missing.
	Missing(off int64) (start, end int64)
}

// Blob is the blob as it stands when a chunk is claimed.
type Blob struct {
	Size    int64   // -1 while not known
	Written Written // its written ranges; used once Size is known
	// Wanted holds the offsets clients wait at, ascending: the chunks there
	// are claimed (and hedged) first. Nil when none wait.
	Wanted []int64
	// Rate is the goodput the blob's connections are expected to bring
	// together, bytes/s, from every source that fetches it, when several
	// do; 0 with one source, or while a source's pace is unknown. With it
	// the blob's end is shared by pace (see share), and a slow chunk's
	// rest is split off to a faster connection (see split).
	Rate float64
	// BestConnRate is the goodput of one connection of the fastest source
	// among them, bytes/s; with Rate.
	BestConnRate float64
}

// Source is what the planner knows of the endpoint a claim is for.
type Source struct {
	// Free is how many more connections its pipe lets through now,
	// besides the one the claim is for: near the blob's end they share
	// what is left (see endgame).
	Free int
	// Workers is the most chunks of the blob fetched from it at once.
	Workers int
	// HedgeAfter is how long one of its chunks may bring nothing before
	// its rest is claimed again (see HedgeAfter).
	HedgeAfter time.Duration
	// Index tells the blob's sources apart: a hedge names the silent
	// chunk's (Chunk.OfSource).
	Index int
}

// Conn is what the planner knows of the connection a claim is for.
type Conn struct {
	Size int64 // bytes to ask for, at most (see ChunkSize)
	// Room is how many bytes the connection may still carry: a gap's rest
	// too short for a chunk of its own joins the chunk up to it.
	Room int64
	// Several: the connection's budget holds several chunks (a clean
	// path's), so a chunk cut shorter near a blob's end costs a request,
	// not a session (see endgame).
	Several bool
	// Rate is the goodput the connection is expected to bring, bytes/s
	// (its source's per connection); 0: unknown.
	Rate float64
}

// Chunk is a claimed byte range, and how to ask for it.
type Chunk struct {
	Start, End int64
	Open       bool   // ask for bytes=Start- and accept a 200: the stream of an upstream that ignores Range
	ID         uint64 // its entry among the chunks in flight; 0: none (a stream)
	Sizing     bool   // claimed while the blob's size is unknown: its answer tells it
	Hedge      bool   // the rest of a silent chunk, claimed again
	OfSource   int    // with Hedge: the Source.Index of the silent chunk
	Split      bool   // the back of a slow chunk's rest, split off to a faster connection (see split)
}

// Outcome is what a claim came to.
type Outcome int

const (
	None    Outcome = iota // nothing to claim: the blob is claimed whole, or stopped
	Claimed                // a chunk to fetch
	Wait                   // nothing yet: the first chunk is learning the size; claim again once it is released
)

// Wire is what the planner may ask of the connection a chunk's answer
// arrives on, to tell a silent path from a reader that lags.
type Wire interface {
	Received() int64 // bytes read from it, ever
	Pending() int    // bytes the path delivered that wait unread
}

// Planner plans one blob's chunks from one or more sources. The zero value
// is ready to use.
type Planner struct {
	inflight  []flight // claimed and not yet released
	lastID    uint64   // the id of the last chunk claimed
	watcher   int      // the worker watching the chunks in flight (see Watch); 0: none
	sizing    bool     // size unknown: a chunk is learning it
	noRange   bool     // the upstream ignores Range: one stream from the first missing byte
	streaming bool     // with noRange: a worker holds the stream
	stream    int64    // with streaming: the start of the chunk that holds it
	stopped   bool     // a chunk failed for good: nothing more is claimed
}

// flight is a chunk in flight, and what hedge knows of it. A hedge may
// claim the very range of the chunk it hedges: the id tells them apart.
type flight struct {
	start, end int64
	id         uint64
	source     int // the Source.Index it was claimed for
	claimedAt  time.Time
	seen       int64     // its first missing byte when last looked at
	seenAt     time.Time // when seen or read last moved (or the chunk was claimed)
	hedged     bool      // its rest was claimed again
	wire       Wire      // the connection its answer comes on; nil: not known (yet)
	read       int64     // wire's bytes received when last looked at
}

// Claim picks the next chunk for connection c of source src at now: at the
// first offset a client waits for that is neither written nor claimed, else
// the first such offset from the start; c.Size bytes long at most, or up to
// c.Room when the rest of the gap would be too short for a chunk of its
// own, and shorter near the blob's end while others could share what is
// left (see endgame; with several sources, by pace: see share). A chunk a
// client waits on that went silent is claimed again before anything else;
// once nothing else is left, the back of a chunk on a slower source (see
// split), or any silent chunk (see hedge). While the size is unknown, one
// chunk from the start learns it and the others Wait.
func (p *Planner) Claim(now time.Time, b Blob, src Source, c Conn) (Chunk, Outcome) {
	switch {
	case p.stopped:
		return Chunk{}, None
	case b.Size < 0:
		if p.sizing {
			return Chunk{}, Wait
		}
		p.sizing = true
		// Claimed like any chunk: the size is known as soon as its answer
		// comes, and a worker that claims then must not ask for it again.
		ch := p.track(Chunk{Start: 0, End: c.Size}, src, now)
		ch.Sizing = true
		return ch, Claimed
	case p.noRange:
		if p.streaming {
			return Chunk{}, None
		}
		start, end := b.Written.Missing(0)
		if start >= end {
			return Chunk{}, None
		}
		p.streaming, p.stream = true, start
		return Chunk{Start: start, End: b.Size, Open: true}, Claimed
	}
	if len(b.Wanted) > 0 {
		// A chunk a client waits on that went silent is asked for again
		// now, not at the blob's end: the client reads in order, so
		// everything after it waits too, until stall_timeout ends its
		// connection.
		if ch, ok := p.hedge(now, b.Written, b.Wanted, src); ok {
			return ch, Claimed
		}
	}
claiming:
	for i := 0; i <= len(b.Wanted); i++ {
		off := int64(0) // after the wanted offsets, from the start
		if i < len(b.Wanted) {
			off = b.Wanted[i]
		}
		if ch, ok := p.gapFrom(b.Written, off, c.Size, c.Room); ok {
			ch.End = p.endgame(ch, b, src, c)
			if b.Rate > 0 && c.Rate > 0 {
				if ch.End, ok = p.share(ch, b, c); !ok {
					break claiming // the faster connections bring the rest sooner
				}
			}
			return p.track(ch, src, now), Claimed
		}
	}
	if ch, ok := p.split(now, b, src, c); ok {
		return ch, Claimed
	}
	if ch, ok := p.hedge(now, b.Written, nil, src); ok {
		return ch, Claimed
	}
	return Chunk{}, None
}

// track enters ch, just claimed, among the chunks in flight under a new id,
// and returns it with that id.
func (p *Planner) track(ch Chunk, src Source, now time.Time) Chunk {
	p.lastID++
	ch.ID = p.lastID
	p.inflight = append(p.inflight, flight{start: ch.Start, end: ch.End, id: ch.ID, source: src.Index,
		claimedAt: now, seen: ch.Start, seenAt: now})
	return ch
}

// Release ends chunk ch: its request is over, however it went. What it
// left unwritten is free to claim again.
func (p *Planner) Release(ch Chunk) {
	if ch.Sizing {
		p.sizing = false
	}
	if p.streaming && p.stream == ch.Start {
		p.streaming = false
	}
	for i, s := range p.inflight {
		if s.id == ch.ID {
			p.inflight = append(p.inflight[:i], p.inflight[i+1:]...)
			break
		}
	}
}

// Attach records that the answer to chunk id arrives on w, so that hedge can
// tell a silent path from a reader that lags. After a redirect the
// target's connection, which carries the body, replaces the registry's.
func (p *Planner) Attach(id uint64, w Wire) {
	if id == 0 {
		return // a stream: never hedged
	}
	for i := range p.inflight {
		if s := &p.inflight[i]; s.id == id {
			s.wire, s.read = w, w.Received()
			return
		}
	}
}

// Stream records that the upstream ignores Range: from now on the blob
// comes as one stream, held by the chunk that starts at start, and
// claimed again from the first missing byte when that one ends.
func (p *Planner) Stream(start int64) {
	p.noRange, p.streaming, p.stream = true, true, start
}

// Stop ends the claiming of chunks: one failed in a way that asking again
// would not change.
func (p *Planner) Stop() { p.stopped = true }

// Stopped reports whether Stop was called.
func (p *Planner) Stopped() bool { return p.stopped }

// Unclaimed reports whether some of blob b is neither written nor claimed.
func (p *Planner) Unclaimed(b Blob) bool {
	if p.noRange || b.Size < 0 {
		return false
	}
	_, ok := p.gapFrom(b.Written, 0, 1, 1)
	return ok
}

// Watch makes worker (any non-zero id), which found nothing to claim, the
// one that watches the chunks in flight for one gone silent, unless another
// does or none is in flight. It returns how long to wait before claiming
// again, a quarter of hedgeAfter, or 0 when the worker is done.
func (p *Planner) Watch(worker int, hedgeAfter time.Duration) time.Duration {
	if p.watcher != 0 && p.watcher != worker {
		return 0
	}
	if len(p.inflight) == 0 || p.noRange {
		p.watcher = 0
		return 0
	}
	p.watcher = worker
	return hedgeAfter / 4
}

// Unwatch ends worker's watch, if it watches: it is ending.
func (p *Planner) Unwatch(worker int) {
	if p.watcher == worker {
		p.watcher = 0
	}
}

// Overtaken reports whether a request about to write at off has been
// overtaken by another request for the same bytes (a hedge, or the request
// it hedged): the byte at off is written already, and what it would bring
// next is held. Asked before writing, so that of two racing requests never
// both give way.
func Overtaken(w Written, off int64) bool {
	next, _ := w.Missing(off)
	return next > off
}

// gapFrom finds the first unwritten, unclaimed range at or after off: size
// bytes of it, or all of it when that is at most room and what size would
// leave is under MinChunk (a short rest would cost a request of its own).
func (p *Planner) gapFrom(w Written, off, size, room int64) (Chunk, bool) {
	for {
		start, end := w.Missing(off)
		if start >= end {
			return Chunk{}, false
		}
		moved := false
		for _, s := range p.inflight {
			if s.start <= start && start < s.end {
				off, moved = s.end, true
				break
			}
			if start < s.start && s.start < end {
				end = s.start
			}
		}
		if !moved {
			if end-start <= room && end-start-size < MinChunk {
				return Chunk{Start: start, End: end}, true
			}
			return Chunk{Start: start, End: min(end, start+size)}, true
		}
	}
}
