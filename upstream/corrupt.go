package upstream

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
)

// An endpoint that served a blob whose bytes failed verification is kept
// away from that blob for a while, so that clients retrying (containerd at
// once, kubelet after 10 s doubling to 5 min) do not download the same bad
// bytes again and again. The wait starts short, since the operator may
// fix the blob upstream at once, and doubles with each failure in a row up
// to a cap, so that a blob that stays corrupt costs one download per half
// hour. A verified fetch from the endpoint, or the operator (Forget), ends
// it.
const (
	corruptFirstWait = time.Minute
	corruptMaxWait   = 30 * time.Minute
	// corruptMemory is how long after its retry time an entry nobody
	// tried again is kept: the next failure past it starts the schedule
	// anew.
	corruptMemory = 2 * corruptMaxWait
)

// corruptWait is how long an endpoint is kept from a blob after its
// failures-th failure in a row (1: the first): 1, 2, 4, 8, 16, then 30
// minutes.
func corruptWait(failures int) time.Duration {
	w := corruptFirstWait
	for i := 1; i < failures && w < corruptMaxWait; i++ {
		w *= 2
	}
	return min(w, corruptMaxWait)
}

// corruptBlobs remembers which endpoint served which blob corrupt, and
// which blobs failed verification with bytes from several endpoints in
// them: those come from one endpoint at a time for a while, so that the
// one serving them corrupt is found.
type corruptBlobs struct {
	mu    sync.Mutex
	m     map[corruptKey]corruption
	mixed map[digest.Digest]time.Time // until when
}

// addMixed has d come from one endpoint at a time until corruptMaxWait
// from now.
func (c *corruptBlobs) addMixed(d digest.Digest, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, until := range c.mixed {
		if !now.Before(until) {
			delete(c.mixed, k)
		}
	}
	if c.mixed == nil {
		c.mixed = map[digest.Digest]time.Time{}
	}
	c.mixed[d] = now.Add(corruptMaxWait)
}

// alone reports whether d is to come from one endpoint at a time.
func (c *corruptBlobs) alone(d digest.Digest, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	until, ok := c.mixed[d]
	return ok && now.Before(until)
}

type corruptKey struct {
	digest   digest.Digest
	endpoint string // as Endpoints names it
}

type corruption struct {
	first    time.Time // the first failure in a row
	failures int       // in a row
	retryAt  time.Time // the endpoint is asked for the blob again from then
	cause    error     // what verification found the last time
}

func (c *corruptBlobs) add(d digest.Digest, endpoint string, cause error, now time.Time) corruption {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[corruptKey]corruption{}
	}
	for k, v := range c.m { // few entries: a corrupt blob is rare
		if now.Sub(v.retryAt) >= corruptMemory {
			delete(c.m, k)
		}
	}
	k := corruptKey{d, endpoint}
	v, ok := c.m[k]
	if !ok {
		v.first = now
	}
	v.failures++
	v.retryAt = now.Add(corruptWait(v.failures))
	v.cause = cause
	c.m[k] = v
	return v
}

// blocked returns the entry of d at endpoint while the endpoint is kept
// from d.
func (c *corruptBlobs) blocked(d digest.Digest, endpoint string, now time.Time) (corruption, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.m[corruptKey{d, endpoint}]
	if !ok || !now.Before(v.retryAt) {
		return corruption{}, false
	}
	return v, true
}

// clear removes the entries of d, at endpoint or, with endpoint "", at
// every endpoint, and returns them.
func (c *corruptBlobs) clear(d digest.Digest, endpoint string) []CorruptStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []CorruptStatus
	for k, v := range c.m {
		if k.digest == d && (endpoint == "" || k.endpoint == endpoint) {
			out = append(out, v.status(k))
			delete(c.m, k)
		}
	}
	if endpoint == "" {
		delete(c.mixed, d)
	}
	sortCorrupt(out)
	return out
}

// list returns the entries not yet forgotten.
func (c *corruptBlobs) list(now time.Time) []CorruptStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []CorruptStatus
	for k, v := range c.m {
		if now.Sub(v.retryAt) < corruptMemory {
			out = append(out, v.status(k))
		}
	}
	sortCorrupt(out)
	return out
}

func (v corruption) status(k corruptKey) CorruptStatus {
	s := CorruptStatus{Digest: k.digest, Endpoint: k.endpoint, Failures: v.failures, Since: v.first, RetryAt: v.retryAt}
	if v.cause != nil {
		s.LastError = v.cause.Error()
	}
	return s
}

