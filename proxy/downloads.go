package proxy

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/spans"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/storage/content"
	"github.com/pullproxy/pullproxy/upstream"
)

// errShuttingDown refuses new downloads once the server is closing.
var errShuttingDown = errors.New("pullproxy is shutting down")

// errStored tells a joiner that the blob was committed while it looked: serve
// it from the store.
var errStored = errors.New("blob already stored")

// downloads is the table of blobs being fetched from upstream. Each blob is
// fetched once however many clients ask for it; the fetch runs on the
// server's context, not a client's, so it finishes even if every client
// hangs up, and its bytes are committed for the next one.
//
// A download started by background work (upstream.IsBackground, a sync)
// fetches at background priority; once a caller who is not background
// joins it, it is promoted for the rest of its life, mid-fetch: a client
// is never kept waiting at a sync's priority.
type downloads struct {
	srv     *Server
	timeout time.Duration

	mu sync.Mutex
	m  map[digest.Digest]*download
}

type download struct {
	// The upstream and repository it was started for: the blob is known
	// to be there once the upstream starts sending it.
	upstream, repo string

	ready    chan struct{} // closed once partial or err is set
	finished chan struct{} // closed once the download has left the table
	partial  *storage.Partial
	err      error
	// prio is the fetch's: background while only background callers
	// wait on it.
	prio *upstream.Priority
	// alone: fetched without the shared bucket, whose bytes failed
	// verification in the attempt before.
	alone bool
}

func newDownloads(s *Server, timeout time.Duration) *downloads {
	return &downloads{srv: s, timeout: timeout, m: map[digest.Digest]*download{}}
}

// join returns the download of d, starting it from rt's upstream if none is
// running, and whether it is rt's own: started for rt's upstream and
// repository. A download started for another is joined only if d is known
// to be in rt's repository too (see inRepository). It returns errStored if
// d was committed meanwhile.
func (t *downloads) join(ctx context.Context, rt route, d digest.Digest) (content.Reader, bool, error) {
	for {
		t.mu.Lock()
		dl, running := t.m[d]
		if !running {
			dl = newDownload(rt, upstream.IsBackground(ctx))
			t.m[d] = dl
		}
		t.mu.Unlock()
		if !running {
			if err := t.start(ctx, rt, d, dl); err != nil {
				return nil, false, err
			}
			return dl.partial, true, nil
		}
		own := dl.owned(rt)
		if err := t.srv.ownOrInRepository(ctx, rt, d, own); err != nil {
			return nil, false, err
		}
		dl.joined(ctx)
		select {
		case <-dl.ready:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		}
		if dl.err != nil {
			return nil, false, dl.err
		}
		if dl.partial.Err() == nil && !dl.partial.Verified() {
			return dl.partial, own, nil
		}
		// It failed, or it verified and is committing and writing its
		// records before it leaves the table: wait, then look again. A
		// committed blob is then served from the store, or fetched anew if
		// it is no longer there (found damaged and quarantined since the
		// commit); a failed download starts afresh from the bytes it kept.
		select {
		case <-dl.finished:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		}
	}
}

// newDownload returns a download for rt, at background priority if
// background.
func newDownload(rt route, background bool) *download {
	return &download{upstream: rt.up.Name(), repo: rt.repo, ready: make(chan struct{}), finished: make(chan struct{}),
		prio: upstream.NewPriority(background)}
}

// joined records that a caller with ctx waits on dl: one that is not
// background promotes it.
func (dl *download) joined(ctx context.Context) {
	if !upstream.IsBackground(ctx) {
		dl.prio.Promote()
	}
}

// owned reports whether the download was started for rt's upstream and repository.
func (dl *download) owned(rt route) bool {
	return dl.upstream == rt.up.Name() && dl.repo == rt.repo
}

// start opens the partial download of d claimed by dl and runs it.
func (t *downloads) start(ctx context.Context, rt route, d digest.Digest, dl *download) error {
	// A download that ended between the caller's store lookup and our
	// claim committed the blob before leaving the table: look again.
	if _, err := t.srv.blobs.StatBlob(ctx, d); err == nil {
		dl.err = errStored
	} else {
		// The size a manifest declared, when one was served: the upstream's
		// own claim is then checked against it.
		size, err := t.srv.blobs.DeclaredSize(ctx, rt.up.Name(), rt.repo, d)
		if err != nil {
			size = -1
		}
		dl.partial, dl.err = t.srv.blobs.NewPartial(ctx, d, size)
	}
	if dl.err == nil && !t.srv.track() {
		dl.partial.Abandon(errShuttingDown)
		dl.err = errShuttingDown
	}
	close(dl.ready)
	if dl.err != nil {
		t.remove(d, dl)
		return dl.err
	}
	go t.run(rt, dl)
	return nil
}

