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
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "pullproxy_bucket_requests_total",
			Help: "Requests made to the shared bucket, by operation and result (ok, not_found, precondition, error)."},
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
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.requests, m.read, m.written, m.blobs, m.takeover} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *metrics) request(op string, err error) {
	result := "ok"
	switch {
	case err == nil:
	case isNotFound(err):
		result = "not_found"
	case isPrecondition(err):
		result = "precondition"
	default:
		result = "error"
	}
	m.requests.WithLabelValues(op, result).Inc()
}
