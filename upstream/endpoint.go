package upstream

import (
	"log/slog"
	"net/url"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// endpoint is one URL serving an upstream, and what has been learned about
// the network path to it.
type endpoint struct {
	url    *url.URL
	host   string // label for logs and metrics
	key    dialKey
	region string // for regional registries (ECR), else ""
	// failoverOnly: asked for blobs only once the endpoints sharing the
	// upstream's content failed (see FetchBlob).
	failoverOnly bool
	budget       *budget
	pipe         *pipe
	chunks       *prometheus.CounterVec // chunks by result, curried with upstream and endpoint
	bytes        prometheus.Counter     // blob bytes received from it
	// discarded and abandoned count the bytes it sent, or may have sent,
	// that no blob kept (see waste).
	discarded, abandoned prometheus.Counter
	up                   prometheus.Gauge
	health               health
}

// markFailed leaves the endpoint aside for a while after it failed for good.
func (ep *endpoint) markFailed(r *Registry, err error) {
	d := ep.health.failed(time.Now(), err)
	ep.up.Set(0)
	r.log.Warn("endpoint left aside: others are tried first until it is probed again",
		"endpoint", ep.name(), "for", d, "err", err)
}

func (ep *endpoint) markUp() {
	ep.health.succeeded()
	ep.up.Set(1)
}

// name is how errors name the endpoint: by region where it has one, as ECR's
// own messages do ("no basic auth credentials for us-east-1").
func (ep *endpoint) name() string {
	if ep.region != "" {
		return ep.region + " (" + ep.host + ")"
	}
	return ep.host
}

// budget is the byte budget of one connection to an endpoint: how much a TCP
// session may carry before it is closed and replaced. A degraded carrier
// kills sessions after a byte count, so the connection, not the request, is
// the unit to control.
//
// An adaptive budget grows by probing: a new connection is allowed more
// than the budget, and after growAfter such probes in a row carry it
// cleanly, the larger budget is adopted. Once a session was cut recently,
// probes try twice the budget, one at a time: that bounds what finding the
// edge costs (on a path that stalls sessions, one stalled connection rather
// than a wave). On a path with no recent cut, a quarter of the connections
// probe at once, or half of few (see next), no more than the wins still
// needed, cleanGrowth times the budget, so that the budget grows in few
// connection lifetimes. A size is
// adopted only once every probe in flight has settled: a probe that stalls
// is a failure known late, and holds the others' wins until it is. A
// probe's connection carries
// ordinary chunks (see lane): the budget bounds sessions, not chunks, so a
// larger one changes how often a connection is opened, never the order in
// which a blob arrives.
//
// Once the budget has grown and while no session is cut, a connection that
// used its allowance is renewed rather than replaced (see renewal): it
// carries on, a budget's worth at a time, up to max_connection_budget.
//
// Sessions that die part-way are cut points, and the carrier's cut-off is
// estimated from the recent ones as the (cutOutliers+1)-th smallest, so that
// a stray early reset does not move it. What a reader counts is only a lower
// bound of where a session was cut: a reset discards what the reader had not
// read yet, so a reader that lags (a busy CPU, a slow disk) sees the cut
// early. Probes grow the budget up to 3/4 of the estimate (of the smallest
// cut point, while there are few). The budget drops,
// to 3/4 of the estimate from regular chunks, only once more than
// cutOutliers regular chunks died below it: a probe above a budget that
// works never drags it down, and a chunk size that keeps completing is never
// given up for one odd event.
type budget struct {
	cfg   FetchConfig
	log   *slog.Logger
	gauge prometheus.Gauge
	cuts  *prometheus.CounterVec // by kind

	mu        sync.Mutex
	current   int64
	points    [cutSamples]cutPoint // ring of recent cut points
	nextPoint int
	probing   int   // probe chunks in flight
	probeSize int64 // the size they probe
	probeWins int   // probes of probeSize completed in a row
}

type cutPoint struct {
	at    time.Time // zero: an empty slot
	n     int64
	probe bool
}

const (
	// growAfter probes completed in a row at twice the budget adopt it.
	growAfter = 8
	// cleanGrowth is the factor a probe tries on a path with no recent cut.
	// A probe takes as long as its size to win, and a pipe of many
	// connections gives each a small share: doubling would grow the budget
	// so slowly across a long clean path that its sessions spent their
	// lives in slow start. On a path that does cut, a
	// probe this large is cut about as surely as one twice the budget, and
	// the first cut sets the edge that later probes stay under.
	cleanGrowth = 4
	// cutMemory is how long a cut point counts.
	cutMemory = 10 * time.Minute
	// cutSamples is how many recent cut points are kept.
	cutSamples = 32
	// cutOutliers is how many cut points below the carrier's real cut-off
	// the estimate tolerates.
	cutOutliers = 2
	// cutMargin: the budget stays at this fraction of the estimated cut-off.
	cutMarginNum, cutMarginDen = 3, 4
)

func newBudget(cfg FetchConfig, log *slog.Logger, gauge prometheus.Gauge, cuts *prometheus.CounterVec) *budget {
	b := &budget{cfg: cfg, log: log, gauge: gauge, cuts: cuts, current: cfg.ConnectionBudget}
	gauge.Set(float64(b.current))
	return b
}

// get returns the current budget.
func (b *budget) get() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.current
}

