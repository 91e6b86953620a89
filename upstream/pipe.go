package upstream

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/pullproxy/pullproxy/upstream/plan"
)

// pipe holds the chunk connections to one endpoint: how many may be in
// flight at once (the limit), and which blob's worker gets the next one.
//
// The limit adapts to the path. Over a long, fat path each chunk spends
// round trips in set-up and slow start, so filling the bandwidth-delay
// product takes many connections at once; over a short one a few do. While
// demand reaches the limit, the goodput of the endpoint's chunks is measured
// over windows of a chunk lifetime and a half: the limit doubles, and goes
// on doubling while goodput grows in proportion (by a quarter when it grows
// less); once a step brings no more goodput it is taken back and the limit
// holds, minGrowthHold the first time and twice as long each time in a row
// after, up to growthHold, then tries again: a path that has room again (a
// cap lifted, or cuts that took the limit down are over) is filled within
// seconds, and a full one is probed seldom. A path found full
// (or a limit at its ceiling) is then trimmed: a quarter fewer connections
// each window while the goodput stays within trimKeep of the full path's,
// down to minTrimmed, the last step taken back once it does not; not on a
// path that cut or stalled a session in the last staleRate, nor on a long
// path (see shortLocked). A short path goes to minTrimmed at once, at its
// first measurement, judged as trimming is, and a long one starts at the
// ceiling. Each connection costs CPU at
// both ends, and a short path stays full with a few. A regular chunk cut
// (the path cutting below the budget) takes one connection off, one that
// stalls a quarter (not below minStalled), 429 and 503 (the upstream
// asking for less) a half, the last two with a pause in growth. A stall, a
// probe's too, first takes a
// trimmed limit back to where trimming started (see failed); a probe
// chunk's cut leaves the limit alone: finding where the path cuts is what
// it is for. The limit stays within [minConnections, MaxConnections].
//
// A free connection slot goes to a waiting blob that holds none, else to
// the one with the fewest bytes left (first come first served among
// equals): one blob alone can use the whole pipe; of several, each keeps a
// connection and the one nearest its end gets the rest. So blobs complete
// one after another, where sharing evenly has blobs of near sizes complete
// together: a client commits each (containerd syncs it to disk) while the
// others still arrive, rather than queueing those commits after the last
// byte, and a node's small blobs are never held behind another's large
// one. Within a blob, the chunk a client waits for is claimed first (see
// plan.Planner.Claim).
//
// Background sources (a sync's fetches, see Priority) come after every
// foreground one in that order, and together hold at most share of the
// limit (at least one slot): a blob a client waits for waits behind them
// only for the slots they already hold. A source promoted mid-fetch is
// foreground from then on. A background waiter held back by that cap
// counts as demand reaching the limit, so that the limit still grows (and
// is still trimmed) while only background work runs: the cap is a fixed
// share of the limit, so the slots in use move with it, and a step's
// goodput is judged as it is for foreground work. Goodput per connection
// is measured over the slots the window actually had in flight at most,
// not the limit, which background work alone never fills.
type pipe struct {
	log     *slog.Logger
	max     int
	share   float64 // of the limit, background sources may hold at once (see backgroundCapLocked)
	newLane func() *lane
	// roundTrip is the path's round trip as its data shows it: the least
	// time from a request's sending to its answer's first byte, lately
	// (see chunkDialer.roundTrip); nil or 0: unknown. Not the connect's:
	// a middlebox that answers TCP itself makes a long path's look short.
	roundTrip func() time.Duration
	limitG    prometheus.Gauge
	flightG   prometheus.Gauge
	received  atomic.Int64 // chunk bytes received from the endpoint, ever

	mu       sync.Mutex
	limit    int
	inflight int
	held     map[*source]int
	waiters  []*pipeWaiter
	idle     []*lane // lanes not in use, the last used on top: its connections are the warmest

	// Goodput control.
	winStart   time.Time
	winBytes   int64 // received at winStart
	winPeak    int   // the most slots in flight at once in the window
	saturated  bool  // demand reached the limit, or the background cap, in this window
	chunkTime  time.Duration
	lastRate   float64 // goodput of the last saturated window, bytes/s
	lastAt     time.Time
	connRate   float64 // lastRate's share per connection slot in flight, as the window had them at most
	stepped    bool    // the limit grew at the end of the last window, from stepFrom
	stepOpen   bool    // with stepped: a long path, whose window after the step had the new connections opening
	shrank     bool    // the limit shrank, from stepFrom, and is to be judged
	settled    bool    // with shrank: a window has passed since, the next is judged
	stepFrom   int
	trimming   bool          // the path was found full: fewer connections are tried while it stays full
	fullRate   float64       // with trimming: the goodput of the full path, which fewer connections must keep
	failedAt   time.Time     // the last cut, stall or 429/503: no trimming for staleRate after
	judged     bool          // the path's start was judged by its round trip (see acquire)
	shortTried bool          // the limit went straight to minTrimmed once
	untrimmed  int           // the limit before trimming took it lower; 0: not trimmed
	holdUntil  time.Time     // no growth before
	holdFor    time.Duration // the last hold after a step that brought nothing (see backOffLocked); 0: none since one paid off
	rampStart  time.Time     // the first saturated window after none for staleRate
}

