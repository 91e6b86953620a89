package plan

import "math"

// endgame returns where chunk ch, claimed at the end of what is left of
// blob b, is to end: sooner when other connections could share the rest.
//
// Free slots of the source's pipe (of the blob's workers) share it in
// pieces: the blob's last chunks would otherwise each take a connection's
// set-up and slow start alone, as would one cut near the end and asked for
// again, while the slots others freed stay idle.
//
// Where a connection's budget holds several chunks (Conn.Several), the
// blob's chunks in flight, which claim again as they end, share it too,
// each share taken in endgameShares claims. Chunks in flight all move at
// once, and a client reading in order gets each one's bytes only as the
// ones before it end: if the blob's last chunks end together, the client
// is handed all of them at once, after the upstream's last byte. Pieces
// that shrink a little at each claim, by less than a chunk in flight moves
// meanwhile, still end in order, and the last ones in flight hold little;
// where shares would be shorter than endgameMin, the pieces grow towards
// the end instead (see endgameRamp). On a path that cuts sessions each
// carries one chunk, as large as its budget allows: shorter ones would cost
// sessions, the very thing such a path rations.
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
// one size would end together again, handing a client reading in order
// many of them at once. Over the last inflight pieces' worth of the blob,
// pieces grow towards its end instead, as the square root of how much
// nearer it they are (up to endgameRampMax): connections sharing a path
// move at about the same rate, so pieces end in the order they start, and
// as fewer are left each gets a larger share and ends sooner after the one
// before it. The growth keeps them apart by about the time a client takes
// to read the piece before.
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
// nothing, and pieces in flight that end together leave every connection
// waiting for its next answer at once. Below a few hundred KiB a long
// path's link would idle more than the sharing gains.
const endgameMin = MinChunk

// endgameShares is how many claims a connection's share of what is left of
// a blob is taken in. With one, a piece shrinks by about as much as a chunk
// in flight moves meanwhile, and pieces end out of order; two keeps them in
// order with the fewest requests.
const endgameShares = 2
