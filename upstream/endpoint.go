package upstream

import (
	"net/url"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// endpoint is one URL serving an upstream, and what has been learned about
// the network path to it.
type endpoint struct {
	url    *url.URL
	host   string // label for logs and metrics
	region string // for regional registries (ECR), else ""
	budget *budget
	chunks *prometheus.CounterVec // chunks by result, curried with upstream and endpoint
	up     prometheus.Gauge
	health health
}

// markFailed leaves the endpoint aside for a while after it failed for good.
func (ep *endpoint) markFailed(r *Registry, err error) {
	d := ep.health.failed(time.Now())
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
// An adaptive budget grows by probing: one chunk at a time asks for twice the
// budget, and after growAfter such probes in a row complete, the larger
// budget is adopted. A session that dies part-way drops the budget below the
// smallest cut seen and caps growth there while cuts are recent. Probing one
// chunk at a time bounds what finding the edge costs: on a path that stalls
// sessions, one stalled chunk rather than a wave of them.
type budget struct {
	cfg   FetchConfig
	gauge prometheus.Gauge
	cuts  *prometheus.CounterVec // by kind

	mu        sync.Mutex
	current   int64
	minCut    int64 // smallest number of bytes a session carried before dying; 0: none seen
	lastCut   time.Time
	probing   bool // a probe chunk is in flight
	probeWins int  // probes completed in a row at the next size
}

const (
	// growAfter probes completed in a row at twice the budget adopt it.
	growAfter = 8
	// cutMemory is how long a cut keeps capping the budget.
	cutMemory = 10 * time.Minute
	// cutMargin: the budget stays at this fraction of the smallest cut seen.
	cutMarginNum, cutMarginDen = 3, 4
)

func newBudget(cfg FetchConfig, gauge prometheus.Gauge, cuts *prometheus.CounterVec) *budget {
	b := &budget{cfg: cfg, gauge: gauge, cuts: cuts, current: cfg.ConnectionBudget}
	gauge.Set(float64(b.current))
	return b
}

// get returns the current budget.
func (b *budget) get() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.current
}

// next returns the size for the next chunk: the budget, or twice it (up to
// the limit) when this chunk is to be the probe.
func (b *budget) next(now time.Time) (size int64, probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.probing {
		return b.current, false
	}
	if g := b.growthLocked(now); g > b.current {
		b.probing = true
		return g, true
	}
	return b.current, false
}

// growthLocked is the size a probe would try, or the current budget when
// the budget may not grow.
func (b *budget) growthLocked(now time.Time) int64 {
	if b.cfg.MaxConnectionBudget <= b.cfg.ConnectionBudget {
		return b.current // fixed
	}
	if b.minCut > 0 && now.Sub(b.lastCut) > cutMemory {
		b.minCut = 0 // the path has been clean for a while: allow growth again
	}
	limit := b.cfg.MaxConnectionBudget
	if b.minCut > 0 {
		limit = min(limit, b.minCut*cutMarginNum/cutMarginDen)
	}
	return min(b.current*2, limit)
}

// completed records a chunk that finished on its connection. It returns the
// new budget when it grew, else 0.
func (b *budget) completed(size int64, probe bool, now time.Time) int64 {
	if !probe {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.probing = false
	if b.probeWins++; b.probeWins < growAfter {
		return 0
	}
	b.probeWins = 0
	if size <= b.current {
		return 0
	}
	b.current = size
	b.gauge.Set(float64(size))
	return size
}

// failed records a chunk that failed before carrying a byte.
func (b *budget) failed(probe bool) {
	if probe {
		b.mu.Lock()
		b.probing = false
		b.mu.Unlock()
	}
}

// cut records a session that died after carrying n bytes. It returns the new
// budget when it dropped, else 0.
func (b *budget) cut(n int64, probe bool, kind string, now time.Time) int64 {
	b.cuts.WithLabelValues(kind).Inc()
	b.mu.Lock()
	defer b.mu.Unlock()
	if probe {
		b.probing = false
	}
	if n <= 0 {
		return 0 // died before carrying anything: an error, not a byte-count cut
	}
	b.probeWins = 0
	b.lastCut = now
	if b.minCut == 0 || n < b.minCut {
		b.minCut = n
	}
	if b.cfg.MaxConnectionBudget <= b.cfg.ConnectionBudget {
		return 0 // fixed
	}
	next := max(b.minCut*cutMarginNum/cutMarginDen, b.cfg.MinConnectionBudget)
	if next >= b.current {
		return 0
	}
	b.current = next
	b.gauge.Set(float64(next))
	return next
}
