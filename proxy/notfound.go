package proxy

import (
	"sync"
	"time"
)

// notFound remembers, briefly, what upstreams said they do not have: a tag
// or a manifest asked for again within the TTL gets the same 404 without a
// request upstream. A pod in a crash loop with a mistyped tag, on every
// node, would otherwise spend the site's Docker Hub allowance on 404s.
type notFound struct {
	ttl time.Duration // 0: nothing is remembered

	mu      sync.Mutex
	entries map[string]notFoundEntry
}

type notFoundEntry struct {
	err   error // the upstream's answer, as the first client got it
	until time.Time
}

// notFoundMax bounds the entries kept: past it, expired ones are dropped,
// and if none is, nothing more is remembered until some expire.
const notFoundMax = 10000

func newNotFound(ttl time.Duration) *notFound {
	return &notFound{ttl: ttl, entries: map[string]notFoundEntry{}}
}

// get returns the error remembered for key, if it is still fresh.
func (n *notFound) get(key string) (error, bool) {
	if n.ttl <= 0 {
		return nil, false
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	e, ok := n.entries[key]
	if !ok {
		return nil, false
	}
	if time.Now().After(e.until) {
		delete(n.entries, key)
		return nil, false
	}
	return e.err, true
}

// put remembers err for key for the TTL.
func (n *notFound) put(key string, err error) {
	if n.ttl <= 0 {
		return
	}
	now := time.Now()
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.entries) >= notFoundMax {
		for k, e := range n.entries {
			if now.After(e.until) {
				delete(n.entries, k)
			}
		}
		if len(n.entries) >= notFoundMax {
			return
		}
	}
	n.entries[key] = notFoundEntry{err: err, until: now.Add(n.ttl)}
}