// run fetches the blob, commits it if it verifies, and leaves the table.
func (t *downloads) run(rt route, dl *download) {
	defer t.srv.wg.Done()
	p := dl.partial
	d := p.Digest()
	ctx, cancel := context.WithTimeout(upstream.WithPriority(t.srv.ctx, dl.prio), t.timeout)
	defer cancel()
	start := time.Now()
	log := t.srv.log.With("upstream", rt.up.Name(), "repo", rt.repo, "digest", d)
	resumed := p.Written()
	log.Info("blob download started", "resumed_at", resumed, "background", dl.prio.Background())

	var report upstream.FetchReport
	fetch := func(ctx context.Context) (err error) {
		report, err = rt.up.FetchBlob(ctx, rt.repo, d, p)
		return err
	}
	var shared *bucket.Fetch
	source := bucket.SourceUpstream
	var err error
	if sb := t.srv.sharedBlobs; sb != nil && !dl.alone {
		// Bytes from the bucket were fetched for some repository: they
		// are served for rt's only once it is known to hold them.
		confirm := func(ctx context.Context) error { return t.srv.inRepository(ctx, rt, kindBlob, d) }
		shared, err = sb.Fetch(ctx, p, confirm, fetch)
		if shared != nil {
			source = shared.Source
		}
	} else {
		err = fetch(ctx)
	}
	served := report.Endpoint
	reported := false  // the mismatch was reported to the upstream
	var redo spans.Set // what is fetched again, the rest being kept
	switch {
	case err == nil:
		err = p.Verify()
		if errors.Is(err, storage.ErrDigestMismatch) && !errors.Is(err, storage.ErrChangedOnDisk) && !shared.FromBucket() && served != "" {
			// The upstream remembers, and asks the endpoint to blame no
			// more for d; with bytes from several, it names the ranges of
			// the one it suspects.
			redo, reported = rt.up.ReportCorrupt(d, report, err), true
		}
		switch {
		case err == nil:
			err = p.Commit(ctx)
		case len(redo) > 0:
			if rerr := p.Retract(redo, err); rerr != nil {
				log.Warn("blob failed verification, and its other bytes could not be kept: fetching it whole again", "err", rerr)
				redo = nil
			}
		default:
			p.Fail(err)
		}
	case keepPartial(err):
		p.Abandon(err) // the next download of d resumes from here
	default:
		p.Fail(err)
	}
	mismatch := (errors.Is(err, storage.ErrDigestMismatch) || errors.Is(err, storage.ErrSizeMismatch)) && !errors.Is(err, storage.ErrChangedOnDisk)
	badShared := mismatch && shared.FromBucket()
	if badShared {
		// Bytes from the bucket were in it: the upstream is not to blame.
		// A download without the bucket takes this one's place at once, so
		// that a client asking while Finish removes the bad copy joins it
		// rather than starting one that reads that copy again.
		log.Warn("blob failed verification with bytes from the shared bucket in it: fetching it again from the upstream alone", "err", err)
		t.restartWith(rt, d, true, dl, dl.prio.Background())
	} else {
		t.remove(d, dl)
	}
	// The blob's clients have it now; sharing it can take a while (its
	// last part, then its assembly in the bucket).
	shared.Finish(ctx, err)

	if mismatch {
		t.srv.metrics.verifyFailures.WithLabelValues(rt.up.Name()).Inc()
	}
	if badShared {
		return
	}
	if reported && len(rt.up.Endpoints()) > 1 {
		// Another endpoint may hold it intact. Clients of this attempt
		// got a short read; when they ask again they join the new download.
		if len(redo) > 0 {
			log.Warn("blob failed verification: fetching the ranges of the endpoint suspected again from the others, keeping the rest",
				"err", err, "sources", report.SourceEndpoints(), "refetch_bytes", redo.Total(), "kept_bytes", p.Size()-redo.Total())
		} else {
			log.Warn("blob failed verification: fetching it again, from another endpoint or one at a time", "err", err,
				"corrupt_at", report.SourceEndpoints())
		}
		t.restart(rt, d, dl.prio.Background())
		return
	}
	if err != nil {
		t.srv.metrics.fetches.WithLabelValues(rt.up.Name(), "failed").Inc()
		attrs := append([]any{"err", err, "duration", time.Since(start).Round(time.Millisecond)}, fetchAttrs(report)...)
		if h := cmp.Or(corruptFix(err, d), hint(err)); h != "" {
			attrs = append(attrs, "fix", h)
		}
		log.Warn("blob download failed", attrs...)
		return
	}
	if served != "" {
		// The endpoint serves d intact (again): it is asked for d freely.
		rt.up.ReportVerified(d, report)
	}
	t.srv.addMember(ctx, rt, d)
	t.srv.metrics.fetches.WithLabelValues(rt.up.Name(), "committed").Inc()
	took := time.Since(start)
	fetched := p.Size() - resumed
	log.Info("blob download committed", append([]any{"bytes", p.Size(), "fetched_bytes", fetched,
		"duration", took.Round(time.Millisecond), "goodput_bytes_per_second", int64(float64(fetched) / max(took.Seconds(), 1e-3)),
		"endpoint", served, "source", source}, fetchAttrs(report)...)...)
}

