package plan

import "time"

// MinHedge is the least HedgeAfter: a healthy chunk connection brings bytes
// every few milliseconds, or each round trip in slow start.
const MinHedge = 300 * time.Millisecond

// HedgeAfter is how long a chunk in flight may bring nothing before its
// rest is asked for again, on a source where a chunk on a new connection
// brings its first byte first after it is asked for at least (the
// connection's set-up and a round trip; 0: unknown), and whose connections
// are abandoned after stall of silence: a few times first, at least
// MinHedge, but less than the stall timeout.
func HedgeAfter(first, stall time.Duration) time.Duration {
	return min(max(MinHedge, 3*first), stall/2)
}

// hedge claims again the rest of a chunk in flight that has brought nothing
// for after (no byte written, none read from its connection, none waiting
// unread in the socket): one holding an offset in wanted, where clients
// wait, or, with wanted nil, once nothing else is left to claim, any.
//
// The socket is looked at because a reader starved of CPU (a busy node)
// looks silent too, and asking again would only fetch its bytes twice. Its
// connection may have gone silent (a carrier that stalls sessions), which
// stall_timeout would tell only seconds later, with the blob's end, its
// commit and the client's last bytes waiting on it. Whichever brings the
// bytes first writes them (the writer takes each byte once), and the other
// request ends as soon as it finds the bytes it would write next already
// written (see Overtaken). Bytes the silent request received but still
// holds for a larger write are asked for again.
func (p *Planner) hedge(now time.Time, w Written, wanted []int64, src Source) (Chunk, bool) {
	after := src.HedgeAfter
	for i := range p.inflight {
		s := &p.inflight[i]
		if s.hedged || wanted != nil && !s.holdsAny(wanted) {
			continue
		}
		missing, _ := w.Missing(s.start)
		switch {
		case missing >= s.end:
			continue // all in, its answer ending
		case missing != s.seen:
			s.seen, s.seenAt = missing, now
			continue
		case s.wire != nil && s.wire.Received() != s.read:
			s.read, s.seenAt = s.wire.Received(), now // read, not written yet
			continue
		case now.Sub(s.seenAt) < after:
			continue
		case s.wire != nil && s.wire.Pending() > 0:
			// The path delivered bytes its reader, starved of CPU, has
			// not taken: asking again would only fetch them twice.
			s.seenAt = now
			continue
		}
		s.hedged = true
		ch := p.track(Chunk{Start: missing, End: s.end}, src, now)
		ch.Hedge, ch.OfSource = true, s.source
		return ch, true
	}
	return Chunk{}, false
}

// holdsAny reports whether s holds one of offs.
func (s *flight) holdsAny(offs []int64) bool {
	for _, off := range offs {
		if s.start <= off && off < s.end {
			return true
		}
	}
	return false
}
