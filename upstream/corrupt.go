package upstream

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/spans"
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

// corruptBlobs remembers which endpoint served which blob corrupt, which
// endpoint is suspected of it for a blob that failed verification with
// bytes from several in it, and which blobs come from one endpoint at a
// time, no endpoint being left to suspect.
type corruptBlobs struct {
	mu    sync.Mutex
	m     map[corruptKey]corruption
	mixed map[digest.Digest]time.Time // until when
	// Blobs whose suspect's ranges are being fetched again.
	suspicions map[digest.Digest]suspicion
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

// suspicion is a blob that failed verification with bytes from several
// endpoints in it, whose suspect's ranges are being fetched again from the
// others (see Registry.ReportCorrupt).
type suspicion struct {
	suspect string               // left out of the blob's next fetch
	cleared []string             // suspected before: their ranges came from others, and the digest still failed
	owners  map[string]spans.Set // who brought the bytes kept
	cause   error                // what verification found
	until   time.Time            // forgotten after, should the blob not be fetched again
}

// suspect records s for d.
func (c *corruptBlobs) suspect(d digest.Digest, s suspicion) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.suspicions == nil {
		c.suspicions = map[digest.Digest]suspicion{}
	}
	c.suspicions[d] = s
}

// suspected returns the endpoint suspected of serving d corrupt, or "".
func (c *corruptBlobs) suspected(d digest.Digest, now time.Time) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := c.suspicions[d]; ok && now.Before(s.until) {
		return s.suspect
	}
	return ""
}

// takeSuspicion removes d's suspicion and returns it, if there is one.
func (c *corruptBlobs) takeSuspicion(d digest.Digest, now time.Time) (suspicion, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k, s := range c.suspicions {
		if !now.Before(s.until) {
			delete(c.suspicions, k)
		}
	}
	s, ok := c.suspicions[d]
	delete(c.suspicions, d)
	return s, ok
}

