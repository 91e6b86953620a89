package imagesync

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the rules' metrics, labelled by rule (upstream/repository,
// as configured: bounded by the configuration).
type Metrics struct{ m *metrics }

type metrics struct {
	rounds     *prometheus.CounterVec
	fetched    *prometheus.CounterVec
	tagsCached *prometheus.GaugeVec
	lastRound  *prometheus.GaugeVec
	nextRound  *prometheus.GaugeVec
	failures   *prometheus.GaugeVec
}

// NewMetrics registers the rules' metrics with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &metrics{
		rounds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pullproxy_sync_rounds_total",
			Help: "Sync rounds, by rule and result: ok, failed, or other_replica (a replica sharing the bucket ran it)."},
			[]string{"rule", "result"}),
		fetched: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pullproxy_sync_fetched_bytes_total",
			Help: "Bytes of blobs the rule's rounds fetched on this replica (from the upstream or the shared bucket)."},
			[]string{"rule"}),
		tagsCached: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "pullproxy_sync_tags_cached",
			Help: "Tags the rule keeps cached (and pinned), over every repository it names."},
			[]string{"rule"}),
		lastRound: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "pullproxy_sync_last_round_timestamp_seconds",
			Help: "When the rule's last round ended, on whichever replica ran it; 0: none yet."},
			[]string{"rule"}),
		nextRound: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "pullproxy_sync_next_round_timestamp_seconds",
			Help: "When this replica next looks at the rule."},
			[]string{"rule"}),
		failures: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "pullproxy_sync_failures",
			Help: "The rule's rounds that failed in a row on this replica; 0 after a round that succeeded."},
			[]string{"rule"}),
	}
	for _, c := range []prometheus.Collector{m.rounds, m.fetched, m.tagsCached, m.lastRound, m.nextRound, m.failures} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return &Metrics{m}, nil
}

// observe sets r's gauges from its status. A nil m observes nothing, as
// do its counters (see the nil checks of their users).
func (m *metrics) observe(r *ruleRun) {
	if m == nil {
		return
	}
	r.mu.Lock()
	st := r.status
	r.mu.Unlock()
	m.tagsCached.WithLabelValues(r.name).Set(float64(st.TagsCached))
	m.failures.WithLabelValues(r.name).Set(float64(st.Failures))
	if !st.LastRound.IsZero() {
		m.lastRound.WithLabelValues(r.name).Set(float64(st.LastRound.UnixMilli()) / 1e3)
	}
	m.fetched.WithLabelValues(r.name) // present from the start, at 0
	m.rounds.WithLabelValues(r.name, "ok")
	m.rounds.WithLabelValues(r.name, "failed")
}

func (m *metrics) next(r *ruleRun, at time.Time) {
	if m == nil {
		return
	}
	m.nextRound.WithLabelValues(r.name).Set(float64(at.UnixMilli()) / 1e3)
}

func (m *metrics) round(r *ruleRun, result string) {
	if m == nil {
		return
	}
	m.rounds.WithLabelValues(r.name, result).Inc()
}

func (m *metrics) addFetched(r *ruleRun, n int64) {
	if m == nil {
		return
	}
	m.fetched.WithLabelValues(r.name).Add(float64(n))
}
