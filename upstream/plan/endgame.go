package plan

import "math"

// endgame returns where chunk ch, claimed at the end of what is left of
// blob b, is to end: sooner when other connections could share the rest.
//
// Free slots of the pipe (of the blob's workers) share it in pieces: the
// blob's last chunks would otherwise each take a connection's set-up and
// slow start alone, as would one cut near the end and asked for again (at
// 100 ms, a MiB on a new connection takes about nine round trips), while
// the slots others freed stay idle.
//
// Where a connection's budget holds several chunks (several), the blob's
// chunks in flight, which claim again as they end, share it too, each share
// taken in endgameShares claims. The chunks in flight all move at once,
// and a client reading in order gets each one's bytes only as the ones
// before it end. As a blob's last chunks end, the link is shared by fewer
// of them and they end together: the client was handed all of them at once
// and read them after the upstream's last byte (at 100 ms, 64 chunks of a
// MiB: 20-45 MB, and a pull's end 0.34-0.48 s after that byte, against
// 0.14 s for containerd's own). Pieces that shrink a little at each claim,
// by less than a chunk in flight moves meanwhile, still end in order, and
// the last ones in flight hold little (0.15-0.29 s after the last byte;
// pullbench); where shares would be shorter than endgameMin, the pieces
// grow towards the end instead (see endgameRamp). On a path that cuts
// sessions each carries one chunk, as large as its budget allows: shorter
// ones cost sessions, and sharing there too took a pull at 100 ms from
// 1.04-1.07x containerd's own to 1.16x.
func (p *Planner) endgame(ch Chunk, b Blob, src Source, c Conn) int64 {
	free := max(0, min(src.Free, src.Workers-len(p.inflight)-1))
	pieces, shares := int64(free)+1, int64(1)
	if c.Several {
		pieces, shares = pieces+int64(len(p.inflight)), endgameShares
	}
	if pieces == 1 || ch.End-ch.Start <= endgameMin || b.Size-ch.Start > (ch.End-ch.Start)*pieces*shares {
		return ch.End // not near the end, or nothing to share it with
	}
	var rest int64
	for off := ch.Start; ; {
		g, ok := p.gapFrom(b.Written, off, b.Size, b.Size)
		if !ok {
			break
		}
		rest += g.End - g.Start
		off = g.End
	}
	piece := (rest + pieces*shares - 1) / (pieces * shares)
	if piece >= endgameMin {
		return min(ch.End, ch.Start+piece)
	}
	piece = endgameRamp(b.Size-ch.Start, int64(len(p.inflight)+1))
	if piece <= ch.End-ch.Start {
		return ch.Start + piece
	}
	// Longer than the chunk planned: as far as the gap and the
	// connection's budget allow.
	g, _ := p.gapFrom(b.Written, ch.Start, min(piece, c.Room), c.Room)
	return max(ch.End, g.End)
}

// endgameRamp is how long a piece is to be, claimed left bytes before the
// end of a blob with inflight chunks in flight (this one too), once the
// shares would be under endgameMin.
//
// Connections whose chunks ended together claim together, and pieces of
// one size end together again. At 40 ms, 30 pieces of 512 KiB were claimed
// within 30 ms near a 223 MiB blob's end and ended within 30 ms of each
// other: containerd, reading in order, was handed 15 MB in the upstream's
// last 30 ms, and its pull ended 0.28 s after that last byte (median of six
// runs) against 0.15 s for its own. Over the last inflight pieces' worth of
// the blob, pieces grow towards its end instead, as the square root of how
// much nearer it they are (up to endgameRampMax): connections sharing a
// path move at about the same rate, so pieces end in the order they start,
// and as fewer are left each gets a larger share and ends sooner after the
// one before it; the growth keeps them apart by about the time a client
// takes to read the piece before (in one pull's log, 3-12 ms apart, each
// handing containerd 1.0-1.7 MB). Six runs each, taking turns
// (pullbench, clean path): at 40 ms the pull's end came 0.22 s after the
// upstream's last byte against 0.28 s, the pull 10.60 s against 10.66 s
// (containerd's own 10.66 s); at 100 ms 0.21 s against 0.25 s, 11.39 s
// against 11.43 s (11.70 s); the same at 0 ms.
func endgameRamp(left, inflight int64) int64 {
	ramp := inflight * endgameMin
	if left >= ramp {
		return endgameMin
	}
	return min(endgameRampMax, int64(float64(endgameMin)*math.Sqrt(float64(ramp)/float64(left))))
}

// endgameRampMax is the longest piece endgameRamp makes.
const endgameRampMax = 4 * endgameMin

// endgameMin is the least a chunk is shortened to near a blob's end: a
// request costs a round trip of its own, in which its connection carries
// nothing. The pieces in flight end together, round by round, and each
// round leaves every connection waiting for its next answer at once: at
// 128 KiB, across a clean 100 ms path, 1.3-1.7 MB of the link went unused
// each time, three rounds in a pull's last 0.5 s. At minChunk, pulls there
// took 11.63-11.84 s against 11.78-11.92 s (nine runs each, taking turns;
// containerd's own 11.62-11.72 s), and the same as before at 0 and 40 ms
// (three runs each; pullbench).
const endgameMin = MinChunk

// endgameShares is how many claims a connection's share of what is left of
// a blob is taken in. With 1, a piece shrinks by about as much as a chunk
// in flight moves meanwhile, and pieces ended out of order; 2 and 4 both
// ended them in order, and at 100 ms a pull through 64 connections asked
// for 1,310 chunks with 2, about 2,200 with 4, and 617 without sharing
// (pullbench).
const endgameShares = 2