type pipeWaiter struct {
	owner   *source
	ready   chan struct{}
	granted bool
	lane    *lane // with granted
}

// judgeStart sets the limit by the path's round trip, as before the
// endpoint's first chunk (see acquire), for an endpoint whose round trip
// was not known then: one asked for blobs only, whose first chunk went
// alone (see source.scout).
func (p *pipe) judgeStart() {
	p.mu.Lock()
	logged := p.judgeStartLocked()
	p.mu.Unlock()
	logged()
}

// judgeStartLocked judges the path's start once, when its round trip is
// known: a short path starts low, a long one at the ceiling. It returns
// what logs the change, to be called without the lock.
func (p *pipe) judgeStartLocked() func() {
	from := p.limit
	if p.judged || p.pathRoundTrip() == 0 {
		return func() {}
	}
	p.judged = true
	why := ""
	switch {
	case p.startShortLocked():
		why = "a short path: starting with fewer connections"
	case p.startLongLocked():
		why = "a long path: starting with more connections"
	default:
		return func() {}
	}
	to, rt := p.limit, p.pathRoundTrip()
	return func() {
		p.log.Debug("chunk connection limit changed", "from", from, "to", to, "why", why, "round_trip", rt)
	}
}

const (
	// initialConnections is where an endpoint's limit starts: enough for a
	// cold pull across a 40 ms path to start near full speed. A path known
	// to be short starts lower, one known to be long at the ceiling (see
	// startShortLocked, startLongLocked).
	initialConnections = 32
	// minConnections is the least the limit shrinks to.
	minConnections = 2
	// minTrimmed is the least trimming takes the limit to, and where a
	// short path's limit goes at its first measurement. Each connection
	// more on a blob is bytes written ahead of the hashed prefix, read
	// back to be hashed, and more chunks in flight that a client reading in
	// order receives only at the end; a short path stays full with a few.
	// Fewer than this leave gaps while a connection is replaced that the
	// others do not fill. Trimming stops anyway where goodput falls
	// (trimKeep).
	minTrimmed = 4
	// minStalled is the least stalls take the limit to. Stalled
	// connections hold their slots until stall_timeout, and a budget just
	// grown past a stalling carrier's cut-off has many stall at once:
	// without a floor, a burst of stalls would leave one or two connections
	// to carry the pull for seconds.
	minStalled = initialConnections / 2
	// minGrowthHold and growthHold bound how long the limit holds once
	// goodput stopped rising with it, before trying again (see
	// backOffLocked); rampHold, when that was within rampTime of the first
	// evidence (see tickLocked).
	minGrowthHold      = 2 * time.Second
	growthHold         = 30 * time.Second
	rampTime, rampHold = 3 * time.Second, time.Second
	// minWindow and maxWindow bound the goodput measurement window, which
	// is otherwise a chunk lifetime and a half.
	minWindow, maxWindow = 200 * time.Millisecond, 5 * time.Second
	// staleRate: a goodput older than this says nothing about the path now.
	staleRate = time.Minute
	// trimKeep: fewer connections are kept while the goodput stays above
	// this share of what more connections had.
	trimKeep = 0.97
	// shortPath: a path whose requests are answered in less (a round trip
	// and the server's answer) is short: it is trimmed, and it starts low.
	shortPath = 10 * time.Millisecond
	// longPath: a path whose requests take this long at least starts at
	// the ceiling.
	longPath = 50 * time.Millisecond
)