// next returns the allowance of a new connection: the budget, or more
// (see growthLocked) when the connection is to be a probe. conns is how
// many connections the endpoint's pipe lets through at once: at most a
// quarter of them probe, as a probe that stalls holds its slot for
// stall_timeout; of fewer than 16, half, up to half of growAfter. A short
// path's pipe holds a few connections, and a quarter of them, one probe at
// a time, would grow the budget slowly, each short session meanwhile a
// connection opened and a handshake paid; half grows it sooner at little
// risk, as a stalling path holds few probes anyway.
func (b *budget) next(now time.Time, conns int) (size int64, probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	edge, _ := b.edgeLocked(now, false)
	most := 1
	if edge == 0 { // no recent cut
		most = max(1, conns/4, min(conns/2, growAfter/2))
	}
	if b.probing >= most || b.probing+b.probeWins >= growAfter {
		// Enough in flight to win, or enough won: waiting for the rest to
		// settle. More would only hold the adoption, which waits for every
		// probe in flight: more probes at once grow the budget later, not
		// sooner.
		return b.current, false
	}
	if g := b.growthLocked(edge); g > b.current {
		b.probing++
		b.probeSize = g
		return g, true
	}
	return b.current, false
}

// growthLocked is the size a probe would try, given the estimated cut-off
// (0: none): cleanGrowth times the budget with no cut-off, else twice it,
// up to 3/4 of the cut-off; or the current budget when it may not grow.
func (b *budget) growthLocked(edge int64) int64 {
	if b.cfg.MaxConnectionBudget <= b.cfg.ConnectionBudget {
		return b.current // fixed
	}
	limit := b.cfg.MaxConnectionBudget
	if edge > 0 {
		limit = min(limit, edge*cutMarginNum/cutMarginDen)
		return min(b.current*2, limit)
	}
	return min(b.current*cleanGrowth, limit)
}

// edgeLocked estimates where the path cuts sessions from the recent cut
// points (of regular chunks only, with regular): the (cutOutliers+1)-th
// smallest, or the largest when there are fewer. For growth (regular
// false) the smallest stands while there are few points, up to
// 2(cutOutliers+1): the third smallest of four draws of the incident's
// 1.3-3.1 MB is near 2.2 MB, 3/4 of which is past the carrier's least cut,
// and a budget adopted there had every connection stall at once on a
// carrier that stalls sessions. It returns 0 when no cut is recent, and how
// many recent cut points of regular chunks lie below the current budget.
func (b *budget) edgeLocked(now time.Time, regular bool) (edge int64, below int) {
	var recent [cutSamples]int64
	n := 0
	for _, p := range b.points {
		if p.at.IsZero() || now.Sub(p.at) >= cutMemory || (regular && p.probe) {
			continue
		}
		recent[n] = p.n
		n++
		if !p.probe && p.n < b.current {
			below++
		}
	}
	if n == 0 {
		return 0, 0
	}
	slices.Sort(recent[:n])
	if !regular && n <= 2*(cutOutliers+1) {
		return recent[0], below
	}
	return recent[min(n, cutOutliers+1)-1], below
}

