package bucket

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are what a replica's use of the bucket costs: requests by
// operation (each S3 request is billed) and bytes each way, and where
// blobs came from.
type metrics struct {
	requests *prometheus.CounterVec
	read     prometheus.Counter
	written  prometheus.Counter
	blobs    *prometheus.CounterVec
	takeover prometheus.Counter
	// degraded is 1 while calls skip the bucket; degradedTotal counts
	// the times it became so.
	degraded      prometheus.Gauge
	degradedTotal prometheus.Counter
	dropped       *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pullproxy_bucket_requests_total",
			Help: "Requests made to the shared bucket, by operation and result (ok, not_found, precondition, timeout, error)."},
			[]string{"op", "result"}),
		read: prometheus.NewCounter(prometheus.CounterOpts{Name: "pullproxy_bucket_read_bytes_total",
			Help: "Bytes read from the shared bucket."}),
		written: prometheus.NewCounter(prometheus.CounterOpts{Name: "pullproxy_bucket_written_bytes_total",
			Help: "Bytes written to the shared bucket (server-side copies not counted)."}),
		blobs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pullproxy_bucket_blob_fetches_total",
			Help: "Blobs this replica fetched, by source: bucket (stored there), followed (another replica's download, as its parts landed), upstream (this replica held the lease)."},
			[]string{"source"}),
		takeover: prometheus.NewCounter(prometheus.CounterOpts{Name: "pullproxy_bucket_lease_takeovers_total",
			Help: "Downloads this replica took over from a replica that stopped renewing its lease."}),
		degraded: prometheus.NewGauge(prometheus.GaugeOpts{Name: "pullproxy_bucket_degraded",
			Help: "1 while the shared bucket is degraded (it did not answer in time): calls skip it, and a probe waits for it to answer."}),
		degradedTotal: prometheus.NewCounter(prometheus.CounterOpts{Name: "pullproxy_bucket_degraded_total",
			Help: "Times the shared bucket became degraded."}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pullproxy_bucket_writes_dropped_total",
			Help: "Background writes to the shared bucket (blobs committed here, to share) dropped, by reason (queue_full, degraded, closed)."},
			[]string{"reason"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.read, m.written, m.blobs, m.takeover,
		m.degraded, m.degradedTotal, m.dropped} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// request counts a request by its outcome; timeout says it ran out of time.
func (m *metrics) request(op string, err error, timeout bool) {
	result := "ok"
	switch {
	case err == nil:
	case timeout:
		result = "timeout"
	case isNotFound(err):
		result = "not_found"
	case isPrecondition(err):
		result = "precondition"
	default:
		result = "error"
	}
	m.requests.WithLabelValues(op, result).Inc()
}