// fetchAttrs are the log attributes of how a download went: chunks
// answered whole, chunk requests made again (each refused or cut one),
// refused, and cut by kind (the path's doing), the endpoints tried, and
// what the upstream sent that the blob did not keep (see
// upstream.FetchReport): what a carrier bills beyond fetched_bytes.
func fetchAttrs(r upstream.FetchReport) []any {
	cuts, retries := "none", r.Failed
	for _, n := range r.Cuts {
		retries += n
	}
	if len(r.Cuts) > 0 {
		var b strings.Builder
		for _, kind := range slices.Sorted(maps.Keys(r.Cuts)) {
			if b.Len() > 0 {
				b.WriteByte(' ')
			}
			fmt.Fprintf(&b, "%s=%d", kind, r.Cuts[kind])
		}
		cuts = b.String()
	}
	attrs := []any{"chunks", r.Chunks, "retries", retries, "chunks_refused", r.Failed, "cuts", cuts, "endpoints_tried", r.Endpoints,
		"hedges", r.Hedges, "splits", r.Splits, "overtaken", r.Overtaken, "abandoned", r.Abandoned,
		"discarded_bytes", r.DiscardedBytes, "abandoned_bytes", r.AbandonedBytes}
	if len(r.Sources) > 1 {
		var b strings.Builder
		for _, s := range r.Sources {
			if b.Len() > 0 {
				b.WriteByte(' ')
			}
			fmt.Fprintf(&b, "%s=%d", s.Endpoint, s.Bytes)
		}
		attrs = append(attrs, "source_bytes", b.String())
	}
	return attrs
}

// restart starts a new download of d unless one is already running, at
// background priority if background (as the attempt it follows).
func (t *downloads) restart(rt route, d digest.Digest, background bool) {
	t.restartWith(rt, d, false, nil, background)
}

// restartWith starts a new download of d, without the shared bucket if
// alone, at background priority if background, unless one other than
// ended is running. The new download takes ended's place in the table
// (nil: none to replace), as remove would end it.
func (t *downloads) restartWith(rt route, d digest.Digest, alone bool, ended *download, background bool) {
	t.mu.Lock()
	if cur, running := t.m[d]; running && cur != ended {
		t.mu.Unlock()
		if ended != nil {
			t.remove(d, ended)
		}
		return
	}
	dl := newDownload(rt, background)
	dl.alone = alone
	t.m[d] = dl
	t.mu.Unlock()
	if ended != nil {
		close(ended.finished)
	}
	if err := t.start(t.srv.ctx, rt, d, dl); err != nil && !errors.Is(err, errStored) {
		t.srv.log.Warn("restarting a blob download", "digest", d, "err", err)
	}
}

func (t *downloads) remove(d digest.Digest, dl *download) {
	t.mu.Lock()
	if t.m[d] == dl {
		delete(t.m, d)
	}
	t.mu.Unlock()
	close(dl.finished)
}

// running returns how many downloads are in progress.
func (t *downloads) running() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// has reports whether a download of d is in progress.
func (t *downloads) has(d digest.Digest) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[d] != nil
}

// lookup returns the running download of d, if any, without starting one,
// and whether it is rt's own (see join). The caller, with ctx, waits on
// it: a caller not background promotes it.
func (t *downloads) lookup(ctx context.Context, rt route, d digest.Digest) (content.Reader, bool) {
	t.mu.Lock()
	dl := t.m[d]
	t.mu.Unlock()
	if dl == nil {
		return nil, false
	}
	select {
	case <-dl.ready:
		if dl.partial != nil { // not a typed nil in the interface
			dl.joined(ctx)
			return dl.partial, dl.owned(rt)
		}
	default:
	}
	return nil, false
}

// keepPartial tells whether the bytes of a failed download are worth keeping
// for the next attempt: yes when the upstream or the network failed, no when
// the content itself is in doubt or does not exist.
func keepPartial(err error) bool {
	return !errors.Is(err, upstream.ErrInvalid) && !errors.Is(err, upstream.ErrNotFound) &&
		!errors.Is(err, storage.ErrSizeMismatch) && !errors.Is(err, storage.ErrDigestMismatch)
}
