package upstream

import (
	"fmt"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
)

// corruptMemory is how long an endpoint that served a blob whose bytes
// failed verification is kept away from that blob: long enough that clients
// retrying (containerd at once, kubelet after 10 s doubling to 5 min) do not
// download the same bad bytes again and again, short enough that a blob
// deleted and pushed again upstream is fetched again within the hour.
const corruptMemory = 30 * time.Minute

// corruptBlobs remembers which endpoint served which blob corrupt.
type corruptBlobs struct {
	mu sync.Mutex
	m  map[corruptKey]corruption
}

type corruptKey struct {
	digest   digest.Digest
	endpoint string // as Endpoints names it
}

type corruption struct {
	at    time.Time
	cause error // what verification found
}

func (c *corruptBlobs) add(d digest.Digest, endpoint string, cause error, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[corruptKey]corruption{}
	}
	for k, v := range c.m { // few entries: a corrupt blob is rare
		if now.Sub(v.at) >= corruptMemory {
			delete(c.m, k)
		}
	}
	c.m[corruptKey{d, endpoint}] = corruption{at: now, cause: cause}
}

func (c *corruptBlobs) get(d digest.Digest, endpoint string, now time.Time) (corruption, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.m[corruptKey{d, endpoint}]
	if !ok || now.Sub(v.at) >= corruptMemory {
		return corruption{}, false
	}
	return v, true
}

// ReportCorrupt records that the bytes of d that FetchBlob got from
// endpoint (as FetchBlob returned it) failed verification; cause says what
// was found. For a while FetchBlob then fetches d from the other endpoints
// only, and fails at once, naming the endpoint and the cause, when no other
// is left: a client retrying does not download gigabytes of the same bad
// bytes again.
func (r *Registry) ReportCorrupt(d digest.Digest, endpoint string, cause error) {
	r.corrupt.add(d, endpoint, cause, time.Now())
	r.log.Warn("blob failed verification: the endpoint is not asked for it again for a while",
		"digest", d, "endpoint", endpoint, "for", corruptMemory, "err", cause)
}

// usableFor returns the endpoints not known to serve d corrupt, or an error
// naming what was seen when there is none.
func (r *Registry) usableFor(repo string, d digest.Digest) ([]*endpoint, error) {
	now := time.Now()
	var eps []*endpoint
	var last corruption
	var lastHost string
	for _, ep := range r.endpoints {
		if c, ok := r.corrupt.get(d, ep.url.Redacted(), now); ok {
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
		Message: fmt.Sprintf("served %s corrupt %s ago (%v), and no other endpoint is configured; "+
			"it is not fetched again before %s UTC: delete the blob upstream and push it again",
			d, now.Sub(last.at).Round(time.Second), last.cause, last.at.Add(corruptMemory).UTC().Format(time.TimeOnly))}
}
