package upstream

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the upstream side's Prometheus metrics. One Metrics is shared
// by every Registry of a process and registered once.
type Metrics struct {
	requests  *prometheus.CounterVec
	blobBytes *prometheus.CounterVec
}

// NewMetrics creates the upstream metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_upstream_requests_total",
			Help: "Requests sent to upstream registries, by upstream, method and HTTP status (\"error\" when none was received).",
		}, []string{"upstream", "method", "code"}),
		blobBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_upstream_blob_bytes_total",
			Help: "Blob bytes received from upstream registries.",
		}, []string{"upstream"}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.blobBytes} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) request(upstream, method string, status int) {
	code := "error"
	if status > 0 {
		code = strconv.Itoa(status)
	}
	m.requests.WithLabelValues(upstream, method, code).Inc()
}
