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
	budget *budget
}

// budget is the byte budget of one connection to an endpoint: how much a TCP
// session may carry before it is closed and replaced. A degraded carrier
// kills sessions after a byte count, so the connection, not the request, is
// the unit to control.
//
// Adaptive budgets grow while chunks complete cleanly (fewer connections on a
// clean path) and drop below the smallest cut seen when a session dies
// part-way, staying there while cuts are recent.
type budget struct {
	cfg   FetchConfig
	gauge prometheus.Gauge
	cuts  *prometheus.CounterVec // by kind

	mu      sync.Mutex
	current int64
	minCut  int64 // smallest number of bytes a session carried before dying; 0: none seen
	lastCut time.Time
	clean   int // chunks completed cleanly since the last change
}

const (
	// growAfter clean chunks at the current budget double it.
	growAfter = 4
	// cutMemory is how long a cut keeps capping the budget.
	cutMemory = 10 * time.Minute
	// cutMargin: the budget stays at this fraction of the smallest cut seen.
	cutMarginNum, cutMarginDen = 3, 4
)

func newBudget(cfg FetchConfig, gauge prometheus.Gauge, cuts *prometheus.CounterVec) *budget {
	b := &budget{cfg: cfg, gauge: gauge, cuts: cuts, current: cfg.Budget}
	gauge.Set(float64(b.current))
	return b
}

// get returns the current budget.
func (b *budget) get() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.current
}

// completed records a chunk that finished on its connection. It returns the
// new budget when it changed, else 0.
func (b *budget) completed(now time.Time) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cfg.MaxBudget <= b.cfg.Budget {
		return 0 // fixed
	}
	if b.minCut > 0 && now.Sub(b.lastCut) > cutMemory {
		b.minCut = 0 // the path has been clean for a while: allow growth again
	}
	if b.clean++; b.clean < growAfter {
		return 0
	}
	b.clean = 0
	limit := b.cfg.MaxBudget
	if b.minCut > 0 {
		limit = min(limit, b.minCut*cutMarginNum/cutMarginDen)
	}
	next := min(b.current*2, limit)
	if next <= b.current {
		return 0
	}
	b.current = next
	b.gauge.Set(float64(next))
	return next
}

// cut records a session that died after carrying n bytes. It returns the new
// budget when it dropped, else 0.
func (b *budget) cut(n int64, kind string, now time.Time) int64 {
	b.cuts.WithLabelValues(kind).Inc()
	if n <= 0 {
		return 0 // died before carrying anything: an error, not a byte-count cut
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.clean = 0
	b.lastCut = now
	if b.minCut == 0 || n < b.minCut {
		b.minCut = n
	}
	if b.cfg.MaxBudget <= b.cfg.Budget {
		return 0 // fixed
	}
	next := max(b.minCut*cutMarginNum/cutMarginDen, b.cfg.MinBudget)
	if next >= b.current {
		return 0
	}
	b.current = next
	b.gauge.Set(float64(next))
	return next
}