func sortCorrupt(s []CorruptStatus) {
	slices.SortFunc(s, func(a, b CorruptStatus) int {
		return cmp.Or(cmp.Compare(a.Digest, b.Digest), cmp.Compare(a.Endpoint, b.Endpoint))
	})
}

// CorruptStatus is an endpoint that served a blob whose bytes failed
// verification: it is not asked for the blob again before RetryAt.
type CorruptStatus struct {
	Digest    digest.Digest `json:"digest"`
	Endpoint  string        `json:"endpoint"` // as Endpoints names it
	Failures  int           `json:"failures_in_a_row"`
	Since     time.Time     `json:"since"`
	RetryAt   time.Time     `json:"retry_at"`
	LastError string        `json:"last_error,omitempty"`
}

// CorruptFix is what an operator does about a blob an endpoint serves
// corrupt.
func CorruptFix(d digest.Digest) string {
	return fmt.Sprintf("delete the blob upstream and push it again, then run `pullproxy forget %s` to fetch it at once", d)
}

// ReportCorrupt records that the bytes of d that FetchBlob got from
// endpoints (its report's Sources, as Endpoints names them) failed
// verification; cause says what was found. From one endpoint, FetchBlob
// then fetches d from the other endpoints only, and fails at once, naming
// the endpoint and the cause, when no other is left, until the endpoint's
// retry time: one minute after the first failure, doubling with each
// failure in a row up to 30 minutes. ReportVerified or Forget ends it
// sooner. From several, which one served bad bytes is not known: d comes
// from one endpoint at a time, so that the next failure names it.
func (r *Registry) ReportCorrupt(d digest.Digest, endpoints []string, cause error) {
	if len(endpoints) > 1 {
		r.corrupt.addMixed(d, r.now())
		r.log.Warn("blob failed verification with bytes from several endpoints in it: fetching it from one endpoint at a time",
			"digest", d, "endpoints", endpoints, "err", cause)
		return
	}
	for _, endpoint := range endpoints {
		c := r.corrupt.add(d, endpoint, cause, r.now())
		r.log.Warn("blob failed verification: the endpoint is not asked for it again until its retry time",
			"digest", d, "endpoint", endpoint, "failures_in_a_row", c.failures, "retry_at", c.retryAt.UTC().Format(time.RFC3339),
			"err", cause, "fix", CorruptFix(d))
	}
}

// ReportVerified records that the bytes of d that FetchBlob got from
// endpoints (its report's Sources) verified: whatever they served corrupt
// before is forgotten.
func (r *Registry) ReportVerified(d digest.Digest, endpoints []string) {
	for _, endpoint := range endpoints {
		if cleared := r.corrupt.clear(d, endpoint); len(cleared) > 0 {
			r.log.Info("blob verified from an endpoint that had served it corrupt", "digest", d, "endpoint", endpoint,
				"failures_in_a_row", cleared[0].Failures)
		}
	}
}

// Forget ends the wait of every endpoint kept from d for serving it
// corrupt, so that the next fetch asks them at once (the operator has
// pushed the blob again), and returns what it ended.
func (r *Registry) Forget(d digest.Digest) []CorruptStatus {
	cleared := r.corrupt.clear(d, "")
	if len(cleared) > 0 {
		r.log.Info("corrupt blob forgotten: its endpoints are asked for it again", "digest", d, "endpoints", len(cleared))
	}
	return cleared
}

// usableFor returns the endpoints not kept from d, or an error naming what
// was seen when there is none.
func (r *Registry) usableFor(repo string, d digest.Digest) ([]*endpoint, error) {
	now := r.now()
	var eps []*endpoint
	var last corruption
	var lastHost string
	for _, ep := range r.endpoints {
		if c, ok := r.corrupt.blocked(d, ep.url.Redacted(), now); ok {
			last, lastHost = c, ep.host
			continue
		}
		eps = append(eps, ep)
	}
	if len(eps) > 0 {
		return eps, nil
	}
	return nil, &Error{Upstream: r.name, Endpoint: lastHost, Op: "GET /v2/" + repo + "/blobs/" + d.String(),
		Kind: ErrInvalid, Err: last.cause,
		Message: fmt.Sprintf("served %s corrupt (%v; %d time(s) in a row since %s ago), and no other endpoint is configured; "+
			"it is not fetched again before %s UTC: %s",
			d, last.cause, last.failures, now.Sub(last.first).Round(time.Second),
			last.retryAt.UTC().Format(time.TimeOnly), CorruptFix(d))}
}