// renewable reports whether a connection that used its allowance cleanly
// is renewed rather than retired (see renewal).
func (b *budget) renewable(now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.renewableLocked(now)
}

// renewableLocked: the budget has grown past where it started (probes
// carried more cleanly, growAfter in a row) and no session was cut for
// cutMemory. The growth is the evidence: on the incident's path, where
// six sessions in ten die after 1.3 MB, the first probes are cut within a
// second and the budget never grows; connections there are closed at the
// budget as ever. A fixed budget is never renewed.
func (b *budget) renewableLocked(now time.Time) bool {
	if b.cfg.MaxConnectionBudget <= b.cfg.ConnectionBudget || b.current <= b.cfg.ConnectionBudget {
		return false
	}
	edge, _ := b.edgeLocked(now, false)
	return edge == 0
}

// renewal returns the allowance of a connection that carried carried bytes
// and used its allowance cleanly, renewed: another budget's worth, up to
// max_connection_budget in all (the most one session ever carries), and
// false when it is to be retired instead (see renewableLocked, and a
// connection at the ceiling).
func (b *budget) renewal(now time.Time, carried int64) (int64, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.renewableLocked(now) {
		return 0, false
	}
	next := min(carried+b.current, b.cfg.MaxConnectionBudget)
	if next-carried < min(minChunk, b.current) {
		return 0, false // at the ceiling: too little left for a chunk
	}
	return next, true
}

// completed records a probe connection that carried size bytes in all
// without a cut, and was retired as its allowance ran out. It returns the
// new budget when it grew, else 0.
func (b *budget) completed(size int64, probe bool) int64 {
	if !probe {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.probing--
	if size > b.current && b.probeSize > b.current {
		b.probeWins++
	}
	return b.adoptLocked()
}

// adoptLocked adopts the probed size once enough probes of it completed in
// a row and none is still in flight: a probe that stalls holds the others'
// wins until it is known to have failed. It returns the new budget, or 0.
func (b *budget) adoptLocked() int64 {
	if b.probing > 0 || b.probeWins < growAfter || b.probeSize <= b.current {
		return 0
	}
	b.probeWins = 0
	b.current = b.probeSize
	b.gauge.Set(float64(b.current))
	b.log.Info("connection budget raised: sessions carry more cleanly", "budget", b.current)
	return b.current
}

// failed records a probe that ended without evidence either way: its
// connection failed before carrying a byte, or was closed idle.
func (b *budget) failed(probe bool) {
	if !probe {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.probing--
	b.adoptLocked()
}

// cut records a session that died after carrying n bytes. It returns the new
// budget when it dropped, else 0.
func (b *budget) cut(n int64, probe bool, kind string, now time.Time) int64 {
	b.cuts.WithLabelValues(kind).Inc()
	b.mu.Lock()
	defer b.mu.Unlock()
	if probe {
		b.probing--
	}
	if n <= 0 {
		return 0 // died before carrying anything: an error, not a byte-count cut
	}
	b.probeWins = 0
	b.points[b.nextPoint] = cutPoint{at: now, n: n, probe: probe}
	b.nextPoint = (b.nextPoint + 1) % cutSamples
	if b.cfg.MaxConnectionBudget <= b.cfg.ConnectionBudget {
		return 0 // fixed
	}
	edge, below := b.edgeLocked(now, true)
	if below <= cutOutliers {
		return 0 // chunks of this size still complete: too little evidence against it
	}
	next := max(edge*cutMarginNum/cutMarginDen, b.cfg.MinConnectionBudget)
	if next >= b.current {
		return 0
	}
	b.current = next
	b.gauge.Set(float64(next))
	return next
}
