package plan

import "time"

// Several sources (endpoints that hold the same digests) fetch one blob at
// once, each claiming as its connections free up, so each brings a share
// in proportion to its pace without being told. Only the blob's end needs
// planning: a chunk claimed there by a slow source ends after the fast ones
// have brought everything else, and the blob waits on it. So near the end a
// connection's piece is its share of what is left by pace (share), a
// connection too slow for even a small piece leaves it to the others, and
// a chunk that would end last is split, its back claimed by a faster
// connection (split).

// share returns where chunk ch, claimed on connection c while several
// sources fetch blob b, is to end: no further than c's share, by pace, of
// the bytes neither written nor claimed, or endgameMin, which is worth a
// request. Once that share is under endgameMin, it reports false for a
// connection shareSlack times slower than the fastest source's: those
// bring what is left sooner without it.
func (p *Planner) share(ch Chunk, b Blob, c Conn) (int64, bool) {
	piece := int64(float64(p.unclaimed(b.Written)) * c.Rate / b.Rate)
	if piece >= endgameMin {
		return min(ch.End, ch.Start+piece), true
	}
	if c.Rate*shareSlack < b.BestConnRate {
		return 0, false
	}
	return min(ch.End, ch.Start+endgameMin), true
}

// shareSlack: a connection this much slower than the fastest source's
// claims nothing near the blob's end. A little slower still helps: the
// pieces there are small.
const shareSlack = 2

// split claims, for connection c of source src, the back of the rest of
// the chunk in flight that would end last at the pace it has kept, where c
// would bring that back sooner: from the offset at which both would end
// together, c starting after about a new request's set-up and round trip
// (a third of src.HedgeAfter). Only where that ends the chunk at least a
// quarter sooner (splitGain), and the back is worth a request
// (endgameMin); only chunks that have run for HedgeAfter, whose pace is
// known. The chunk in flight is not told: it reads on, and whichever
// request reaches a byte first writes it, the other giving way at the
// first byte it finds written (Overtaken), so at most what one holds
// unread when it stops is fetched twice.
func (p *Planner) split(now time.Time, b Blob, src Source, c Conn) (Chunk, bool) {
	if b.Rate <= 0 || c.Rate <= 0 {
		return Chunk{}, false
	}
	best, bestLeft, bestRate, bestMissing := -1, time.Duration(0), 0.0, int64(0)
	for i := range p.inflight {
		s := &p.inflight[i]
		if s.hedged {
			continue // silent: hedge's
		}
		missing, _ := b.Written.Missing(s.start)
		ran := now.Sub(s.claimedAt)
		if missing >= s.end || missing <= s.start || ran < src.HedgeAfter {
			continue
		}
		rate := float64(missing-s.start) / ran.Seconds()
		if left := seconds(float64(s.end-missing) / rate); left > bestLeft {
			best, bestLeft, bestRate, bestMissing = i, left, rate, missing
		}
	}
	if best < 0 {
		return Chunk{}, false
	}
	s := &p.inflight[best]
	delay := (src.HedgeAfter / 3).Seconds()
	// The chunk brings [missing, at) at bestRate while c, after delay,
	// brings [at, end) at c.Rate, both ending together.
	ratio := bestRate / c.Rate
	at := int64((float64(bestMissing) + bestRate*delay + ratio*float64(s.end)) / (1 + ratio))
	if at <= bestMissing || s.end-at < endgameMin {
		return Chunk{}, false
	}
	if together := seconds(delay + float64(s.end-at)/c.Rate); together > bestLeft*splitGain/4 {
		return Chunk{}, false
	}
	back := Chunk{Start: at, End: s.end, Split: true}
	s.end = at
	ch := p.track(back, src, now)
	ch.Split = true
	return ch, true
}

// splitGain, in quarters: a split must end the chunk in this share of the
// time it would take alone.
const splitGain = 3

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// unclaimed returns how many bytes of the blob are neither written nor
// claimed.
func (p *Planner) unclaimed(w Written) int64 {
	var rest int64
	for off := int64(0); ; {
		g, ok := p.gapFrom(w, off, 1<<62, 1<<62)
		if !ok {
			return rest
		}
		rest += g.End - g.Start
		off = g.End
	}
}