// newPipe returns the pipe of an endpoint with at most maxConns chunk
// connections at once, of which background sources hold at most share
// (in (0, 1]).
func newPipe(maxConns int, share float64, newLane func() *lane, log *slog.Logger, limitG, flightG prometheus.Gauge) *pipe {
	p := &pipe{log: log, max: maxConns, share: share, newLane: newLane, limitG: limitG, flightG: flightG, held: map[*source]int{},
		limit: min(initialConnections, maxConns)}
	limitG.Set(float64(p.limit))
	return p
}

// acquire waits for a connection slot for owner, and returns its lane. It
// returns errFinished, without a lane, once owner's blob is complete.
func (p *pipe) acquire(ctx context.Context, owner *source) (*lane, error) {
	p.mu.Lock()
	if p.winStart.IsZero() {
		defer p.judgeStartLocked()() // logged on the way out, the lock released
	}
	if p.inflight < p.limit && len(p.waiters) > 0 {
		p.wakeLocked() // a waiter promoted since the last wake goes first
	}
	if p.inflight < p.limit && p.grantableLocked(owner) {
		l := p.grantLocked(owner)
		p.mu.Unlock()
		return l, nil
	}
	p.saturated = true // the limit, or the background cap, holds demand back (see pipe)
	w := &pipeWaiter{owner: owner, ready: make(chan struct{})}
	p.waiters = append(p.waiters, w)
	p.mu.Unlock()
	promoted := owner.prio.promotedChan()
	err := errFinished
wait:
	for {
		select {
		case <-w.ready:
			return w.lane, nil
		case <-promoted:
			// No longer capped: a slot the cap held back may be free.
			promoted = nil
			p.mu.Lock()
			p.wakeLocked()
			p.mu.Unlock()
		case <-owner.finished:
			break wait
		case <-ctx.Done():
			err = ctx.Err()
			break wait
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if w.granted {
		p.releaseLocked(owner, w.lane)
		return nil, err
	}
	for i, x := range p.waiters {
		if x == w {
			p.waiters = append(p.waiters[:i], p.waiters[i+1:]...)
			break
		}
	}
	return nil, err
}

// grantableLocked reports whether owner may take a free slot at once,
// ahead of the waiters: a foreground owner may, for the waiters left with
// a slot free are background ones the cap holds (see wakeLocked); a
// background one while background sources hold fewer than the cap.
func (p *pipe) grantableLocked(owner *source) bool {
	return !owner.prio.Background() || p.backgroundHeldLocked() < p.backgroundCapLocked()
}

// backgroundCapLocked is how many slots background sources may hold at
// once: share of the limit, at least one.
func (p *pipe) backgroundCapLocked() int {
	return max(1, int(p.share*float64(p.limit)))
}

// backgroundHeldLocked counts the slots background sources hold. Counted
// rather than kept: a source promoted mid-fetch leaves the count without
// telling the pipe. There are as many owners as blobs being fetched.
func (p *pipe) backgroundHeldLocked() int {
	n := 0
	for owner, k := range p.held {
		if owner.prio.Background() {
			n += k
		}
	}
	return n
}

// roomLocked is how many more slots owner could take now: those free,
// within the background cap for a background owner.
func (p *pipe) roomLocked(owner *source) int {
	n := max(p.limit-p.inflight, 0)
	if owner.prio.Background() {
		n = min(n, max(p.backgroundCapLocked()-p.backgroundHeldLocked(), 0))
	}
	return n
}

func (p *pipe) grantLocked(owner *source) *lane {
	if p.winStart.IsZero() { // the first window starts with the first connection
		p.winStart, p.winBytes = time.Now(), p.received.Load()
	}
	p.inflight++
	p.winPeak = max(p.winPeak, p.inflight)
	p.held[owner]++
	p.flightG.Set(float64(p.inflight))
	if p.inflight >= p.limit {
		p.saturated = true
	}
	if n := len(p.idle); n > 0 {
		l := p.idle[n-1]
		p.idle = p.idle[:n-1]
		return l
	}
	return p.newLane()
}

// release returns owner's slot and its lane; took is how long the chunk
// held it (0: it fetched nothing).
func (p *pipe) release(owner *source, l *lane, took time.Duration) {
	now := time.Now()
	p.mu.Lock()
	if took > 0 {
		if p.chunkTime == 0 {
			p.chunkTime = took
		} else {
			p.chunkTime = (7*p.chunkTime + took) / 8
		}
	}
	p.releaseLocked(owner, l)
	from := p.limit
	why, rate := p.tickLocked(now)
	to := p.limit
	parked := p.takeParkedProbesLocked()
	p.mu.Unlock()
	for _, l := range parked {
		l.close()
	}
	if to != from {
		p.log.Debug("chunk connection limit changed", "from", from, "to", to, "why", why, "goodput_mbps", rate/1e6)
	}
}

func (p *pipe) releaseLocked(owner *source, l *lane) {
	p.inflight--
	if p.held[owner]--; p.held[owner] <= 0 {
		delete(p.held, owner)
	}
	p.idle = append(p.idle, l)
	p.flightG.Set(float64(p.inflight))
	p.wakeLocked()
}

// takeParkedProbesLocked takes off the idle stack the lanes that the limit
// leaves unused (it shrank: they sit at the bottom) and that hold a probe's
// connection. Such a probe settles only when its connection is used again
// or closed: until then it holds the budget's growth, which waits for every
// probe in flight. The caller closes the lanes, which settles their probes
// as failed.
func (p *pipe) takeParkedProbesLocked() (parked []*lane) {
	surplus := p.inflight + len(p.idle) - p.limit
	for i := 0; i < surplus && i < len(p.idle); {
		if !p.idle[i].probing() {
			i++
			continue
		}
		parked = append(parked, p.idle[i])
		p.idle = slices.Delete(p.idle, i, i+1)
		surplus--
	}
	return parked
}

// wakeLocked grants free slots to waiters, in the order of beforeLocked,
// background ones within the cap.
func (p *pipe) wakeLocked() {
	bgHeld := -1 // counted once a background waiter is next
	for p.inflight < p.limit && len(p.waiters) > 0 {
		best := 0
		for i, w := range p.waiters {
			if p.beforeLocked(w.owner, p.waiters[best].owner) {
				best = i
			}
		}
		w := p.waiters[best]
		if w.owner.prio.Background() {
			if bgHeld < 0 {
				bgHeld = p.backgroundHeldLocked()
			}
			if bgHeld >= p.backgroundCapLocked() {
				return // background waiters come last: every one left is held by the cap
			}
			bgHeld++
		}
		p.waiters = append(p.waiters[:best], p.waiters[best+1:]...)
		w.granted = true
		w.lane = p.grantLocked(w.owner)
		close(w.ready)
	}
}

// beforeLocked reports whether a free slot goes to a's waiter before b's:
// foreground before background, then a blob holding none, then the blob
// with the fewest bytes left, then the one holding fewer.
func (p *pipe) beforeLocked(a, b *source) bool {
	if a == b {
		return false
	}
	if ba, bb := a.prio.Background(), b.prio.Background(); ba != bb {
		return bb
	}
	ha, hb := p.held[a], p.held[b]
	if (ha == 0) != (hb == 0) {
		return ha == 0
	}
	if la, lb := a.left(), b.left(); la != lb {
		return la < lb
	}
	return ha < hb
}

// tickLocked closes the measurement window once it is long enough, and
// grows the limit while goodput rises with it. It says why the limit
// changed, if it did, and the window's goodput.
func (p *pipe) tickLocked(now time.Time) (why string, rate float64) {
	if p.winStart.IsZero() {
		p.winStart, p.winBytes, p.winPeak = now, p.received.Load(), p.inflight
		return "", 0
	}
	elapsed := now.Sub(p.winStart)
	if elapsed < p.windowLocked() {
		return "", 0
	}
	bytes := p.received.Load()
	rate = float64(bytes-p.winBytes) / elapsed.Seconds()
	saturated, peak := p.saturated, p.winPeak
	p.winStart, p.winBytes, p.saturated, p.winPeak = now, bytes, p.inflight >= p.limit || len(p.waiters) > 0, p.inflight
	if !saturated {
		return "", rate // demand set the goodput, not the limit: no evidence
	}
	if now.Sub(p.lastAt) > staleRate {
		p.lastRate = 0
	}
	if p.lastRate == 0 {
		p.rampStart = now // the first evidence in a while: demand is still ramping up
	}
	prevRate, grew, shrank := p.lastRate, p.stepped, p.shrank
	p.lastRate, p.lastAt, p.stepped, p.shrank = rate, now, false, false
	// Per slot in flight: the limit, where foreground demand filled it;
	// fewer, where only background work ran, held to its cap.
	p.connRate = rate / float64(max(min(peak, p.limit), 1))
	switch {
	case grew && p.stepOpen:
		// On a long path the step's connections spent the window after it
		// opening and in slow start: judge the step by the next, against
		// the goodput before it. Judged at once, a step that would have
		// paid off is taken back, and the limit held low for the rest of
		// the pull.
		p.stepped, p.stepOpen, p.lastRate = true, false, prevRate
		return "", rate
	case grew && prevRate > 0 && rate < prevRate*1.1:
		// The last step brought nothing: the path is full. Take it back
		// (fewer sessions for the same goodput), hold, and see whether
		// fewer still keep it full.
		p.setLimitLocked(p.stepFrom)
		p.backOffLocked(now)
		if now.Sub(p.rampStart) < rampTime {
			// Early in a pull a window's goodput says as much about the
			// client's requests still arriving and the first handshakes
			// as about the path: a step that brought nothing yet may
			// still be needed, and holding for growthHold would keep the
			// limit low for the whole pull. Tried again soon instead.
			p.holdUntil = now.Add(rampHold)
		}
		p.startTrimLocked()
		return "goodput did not rise: the path is full", rate
	case (p.trimming && p.fullRate == 0 || shrank) && !p.settled:
		// The first window after a change still has the connections above
		// the new limit draining: judge the next.
		p.shrank, p.settled = shrank, true
		return "", rate
	case p.trimming && p.fullRate == 0:
		// The full path's goodput, settled: what fewer must keep.
		p.fullRate = rate
		p.trimLocked()
		return "the path is full: trying fewer connections", rate
	case shrank && rate < p.fullRate*trimKeep:
		// Too few now: back to the last limit that kept the path full.
		p.setLimitLocked(p.stepFrom)
		p.trimming = false
		p.backOffLocked(now)
		return "goodput fell with fewer connections", rate
	case p.trimming && p.limit > minTrimmed:
		// Goodput judged by the best window seen at more connections
		// (the first, on a short path, may have been one still filling).
		p.fullRate = max(p.fullRate, rate)
		p.trimLocked()
		return "the path stays full: trying fewer connections", rate
	case now.Before(p.holdUntil):
		return "", rate
	case p.limit >= p.max && !p.trimming:
		// As many as allowed, and no telling whether the path is full:
		// whether fewer keep its goodput is worth a few windows.
		p.startTrimLocked()
		return "", rate
	case !grew || prevRate == 0:
		if p.shortFirstLocked(now) {
			// The first evidence, on a short path: a few connections keep
			// it full, and a blob's chunks in flight are what a client
			// reading in order waits behind (at 64 connections, tens of
			// MiB it gets at once at the end). Straight to minTrimmed,
			// judged against this window's goodput as trimming is.
			p.trimming, p.fullRate, p.untrimmed = true, rate, p.limit
			p.stepFrom, p.shrank, p.settled = p.limit, true, false
			p.setLimitLocked(minTrimmed)
			return "a short path: trying fewer connections", rate
		}
		// Nothing to compare with: a step, judged next window, and taken
		// back if it brought nothing. A bold one: filling a long path
		// quickly matters more than a window with too many connections.
		p.growLocked(p.limit)
		return "probing for more goodput", rate
	default:
		// Goodput rose with the last step: grow again, doubling while it
		// rises nearly in proportion.
		step := max(1, p.limit/4)
		if rate/prevRate >= 0.75*float64(p.limit)/float64(p.stepFrom) {
			step = p.limit
		}
		p.holdFor = 0
		p.growLocked(step)
		return "goodput rose with the limit", rate
	}
}

// startShortLocked takes the limit straight to minTrimmed before the
// endpoint's first chunk when the path is already known to be short: the
// metadata client's requests, for the manifests, timed it (see
// firstByteClock). It reports whether it did. The growth that follows takes
// the limit up again if the path wants more. Starting at initialConnections
// on a short path instead, a cold pull would open tens of connections at
// once, each a TLS handshake at both ends, and leave the path idle while
// they go through.
func (p *pipe) startShortLocked() bool {
	if p.shortTried || p.limit <= minTrimmed || !p.shortLocked() {
		return false
	}
	p.shortTried = true
	// Trimmed before the first chunk: a stall takes it back (see failed),
	// as it does a limit trimmed later.
	p.untrimmed, p.limit = p.limit, minTrimmed
	p.limitG.Set(float64(p.limit))
	return true
}

// startLongLocked takes the limit to the ceiling before the endpoint's
// first chunk when the path is already known to be long: its requests
// take longPath or more to be answered (see startShortLocked). It reports
// whether it did. Across such a path each connection spends its first round trips
// opening and in slow start, so initialConnections of them fill only a
// part of it, and growing to the ceiling a window at a time would take
// seconds of the pull.
func (p *pipe) startLongLocked() bool {
	if p.limit >= p.max || p.pathRoundTrip() < longPath {
		return false
	}
	p.limit = p.max
	p.limitG.Set(float64(p.limit))
	return true
}

// shortFirstLocked reports whether the limit goes straight to minTrimmed:
// once per pipe, on a short path with no recent failure, from above it.
func (p *pipe) shortFirstLocked(now time.Time) bool {
	if p.shortTried || p.limit <= minTrimmed || now.Sub(p.failedAt) < staleRate || !p.shortLocked() {
		return false
	}
	p.shortTried = true
	return true
}

// startTrimLocked starts trimming: the next settled window measures the
// full path's goodput, then the limit steps down.
func (p *pipe) startTrimLocked() {
	if time.Since(p.failedAt) < staleRate || !p.shortLocked() || p.limit <= minTrimmed {
		return
	}
	p.trimming, p.fullRate, p.settled, p.shrank = true, 0, false, false
}

// shortLocked reports whether the path is short: its requests are answered
// within shortPath. Only a short path is trimmed. On a long one connections are
// what covers the bandwidth-delay product, a window holds few chunk
// lifetimes to judge a step by, and a step down that was wrong costs
// seconds of goodput to find out and undo.
func (p *pipe) shortLocked() bool {
	d := p.pathRoundTrip()
	return d > 0 && d < shortPath
}

// pathRoundTrip returns the path's round trip (see roundTrip), 0 when
// unknown.
func (p *pipe) pathRoundTrip() time.Duration {
	if p.roundTrip == nil {
		return 0
	}
	return p.roundTrip()
}

// trimLocked takes a quarter of the connections off, to be judged after a
// settling window. Each connection costs CPU at both ends (set-up,
// wake-ups, small reads), and a short path stays full with a few.
func (p *pipe) trimLocked() {
	if p.untrimmed == 0 {
		p.untrimmed = p.limit
	}
	p.stepFrom, p.shrank, p.settled = p.limit, true, false
	p.setLimitLocked(max(min(p.limit-1, p.limit*3/4), minTrimmed))
}

func (p *pipe) growLocked(step int) {
	p.stepFrom, p.stepped, p.stepOpen = p.limit, true, !p.shortLocked()
	p.setLimitLocked(p.limit + step)
}

func (p *pipe) setLimitLocked(n int) {
	p.limit = min(max(n, minConnections), p.max)
	if p.limit >= p.untrimmed {
		p.untrimmed = 0
	}
	p.limitG.Set(float64(p.limit))
	p.wakeLocked()
}

// Failure kinds that shrink the limit.
const (
	pipeCut        = iota // a session died part-way
	pipeStall             // a session went silent
	pipeBusy              // the upstream answered 429 or 503
	pipeProbeStall        // a probe of a larger budget went silent
)

var failureNames = [...]string{pipeCut: "a chunk was cut below the budget", pipeStall: "a connection stalled",
	pipeBusy: "the upstream answered 429 or 503", pipeProbeStall: "a probe connection stalled"}

// failed shrinks the limit after a failure of one of its connections.
//
// A stall first undoes trimming: a stalled connection holds its slot for
// stall_timeout, which a few connections feel most, as a larger share of
// them is held. That goes for a probe's
// stall too, which otherwise leaves the limit alone: finding where the path
// cuts is what a probe is for.
func (p *pipe) failed(kind int) {
	now := time.Now()
	p.mu.Lock()
	from := p.limit
	defer func() {
		to := p.limit
		p.mu.Unlock()
		if to != from {
			p.log.Debug("chunk connection limit changed after a failure", "from", from, "to", to, "why", failureNames[kind])
		}
	}()
	p.stepped, p.shrank = false, false
	// A path that cuts or stalls sessions is not trimmed: its connections
	// are short whatever the limit, so fewer at once save little, and its
	// goodput is too uneven to judge a step by.
	p.trimming, p.failedAt = false, now
	switch kind {
	case pipeCut:
		p.setLimitLocked(p.limit - 1)
	case pipeStall, pipeProbeStall:
		switch {
		case p.untrimmed > p.limit:
			p.setLimitLocked(p.untrimmed)
		case kind == pipeStall && p.limit > minStalled:
			p.setLimitLocked(max(p.limit*3/4, minStalled))
		}
		p.holdLocked(now.Add(p.windowLocked()))
	case pipeBusy:
		p.setLimitLocked(p.limit / 2)
		p.holdLocked(now.Add(growthHold))
	}
}

// windowLocked is how long goodput is measured over: a chunk lifetime and
// a half, so that connections added at its start count.
func (p *pipe) windowLocked() time.Duration {
	return min(max(3*p.chunkTime/2, minWindow), maxWindow)
}

// backOffLocked holds growth after a step that brought nothing:
// minGrowthHold the first time, twice as long each time in a row after, up
// to growthHold. One window's goodput is noisy (cuts, a busy host, a cap
// that lifts): a single long hold on its word would keep the limit low for
// the rest of a pull whose path has room.
func (p *pipe) backOffLocked(now time.Time) {
	p.holdFor = min(max(2*p.holdFor, minGrowthHold), growthHold)
	p.holdUntil = now.Add(p.holdFor)
}

func (p *pipe) holdLocked(until time.Time) {
	if until.After(p.holdUntil) {
		p.holdUntil = until
	}
}

// add counts chunk bytes received.
func (p *pipe) add(n int) { p.received.Add(int64(n)) }

// free returns how many more connections the pipe lets owner have now.
func (p *pipe) free(owner *source) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.roomLocked(owner)
}

// pace returns the goodput one of the endpoint's connections brings, as the
// last saturated window measured it (0: unknown, or stale), and how many
// connection slots owner holds or could take at once.
func (p *pipe) pace(owner *source) (float64, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	rate := p.connRate
	if time.Since(p.lastAt) > staleRate {
		rate = 0
	}
	return rate, p.held[owner] + p.roomLocked(owner)
}

// chunkTarget returns the size of a chunk on a connection whose budget
// holds more. On a short path (see shortLocked) it is what one connection
// brings in chunkPace at the pace of the last saturated window, within
// [minChunkTarget, maxChunkTarget]; elsewhere, and while that pace is
// unknown or stale, minChunkTarget (see plan.Target). A chunk is a
// request: a short path's few connections each carry tens of MB/s, and
// small chunks there mean many requests, answers and wake-ups a second. A
// long path's many connections each carry little, and a client reading in
// order waits behind the chunks in flight: larger ones there lengthen the
// end of a pull.
func (p *pipe) chunkTarget(now time.Time) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if now.Sub(p.lastAt) > staleRate || !p.shortLocked() {
		return plan.Target(0)
	}
	return plan.Target(p.connRate)
}

// current returns the limit.
func (p *pipe) current() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.limit
}
