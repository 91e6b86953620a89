package upstream

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// health is what an endpoint's recent answers say about it. An endpoint on
// which a fetch gave up is down for a while: others are tried first, and it
// is tried again (probed) once the while is over, the while doubling with
// each failure in a row.
//
// Chunks tell more: an endpoint whose recent chunks are mostly cut (a
// degraded carrier path, as to one region in the incident) is degraded, and
// a healthy endpoint is preferred to it for new blobs. Outcomes older than
// healthWindow are forgotten, so a degraded endpoint is tried again later.
type health struct {
	mu        sync.Mutex
	downUntil time.Time
	failures  int // in a row
	lastErr   string
	lastErrAt time.Time

	outcomes [healthSamples]outcome // ring of recent chunk outcomes
	next     int
}

type outcome struct {
	at   time.Time
	cut  bool
	lost int64 // what a cut chunk's request asked for and did not bring
	got  int64 // what the chunk brought
}

const (
	healthSamples  = 32
	healthWindow   = 5 * time.Minute
	degradedMin    = 8 // outcomes needed to judge
	degradedCutPct = 30
)

// chunk records a chunk's outcome: cut or not, the bytes it brought, and
// those its request asked for that it did not bring.
func (h *health) chunk(now time.Time, cut bool, got, lost int64) {
	h.mu.Lock()
	h.outcomes[h.next] = outcome{at: now, cut: cut, got: got, lost: lost}
	h.next = (h.next + 1) % healthSamples
	h.mu.Unlock()
}

// degraded reports whether most recent chunks were cut, and the cut rate.
func (h *health) degraded(now time.Time) (bool, int) {
	n, pct := h.cutShare(now)
	if n < degradedMin {
		return false, 0
	}
	return pct >= degradedCutPct, pct
}

// cutShare returns how many chunk outcomes are recent, and the share of
// them cut, in percent.
func (h *health) cutShare(now time.Time) (n, pct int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	cuts := 0
	for _, o := range h.outcomes {
		if !o.at.IsZero() && now.Sub(o.at) < healthWindow {
			n++
			if o.cut {
				cuts++
			}
		}
	}
	if n == 0 {
		return 0, 0
	}
	return n, cuts * 100 / n
}

// lossShare returns how many chunk outcomes are recent, and the share of
// the bytes their requests asked for that cuts lost, in percent: what
// sessions cut or stalled left on the path, which a carrier bills all the
// same (a stall swallows what the request had on the way).
func (h *health) lossShare(now time.Time) (n, pct int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var got, lost int64
	for _, o := range h.outcomes {
		if !o.at.IsZero() && now.Sub(o.at) < healthWindow {
			n++
			got += o.got
			lost += o.lost
		}
	}
	if got+lost == 0 {
		return n, 0
	}
	return n, int(lost * 100 / (got + lost))
}

const (
	downFirst = 15 * time.Second
	downMax   = 5 * time.Minute
)

// failed records that the endpoint failed a request for good, and why,
// returning how long it is now left aside.
func (h *health) failed(now time.Time, err error) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err != nil {
		h.lastErr, h.lastErrAt = err.Error(), now
	}
	h.failures++
	d := min(downFirst<<min(h.failures-1, 8), downMax)
	h.downUntil = now.Add(d)
	return d
}

// recent returns how many chunk outcomes of the window are known.
func (h *health) recent(now time.Time) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, o := range h.outcomes {
		if !o.at.IsZero() && now.Sub(o.at) < healthWindow {
			n++
		}
	}
	return n
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

// ordered returns the endpoints to try: the healthy in configured order,
// then the degraded, then those down (a last resort, and how they are
// probed when all are down).
func (r *Registry) ordered(eps []*endpoint) []*endpoint {
	if len(eps) < 2 {
		return eps
	}
	now := time.Now()
	rank := func(ep *endpoint) int {
		if ep.health.down(now) {
			return 2
		}
		if degraded, _ := ep.health.degraded(now); degraded {
			return 1
		}
		return 0
	}
	out := slices.Clone(eps)
	slices.SortStableFunc(out, func(a, b *endpoint) int { return rank(a) - rank(b) })
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
// ("ratelimit-remaining: 76;w=21600") as metrics, keeps them for
// PullsLeft, and notes a 429.
// https://docs.docker.com/docker-hub/usage/pulls/
func (r *Registry) recordRateLimit(resp *http.Response) {
	left, okLeft := parseRateLimit(resp.Header.Get("Ratelimit-Remaining"))
	limit, okLimit := parseRateLimit(resp.Header.Get("Ratelimit-Limit"))
	if okLeft {
		r.metrics.rateRemaining.WithLabelValues(r.name).Set(float64(left))
	}
	if okLimit {
		r.metrics.rateLimit.WithLabelValues(r.name).Set(float64(limit))
	}
	if okLeft {
		r.pulls.seen(left, limit, okLimit)
	}
	if resp.StatusCode == http.StatusTooManyRequests {
		retryAfter := parseRetryAfter(resp.Header.Get("Retry-After"))
		r.limit.hit(time.Now(), retryAfter)
		r.log.Warn("the upstream is rate limiting pullproxy: holding off", "retry_after", retryAfter,
			"fix", "authenticate to the upstream (higher limits), or pre-seed the images")
	}
}

// parseRateLimit parses a rate-limit header's count, "76;w=21600" or "76";
// false when absent or not a count.
func parseRateLimit(v string) (int64, bool) {
	if v == "" {
		return 0, false
	}
	n, _, _ := strings.Cut(v, ";")
	c, err := strconv.ParseInt(strings.TrimSpace(n), 10, 64)
	if err != nil || c < 0 {
		return 0, false
	}
	return c, true
}

// pullWindow is the last rate-limit window an upstream told of: pulls left
// in it, of limit (0: not told).
type pullWindow struct{ left, limit int64 }

// pullCount keeps the last pullWindow seen. Read without a lock: a caller
// deciding whether to hold off never waits on a response being recorded.
type pullCount struct{ last atomic.Pointer[pullWindow] }

// seen records a response's window: left, and limit where the response
// gave it (else the last limit seen stands). A window like the last is not
// stored again.
func (c *pullCount) seen(left, limit int64, gaveLimit bool) {
	prev := c.last.Load()
	if !gaveLimit && prev != nil {
		limit = prev.limit
	}
	if prev != nil && prev.left == left && prev.limit == limit {
		return
	}
	c.last.Store(&pullWindow{left: left, limit: limit})
}

// PullsLeft returns the pulls the upstream last said were left in its
// rate-limit window, and the window's limit (0 if it did not say), as
// Docker Hub's ratelimit-remaining and ratelimit-limit headers give them;
// known is false until an answer carried them. They are the last seen,
// however old: a HEAD of a manifest, which Docker Hub does not count as a
// pull, refreshes them. A background caller holds off with them before
// the window runs dry, leaving the rest to clients.
func (r *Registry) PullsLeft() (left, limit int64, known bool) {
	w := r.pulls.last.Load()
	if w == nil {
		return 0, 0, false
	}
	return w.left, w.limit, true
}
