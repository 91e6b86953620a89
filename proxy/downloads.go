package proxy

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
)

// errStored tells a joiner that the blob was committed while it looked: serve
// it from the store.
var errStored = errors.New("blob already stored")

// downloads is the table of blobs being fetched from upstream. Each blob is
// fetched once however many clients ask for it; the fetch runs on the
// server's context, not a client's, so it finishes even if every client
// hangs up, and its bytes are committed for the next one.
type downloads struct {
	srv     *Server
	timeout time.Duration

	mu sync.Mutex
	m  map[digest.Digest]*download
}

type download struct {
	ready   chan struct{} // closed once partial or err is set
	partial *storage.Partial
	err     error
}

func newDownloads(s *Server, timeout time.Duration) *downloads {
	return &downloads{srv: s, timeout: timeout, m: map[digest.Digest]*download{}}
}

// join returns the download of d, starting it from rt's upstream if none is
// running. It returns errStored if d was committed meanwhile.
func (t *downloads) join(ctx context.Context, rt route, d digest.Digest) (*storage.Partial, error) {
	t.mu.Lock()
	dl, running := t.m[d]
	if !running {
		dl = &download{ready: make(chan struct{})}
		t.m[d] = dl
	}
	t.mu.Unlock()

	if running {
		select {
		case <-dl.ready:
			return dl.partial, dl.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}

	// A download that ended between the caller's store lookup and our
	// claim committed the blob before leaving the table: look again.
	if _, err := t.srv.store.StatBlob(ctx, d); err == nil {
		dl.err = errStored
	} else {
		dl.partial, dl.err = t.srv.store.NewPartial(ctx, d, -1)
	}
	close(dl.ready)
	if dl.err != nil {
		t.remove(d, dl)
		return nil, dl.err
	}
	t.srv.wg.Add(1)
	go t.run(rt, dl)
	return dl.partial, nil
}

// run fetches the blob, commits it if it verifies, and leaves the table.
func (t *downloads) run(rt route, dl *download) {
	defer t.srv.wg.Done()
	p := dl.partial
	d := p.Digest()
	ctx, cancel := context.WithTimeout(t.srv.ctx, t.timeout)
	defer cancel()
	start := time.Now()
	log := t.srv.log.With("upstream", rt.up.Name(), "repo", rt.repo, "digest", d)
	log.Info("blob download started")

	err := rt.up.FetchBlob(ctx, rt.repo, d, p)
	if err == nil {
		err = p.Commit(ctx)
	} else {
		p.Fail(err)
	}
	t.remove(d, dl)

	if err != nil {
		t.srv.metrics.fetches.WithLabelValues(rt.up.Name(), "failed").Inc()
		attrs := []any{"err", err, "bytes", p.Written(), "duration", time.Since(start).Round(time.Millisecond)}
		if h := hint(err); h != "" {
			attrs = append(attrs, "fix", h)
		}
		log.Warn("blob download failed", attrs...)
		return
	}
	t.srv.metrics.fetches.WithLabelValues(rt.up.Name(), "committed").Inc()
	log.Info("blob download committed", "bytes", p.Size(), "duration", time.Since(start).Round(time.Millisecond))
}

func (t *downloads) remove(d digest.Digest, dl *download) {
	t.mu.Lock()
	if t.m[d] == dl {
		delete(t.m, d)
	}
	t.mu.Unlock()
}

// lookup returns the running download of d, if any, without starting one.
func (t *downloads) lookup(d digest.Digest) *storage.Partial {
	t.mu.Lock()
	dl := t.m[d]
	t.mu.Unlock()
	if dl == nil {
		return nil
	}
	select {
	case <-dl.ready:
		return dl.partial
	default:
		return nil
	}
}
