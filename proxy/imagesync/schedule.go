package imagesync

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/proxy"
	"github.com/pullproxy/pullproxy/upstream"
)

// jitter spreads d by a tenth either way, so that rules and replicas
// started together do not ask the upstream at the same moment.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d - d/10 + time.Duration(rand.Int64N(int64(d/5)+1))
}

// backoff is the wait after failures rounds failed in a row: an eighth of
// the interval (1 s to 1 min) doubled at each failure, up to the interval;
// longer when the upstream said how long to wait (Retry-After); the
// interval while holding off for the rate-limit window.
func backoff(interval time.Duration, failures int, err error) time.Duration {
	if errors.Is(err, ErrHoldingOff) {
		return jitter(interval) // the window refills at its own pace
	}
	base := min(max(interval/8, time.Second), time.Minute)
	wait := min(base<<min(max(failures-1, 0), 16), interval)
	var ue *upstream.Error
	if errors.As(err, &ue) && ue.RetryAfter > wait {
		return ue.RetryAfter + time.Duration(rand.Int64N(int64(ue.RetryAfter/10)+1))
	}
	return jitter(wait)
}

// ErrHoldingOff refuses a sync fetch while the upstream's rate-limit
// window is nearly spent: what is left is for clients.
var ErrHoldingOff = errors.New("holding off: the upstream's rate-limit window is nearly spent")

// PullsLeftGuard returns a fetch guard (see WithFetchGuard) that refuses
// while an upstream's rate-limit window, as its last answer told
// (pullsLeft: Docker Hub's ratelimit-remaining and ratelimit-limit), has
// a tenth of its pulls left or less, and at least 5: those are for
// clients. The HEADs a round makes are not pulls, and are not held.
func PullsLeftGuard(pullsLeft func(upstreamName string) (left, limit int64, known bool)) func(context.Context, string) error {
	return func(ctx context.Context, upstreamName string) error {
		left, limit, known := pullsLeft(upstreamName)
		if known && left <= max(limit/10, 5) {
			return fmt.Errorf("%w (%d of %d pulls left)", ErrHoldingOff, left, limit)
		}
		return nil
	}
}

// fix says what an operator does about a failed round.
func fix(err error) string {
	switch {
	case errors.Is(err, upstream.ErrTooManyRequests), errors.Is(err, ErrHoldingOff):
		return "the upstream is rate limiting: rounds wait as it says; authenticate to it for a higher limit, or lengthen the rule's interval"
	case errors.Is(err, upstream.ErrUnauthorized), errors.Is(err, upstream.ErrDenied):
		return "check the upstream's credentials and that they may read the repository (pullproxy doctor); a prefix rule needs the catalog, which many registries refuse"
	case errors.Is(err, upstream.ErrNotFound):
		return "the repository or tag is not at the upstream: check the rule"
	case errors.Is(err, upstream.ErrUnavailable):
		return "the upstream did not answer: the next round tries again; pullproxy doctor checks the path"
	}
	return "pullproxy doctor checks the upstream; the next round tries again"
}

// countingCore is the core as a round uses it: each image's fetch asked
// of the guard first, pinned while it runs, marked as background work, and
// its bytes counted.
type countingCore struct {
	Core
	guard    func(ctx context.Context, upstreamName string) error
	wrap     func(context.Context) context.Context
	fetching func(Image) // told of each image before its fetch starts
	fetched  atomic.Int64
}

func (c *countingCore) Seed(ctx context.Context, upstreamName, repo, ref string, opts proxy.SeedOptions) (digest.Digest, error) {
	if c.guard != nil {
		if err := c.guard(ctx, upstreamName); err != nil {
			return "", err
		}
	}
	if c.wrap != nil {
		ctx = c.wrap(ctx)
	}
	if d, err := digest.Parse(ref); err == nil && c.fetching != nil {
		c.fetching(Image{Upstream: upstreamName, Repository: repo, Digest: d})
	}
	progress := &proxy.SeedProgress{}
	opts.Progress = progress
	d, err := c.Core.Seed(ctx, upstreamName, repo, ref, opts)
	c.fetched.Add(progress.BytesFetched.Load())
	return d, err
}