// evidence returns who brought the bytes of d that failed verification:
// the ranges rep's sources covered, and, for the bytes an earlier fetch
// left (see Registry.ReportCorrupt), who brought those. It takes d's
// suspicion, if there was one, and returns it too.
func (c *corruptBlobs) evidence(d digest.Digest, rep FetchReport, now time.Time) (map[string]spans.Set, *suspicion) {
	owners := map[string]spans.Set{}
	var fresh spans.Set
	for _, src := range rep.Sources {
		set := owners[src.Endpoint]
		for _, sp := range src.Spans {
			set.Add(sp.Start, sp.End)
			fresh.Add(sp.Start, sp.End)
		}
		if len(set) > 0 {
			owners[src.Endpoint] = set
		}
	}
	prior, ok := c.takeSuspicion(d, now)
	if !ok {
		return owners, nil
	}
	for endpoint, kept := range prior.owners {
		// A byte fetched now was missing: what was said of it before no
		// longer holds.
		kept = slices.Clone(kept)
		for _, sp := range fresh {
			kept.Remove(sp.Start, sp.End)
		}
		set := owners[endpoint]
		for _, sp := range kept {
			set.Add(sp.Start, sp.End)
		}
		if len(set) > 0 {
			owners[endpoint] = set
		}
	}
	return owners, &prior
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
		delete(c.suspicions, d)
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

// ReportCorrupt records that the bytes of d that FetchBlob got (rep is its
// report) failed verification; cause says what was found. It returns the
// byte ranges to fetch again, keeping the rest, or nil when the download
// is to be discarded whole.
//
// From one endpoint, that endpoint is to blame: FetchBlob then fetches d
// from the other endpoints only, and fails at once, naming the endpoint and
// the cause, when no other is left, until the endpoint's retry time: one
// minute after the first failure, doubling with each failure in a row up to
// 30 minutes. ReportVerified or Forget ends it sooner.
//
// From several, the digest does not say whose bytes were wrong. The
// endpoint that brought the fewest is suspected: the ranges its answers
// covered are returned, and the next fetch of d gets them from the others.
// If d then verifies, the suspect is to blame (see ReportVerified); if not,
// the next is suspected, each at most once. A corrupt endpoint thus costs
// its share of the blob, once, when it brought the least, and at most the
// blob when it brought the most. When no endpoint is left to suspect, d
// comes from one endpoint at a time for a while, so that the next failure
// names the one.
func (r *Registry) ReportCorrupt(d digest.Digest, rep FetchReport, cause error) []spans.Span {
	now := r.now()
	owners, prior := r.corrupt.evidence(d, rep, now)
	var cleared []string
	if prior != nil {
		// Every byte the suspect had brought was fetched from the others,
		// and the digest still failed: the bad bytes are elsewhere.
		cleared = append(prior.cleared, prior.suspect)
	}
	switch {
	case len(owners) == 1: // every byte is the one's
		for endpoint := range owners {
			r.blame(d, endpoint, cause, now)
		}
		return nil
	case len(owners) == 0 && len(rep.Sources) == 1: // a report that kept no ranges
		r.blame(d, rep.Sources[0].Endpoint, cause, now)
		return nil
	case len(owners) == 0 && len(rep.Sources) == 0:
		return nil // every byte was on disk before: no endpoint to blame
	}
	suspect, drop := r.nextSuspect(d, owners, cleared)
	if suspect == "" {
		r.corrupt.addMixed(d, now)
		r.log.Warn("blob failed verification with bytes from several endpoints in it, and none is left to suspect: fetching it from one endpoint at a time",
			"digest", d, "endpoints", rep.SourceEndpoints(), "cleared", cleared, "err", cause)
		return nil
	}
	delete(owners, suspect)
	r.corrupt.suspect(d, suspicion{suspect: suspect, cleared: cleared, owners: owners, cause: cause, until: now.Add(corruptMaxWait)})
	r.log.Warn("blob failed verification with bytes from several endpoints in it: fetching the ranges of the one that brought the fewest again from the others",
		"digest", d, "suspect", suspect, "suspect_bytes", drop.Total(), "ranges", len(drop), "cleared", cleared, "err", cause)
	return drop
}

// nextSuspect returns the endpoint among owners, not cleared, that brought
// the fewest bytes of d and that another endpoint can stand in for, and the
// ranges it brought; "" when there is none.
func (r *Registry) nextSuspect(d digest.Digest, owners map[string]spans.Set, cleared []string) (string, spans.Set) {
	var suspect string
	var least int64
	for endpoint, set := range owners {
		if slices.Contains(cleared, endpoint) {
			continue
		}
		if n := set.Total(); suspect == "" || n < least || n == least && endpoint < suspect {
			suspect, least = endpoint, n
		}
	}
	if suspect == "" {
		return "", nil
	}
	now := r.now()
	for _, ep := range r.endpoints {
		if name := ep.url.Redacted(); name != suspect {
			if _, blocked := r.corrupt.blocked(d, name, now); !blocked {
				return suspect, owners[suspect]
			}
		}
	}
	return "", nil
}

// blame records that endpoint served d corrupt.
func (r *Registry) blame(d digest.Digest, endpoint string, cause error, now time.Time) {
	c := r.corrupt.add(d, endpoint, cause, now)
	r.log.Warn("blob failed verification: the endpoint is not asked for it again until its retry time",
		"digest", d, "endpoint", endpoint, "failures_in_a_row", c.failures, "retry_at", c.retryAt.UTC().Format(time.RFC3339),
		"err", cause, "fix", CorruptFix(d))
}

// ReportVerified records that the bytes of d that FetchBlob got (rep is
// its report) verified: whatever its endpoints served corrupt before is
// forgotten. An endpoint suspected for d (see ReportCorrupt) brought none
// of them, and is to blame.
func (r *Registry) ReportVerified(d digest.Digest, rep FetchReport) {
	for _, endpoint := range rep.SourceEndpoints() {
		if cleared := r.corrupt.clear(d, endpoint); len(cleared) > 0 {
			r.log.Info("blob verified from an endpoint that had served it corrupt", "digest", d, "endpoint", endpoint,
				"failures_in_a_row", cleared[0].Failures)
		}
	}
	if s, ok := r.corrupt.takeSuspicion(d, r.now()); ok {
		r.log.Warn("found the endpoint that served a blob corrupt: the ranges it had brought, fetched from the others, verified",
			"digest", d, "endpoint", s.suspect)
		r.blame(d, s.suspect, s.cause, r.now())
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
// was seen when there is none. An endpoint suspected of serving d corrupt
// is left out while others are left.
func (r *Registry) usableFor(repo string, d digest.Digest) ([]*endpoint, error) {
	now := r.now()
	var eps []*endpoint
	var last corruption
	var lastHost string
	suspect := r.corrupt.suspected(d, now)
	for _, ep := range r.endpoints {
		if c, ok := r.corrupt.blocked(d, ep.url.Redacted(), now); ok {
			last, lastHost = c, ep.host
			continue
		}
		eps = append(eps, ep)
	}
	if suspect != "" && len(eps) > 1 {
		eps = slices.DeleteFunc(eps, func(ep *endpoint) bool { return ep.url.Redacted() == suspect })
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
