package upstream

import (
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// health is what an endpoint's recent answers say about it. An endpoint on
// which a fetch gave up is down for a while: others are tried first, and it
// is tried again (probed) once the while is over, the while doubling with
// each failure in a row.
type health struct {
	mu        sync.Mutex
	downUntil time.Time
	failures  int // in a row
}

const (
	downFirst = 15 * time.Second
	downMax   = 5 * time.Minute
)

// failed records that the endpoint failed a request for good, returning
// how long it is now left aside.
func (h *health) failed(now time.Time) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failures++
	d := min(downFirst<<min(h.failures-1, 8), downMax)
	h.downUntil = now.Add(d)
	return d
}

// succeeded records a good answer: the endpoint is up.
func (h *health) succeeded() {
	h.mu.Lock()
	h.failures, h.downUntil = 0, time.Time{}
	h.mu.Unlock()
}

func (h *health) down(now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return now.Before(h.downUntil)
}

// ordered returns the endpoints to try: those up in configured order, then
// those down (a last resort, and how they are probed when all are down).
func (r *Registry) ordered(eps []*endpoint) []*endpoint {
	now := time.Now()
	out := make([]*endpoint, 0, len(eps))
	for _, ep := range eps {
		if !ep.health.down(now) {
			out = append(out, ep)
		}
	}
	for _, ep := range eps {
		if ep.health.down(now) {
			out = append(out, ep)
		}
	}
	return out
}

// rateLimit remembers an upstream's 429s: until the time it asked us to
// wait, requests fail at once instead of adding to the count.
type rateLimit struct {
	mu    sync.Mutex
	until time.Time
}

// defaultRetryAfter is the wait after a 429 that names none.
const defaultRetryAfter = time.Minute

func (l *rateLimit) blocked(now time.Time) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.until, now.Before(l.until)
}

func (l *rateLimit) hit(now time.Time, retryAfter time.Duration) {
	if retryAfter <= 0 {
		retryAfter = defaultRetryAfter
	}
	l.mu.Lock()
	if t := now.Add(retryAfter); t.After(l.until) {
		l.until = t
	}
	l.mu.Unlock()
}

// recordRateLimit exports Docker Hub's rate-limit headers
// ("ratelimit-remaining: 76;w=21600") as metrics, and notes a 429.
// https://docs.docker.com/docker-hub/usage/pulls/
func (r *Registry) recordRateLimit(resp *http.Response) {
	for header, gauge := range map[string]func(float64){
		"Ratelimit-Remaining": r.metrics.rateRemaining.WithLabelValues(r.name).Set,
		"Ratelimit-Limit":     r.metrics.rateLimit.WithLabelValues(r.name).Set,
	} {
		if v := resp.Header.Get(header); v != "" {
			n, _, _ := strings.Cut(v, ";")
			if f, err := strconv.ParseFloat(strings.TrimSpace(n), 64); err == nil {
				gauge(f)
			}
		}
	}
	if resp.StatusCode == http.StatusTooManyRequests {
		retryAfter := parseRetryAfter(resp.Header.Get("Retry-After"))
		r.limit.hit(time.Now(), retryAfter)
		r.log.Warn("the upstream is rate limiting pullproxy: holding off", "retry_after", retryAfter,
			"fix", "authenticate to the upstream (higher limits), or pre-seed the images")
	}
}
