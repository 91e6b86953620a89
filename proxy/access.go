package proxy

import (
	"context"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
)

// accessFlushInterval is how often the blobs served from the store since the
// last flush have their access recorded in it (BlobStore.Touch, which itself
// rewrites a record at most hourly). Serving a blob only notes it in memory,
// so a blob's last access is recorded at most this much after it happened,
// and the store is asked about a blob at most once per interval however
// often it is served.
const accessFlushInterval = time.Minute

// accessFlushTimeout bounds recording one flush's accesses.
const accessFlushTimeout = 30 * time.Second

// accesses notes which stored blobs were served since the last flush.
type accesses struct {
	mu     sync.Mutex
	served map[digest.Digest]struct{}
}

func newAccesses() *accesses { return &accesses{served: map[digest.Digest]struct{}{}} }

// note records that d was served. It does not allocate once d is noted.
func (a *accesses) note(d digest.Digest) {
	a.mu.Lock()
	if _, ok := a.served[d]; !ok {
		a.served[d] = struct{}{}
	}
	a.mu.Unlock()
}

// take returns the blobs noted since the last take, and forgets them.
func (a *accesses) take() map[digest.Digest]struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.served) == 0 {
		return nil
	}
	served := a.served
	a.served = make(map[digest.Digest]struct{}, len(served))
	return served
}

// recordAccesses flushes the noted accesses every accessFlushInterval until
// ctx ends, then once more.
func (s *Server) recordAccesses(ctx context.Context) {
	t := time.NewTicker(accessFlushInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			s.flushAccesses()
		case <-ctx.Done():
			s.flushAccesses()
			return
		}
	}
}

// flushAccesses records in the store the accesses noted since the last flush.
func (s *Server) flushAccesses() {
	served := s.accesses.take()
	if len(served) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), accessFlushTimeout)
	defer cancel()
	var failed int
	var firstErr error
	for d := range served {
		if err := s.blobs.Touch(ctx, d); err != nil {
			if failed == 0 {
				firstErr = err
			}
			failed++
		}
	}
	if failed > 0 {
		s.log.Warn("recording blob accesses", "failed", failed, "of", len(served), "err", firstErr)
	}
}
