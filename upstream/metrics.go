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
	// endpointBytes: blob bytes by endpoint, each endpoint's share where
	// several fetch one blob together.
	endpointBytes *prometheus.CounterVec
	budget        *prometheus.GaugeVec
	cuts          *prometheus.CounterVec
	chunks        *prometheus.CounterVec
	retries       *prometheus.CounterVec
	wasted        *prometheus.CounterVec

	connLimit     *prometheus.GaugeVec
	connsInFlight *prometheus.GaugeVec

	rateRemaining *prometheus.GaugeVec
	rateLimit     *prometheus.GaugeVec
	endpointUp    *prometheus.GaugeVec

	ecrRenewals *prometheus.CounterVec
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
		endpointBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_upstream_endpoint_blob_bytes_total",
			Help: "Blob bytes received from each endpoint: its share of pullproxy_upstream_blob_bytes_total, where endpoints that share content fetch blobs together.",
		}, []string{"upstream", "endpoint"}),
	}
	m.budget = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pullproxy_upstream_connection_budget_bytes",
		Help: "Bytes one connection to an endpoint may carry before it is replaced, as currently learned.",
	}, []string{"upstream", "endpoint"})
	m.cuts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pullproxy_upstream_connection_cuts_total",
		Help: "Chunk and metadata connections that died before their answer was complete, by kind: reset, eof (closed early), stall (went silent), slow (below min_goodput), error.",
	}, []string{"upstream", "endpoint", "kind"})
	m.retries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pullproxy_upstream_retries_total",
		Help: "Manifest, HEAD and token requests sent again on a fresh connection after theirs failed before a complete answer, by reason: reset, eof, stall, error, or retired (a new connection already past its byte budget).",
	}, []string{"upstream", "reason"})
	m.chunks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pullproxy_upstream_chunks_total",
		Help: "Blob chunks requested from endpoints, by result: complete, cut, failed (no byte received), overtaken (ended early: a request racing it for the same bytes at a blob's end brought them first).",
	}, []string{"upstream", "endpoint", "result"})
	m.wasted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pullproxy_upstream_wasted_bytes_total",
		Help: "Blob bytes an endpoint sent, or may have sent, that no blob kept, by kind: discarded (received and thrown away: bytes another request had written already, a restarted stream's, bytes left unread when pullproxy ended a request) and abandoned (asked for and never received by requests pullproxy ended: at most what the endpoint sent besides). A carrier bills them; pullproxy_upstream_blob_bytes_total does not count them.",
	}, []string{"upstream", "endpoint", "kind"})
	m.connLimit = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pullproxy_upstream_connections_limit",
		Help: "Chunk connections to an endpoint allowed in flight at once, as currently adapted to the path (at most fetch.max_connections).",
	}, []string{"upstream", "endpoint"})
	m.connsInFlight = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pullproxy_upstream_connections_in_flight",
		Help: "Chunk connections to an endpoint in flight now.",
	}, []string{"upstream", "endpoint"})
	m.rateRemaining = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pullproxy_upstream_ratelimit_remaining",
		Help: "Pulls left in the upstream's rate-limit window, from its ratelimit-remaining header (Docker Hub).",
	}, []string{"upstream"})
	m.rateLimit = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pullproxy_upstream_ratelimit_limit",
		Help: "The upstream's rate limit per window, from its ratelimit-limit header (Docker Hub).",
	}, []string{"upstream"})
	m.endpointUp = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pullproxy_upstream_endpoint_up",
		Help: "1 while an endpoint is in use, 0 while it is left aside after failing (it is probed again later).",
	}, []string{"upstream", "endpoint"})
	m.ecrRenewals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pullproxy_ecr_token_renewals_total",
		Help: "ECR authorization tokens asked for, by region and result (ok, failed).",
	}, []string{"region", "result"})
	for _, c := range []prometheus.Collector{m.ecrRenewals, m.requests, m.blobBytes, m.endpointBytes, m.budget, m.cuts, m.chunks, m.retries, m.wasted,
		m.connLimit, m.connsInFlight, m.rateRemaining, m.rateLimit, m.endpointUp} {
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

// ecrRenewal counts an ECR token asked for. m may be nil.
func (m *Metrics) ecrRenewal(region string, err error) {
	if m == nil {
		return
	}
	result := "ok"
	if err != nil {
		result = "failed"
	}
	m.ecrRenewals.WithLabelValues(region, result).Inc()
}
