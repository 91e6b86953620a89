package proxy

import (
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	requests    *prometheus.CounterVec
	servedBytes *prometheus.CounterVec
	served      map[string]prometheus.Counter // servedBytes by source, looked up once
	// common holds the requests counters of blob and manifest GETs and
	// HEADs with the usual statuses, each looked up on its first use:
	// WithLabelValues hashes its labels on every call.
	common       [2][2][len(commonStatuses)]atomic.Pointer[prometheus.Counter]
	stale        *prometheus.CounterVec
	fetches      *prometheus.CounterVec
	connsRefused *prometheus.CounterVec

	// By kind of request, each looked up once: durations, and whether
	// the answer came from the store (hit) or not (miss).
	durations      map[string]prometheus.Observer
	cacheResults   map[string][2]prometheus.Counter // [hit, miss]
	verifyFailures *prometheus.CounterVec
	waiters        atomic.Int64 // clients waiting on downloads in flight
}

// metricKinds are the values of the kind label: bounded, whatever the
// requests.
var metricKinds = []string{kindBlob, kindManifest, kindTags, kindReferrers, "catalog", "ping", "other"}

// requestDurationBuckets span a manifest answered from memory (a
// millisecond) to a cold layer of gigabytes across a broken path (an hour).
var requestDurationBuckets = prometheus.ExponentialBuckets(0.001, 4, 12)

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_http_requests_total",
			Help: "Registry API requests served, by kind (manifests, blobs, ping, other), method (other for unknown ones) and HTTP status.",
		}, []string{"kind", "method", "code"}),
		servedBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_blob_served_bytes_total",
			Help: "Blob bytes sent to clients, by source: cache (a stored blob) or download (one in flight).",
		}, []string{"source"}),
		stale: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_stale_served_total",
			Help: "Answers served from the cache because revalidating them upstream failed, by upstream and kind (tag, tag_list, referrers).",
		}, []string{"upstream", "kind"}),
		fetches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_blob_fetches_total",
			Help: "Upstream blob downloads finished, by upstream and result (committed, failed).",
		}, []string{"upstream", "result"}),
		connsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pullproxy_http_connections_refused_total",
			Help: "Client connections refused before their request, by reason: limit (503, max_client_connections open), client (403, not in allow_clients).",
		}, []string{"reason"}),
	}
	m.served = map[string]prometheus.Counter{
		"cache":    m.servedBytes.WithLabelValues("cache"),
		"download": m.servedBytes.WithLabelValues("download"),
	}
	durations := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "pullproxy_http_request_duration_seconds",
		Help:    "Time from a request's arrival to the end of its answer, by kind (blobs, manifests, tags, referrers, catalog, ping, other).",
		Buckets: requestDurationBuckets,
	}, []string{"kind"})
	cacheRequests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pullproxy_cache_requests_total",
		Help: "Answers with content, by kind and result: hit (from the store) or miss (from a download in flight or the upstream).",
	}, []string{"kind", "result"})
	m.verifyFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "pullproxy_blob_verification_failures_total",
		Help: "Blob downloads whose bytes did not match their digest or size, by upstream: the upstream's copy, or the path, corrupted them.",
	}, []string{"upstream"})
	m.durations = map[string]prometheus.Observer{}
	m.cacheResults = map[string][2]prometheus.Counter{}
	for _, k := range metricKinds {
		m.durations[k] = durations.WithLabelValues(k)
		m.cacheResults[k] = [2]prometheus.Counter{cacheRequests.WithLabelValues(k, "hit"), cacheRequests.WithLabelValues(k, "miss")}
	}
	for _, c := range []prometheus.Collector{m.requests, m.servedBytes, m.stale, m.fetches, m.connsRefused,
		durations, cacheRequests, m.verifyFailures} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// observe records how long a request of kind took, and, if it answered
// with content from source, whether that was a cache hit.
func (m *metrics) observe(kind, source string, took time.Duration) {
	o, ok := m.durations[kind]
	if !ok {
		kind = "other"
		o = m.durations[kind]
	}
	o.Observe(took.Seconds())
	switch source {
	case "":
	case sourceCache:
		m.cacheResults[kind][0].Inc()
	default:
		m.cacheResults[kind][1].Inc()
	}
}

// commonStatuses are the statuses whose counters metrics.common keeps.
var commonStatuses = [...]int{http.StatusOK, http.StatusPartialContent, http.StatusNotModified, http.StatusNotFound}

// request returns the requests counter for a request's labels.
func (m *metrics) request(kind, method string, status int) prometheus.Counter {
	k, mt, st := -1, -1, -1
	switch kind {
	case kindBlob:
		k = 0
	case kindManifest:
		k = 1
	}
	switch method {
	case http.MethodGet:
		mt = 0
	case http.MethodHead:
		mt = 1
	}
	for i, c := range commonStatuses {
		if c == status {
			st = i
		}
	}
	if k < 0 || mt < 0 || st < 0 {
		return m.requests.WithLabelValues(kind, methodLabel(method), statusLabel(status))
	}
	p := &m.common[k][mt][st]
	if c := p.Load(); c != nil {
		return *c
	}
	c := m.requests.WithLabelValues(kind, method, statusLabel(status))
	p.Store(&c)
	return c
}

// responseRecorder notes the status and body size of a response. It passes
// ReadFrom through so that serving a file still uses sendfile.
type responseRecorder struct {
	http.ResponseWriter
	status  int
	written int64
	source  string // for blobs: "cache" or "download"
	flushed bool   // the header has been sent
	// headerSent: WriteHeader or Write was called, so an error can no
	// longer be written on the hijacked connection (see writeWithReason).
	headerSent bool
	whole      bool // a stored blob was sent whole (see sendStored)
}

func (w *responseRecorder) WriteHeader(status int) {
	w.status, w.headerSent = status, true
	w.ResponseWriter.WriteHeader(status)
}

func (w *responseRecorder) Write(b []byte) (int, error) {
	w.headerSent = true
	n, err := w.ResponseWriter.Write(b)
	w.written += int64(n)
	return n, err
}

// ReadFrom sends the header first, on its own: net/http would otherwise
// read the body's first 512 bytes to send them along with it, and sendfile
// the rest from a file offset that is no longer page-aligned.
func (w *responseRecorder) ReadFrom(src io.Reader) (int64, error) {
	if !w.flushed {
		if f, ok := w.ResponseWriter.(http.Flusher); ok {
			f.Flush()
		}
		w.flushed = true
	}
	n, err := io.Copy(w.ResponseWriter, src)
	w.written += n
	return n, err
}

func (w *responseRecorder) Unwrap() http.ResponseWriter { return w.ResponseWriter }
