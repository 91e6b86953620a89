package upstream

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/pullproxy/pullproxy/storage/content"
	"github.com/pullproxy/pullproxy/upstream/plan"
	"golang.org/x/sync/errgroup"
)

// FetchBlob writes blob d of repo into w as HTTP Range requests (chunks),
// several at once, on connections that each carry at most the endpoint's
// connection budget (see lane). A chunk cut short is re-requested from its
// first missing byte; an endpoint that keeps failing is left for the next
// one. It returns the endpoint (as Endpoints names it) that completed the
// blob. The digest is not checked here: w's owner does that once every
// byte is in, and reports a mismatch with ReportCorrupt.
func (r *Registry) FetchBlob(ctx context.Context, repo string, d digest.Digest, w content.Writer) (FetchReport, error) {
	var stats fetchStats
	eps, err := r.usableFor(repo, d)
	if err != nil {
		return stats.report(""), err
	}
	eps = r.ordered(eps)
	for i, ep := range eps {
		stats.endpoints++
		f := &blobFetch{r: r, ep: ep, repo: repo, digest: d, w: w, stats: &stats, finished: make(chan struct{})}
		if err = f.run(ctx); err == nil {
			ep.markUp()
			return stats.report(ep.url.Redacted()), nil
		}
		if ctx.Err() != nil {
			return stats.report(""), err
		}
		if errors.Is(err, ErrUnavailable) && len(r.endpoints) > 1 {
			ep.markFailed(r, err)
		}
		if i+1 < len(eps) {
			r.log.Warn("blob fetch failed on an endpoint, trying the next", "digest", d,
				"endpoint", ep.host, "next", eps[i+1].host, "err", err)
		}
	}
	if len(eps) > 1 {
		return stats.report(""), fmt.Errorf("fetching %s: every endpoint failed, the last with: %w", d, err)
	}
	return stats.report(""), err
}

// FetchReport is what fetching one blob took, for the line the download
// logs: where it came from, and how the path treated it.
type FetchReport struct {
	Endpoint  string // the endpoint that served it whole; "" if none did
	Endpoints int    // endpoints tried
	Chunks    int64  // chunk requests answered to their end
	Failed    int64  // chunk requests that got no byte (refused, unreachable)
	// Cuts counts the connections that died mid-answer, by kind: reset,
	// eof, stall, slow, error.
	Cuts map[string]int64
	// Hedges counts chunks asked for again while their first request was
	// still open (see plan.HedgeAfter); Overtaken the requests that gave
	// way to another for the same bytes; Abandoned those pullproxy hung up
	// on mid-answer as no longer needed (the fetch ended). One too slow is
	// a cut of kind slow.
	Hedges, Overtaken, Abandoned int64
	// DiscardedBytes and AbandonedBytes are what the upstream sent, or may
	// have sent, that the blob did not keep (see waste): a carrier bills
	// them.
	DiscardedBytes, AbandonedBytes int64
}

// fetchStats accumulates a FetchReport across a blob's workers and endpoints.
type fetchStats struct {
	mu        sync.Mutex
	endpoints int
	chunks    int64
	failed    int64
	cuts      map[string]int64
	hedges    int64
	waste     waste // summed over the blob's requests
	overtaken int64
	abandoned int64
}

func (s *fetchStats) chunk(result, cutKind string) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch result {
	case "complete":
		s.chunks++
	case "failed":
		s.failed++
	case "cut":
		if s.cuts == nil {
			s.cuts = map[string]int64{}
		}
		s.cuts[cutKind]++
	case "overtaken":
		s.overtaken++
	case "abandoned":
		s.abandoned++
	case "hedged":
		s.hedges++
	}
}

// wasted adds what one request cost beyond the bytes it kept.
func (s *fetchStats) wasted(w waste) {
	if s == nil || w == (waste{}) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waste.discarded += w.discarded
	s.waste.abandoned += w.abandoned
}

func (s *fetchStats) report(endpoint string) FetchReport {
	s.mu.Lock()
	defer s.mu.Unlock()
	return FetchReport{Endpoint: endpoint, Endpoints: s.endpoints, Chunks: s.chunks, Failed: s.failed, Cuts: maps.Clone(s.cuts),
		Hedges: s.hedges, Overtaken: s.overtaken, Abandoned: s.abandoned,
		DiscardedBytes: s.waste.discarded, AbandonedBytes: s.waste.abandoned}
}

// blobFetch is one blob being fetched from one endpoint. Which chunk comes
// next is the planner's to decide (see package plan); blobFetch runs the
// workers that fetch them, and tells the planner what became of each.
type blobFetch struct {
	r      *Registry
	ep     *endpoint
	repo   string
	digest digest.Digest
	w      content.Writer
	stats  *fetchStats // shared by the blob's endpoints; nil: not kept

	mu       sync.Mutex
	planner  plan.Planner  // the blob's chunks: claimed, in flight, hedged
	sized    chan struct{} // while the size is unknown: closed when the chunk learning it is released
	location *url.URL      // where the registry redirected blob GETs: reused until refused
	failures int           // attempts in a row without a new byte
	warned   bool          // the size disagreement was logged

	workers      int           // fetching chunks at once at most
	hedges       atomic.Int32  // chunks claimed again (see plan.Chunk.Hedge): requests may race for the same bytes
	size         atomic.Int64  // the blob's size once known, for left; 0: not yet
	written      atomic.Int64  // bytes written, a re-sent byte again
	finished     chan struct{} // closed once every byte is written: workers waiting for a lane or a retry end
	finishedOnce sync.Once
	cancel       context.CancelFunc // ends the workers' requests once finished
}

// left is about how many of the blob's bytes are still to arrive (a byte
// sent again counts as arrived twice), or MaxInt64 while the size is
// unknown. The pipe asks it under its lock, for every waiter: it takes the
// writer's lock only until the size is known.
func (f *blobFetch) left() int64 {
	size := f.size.Load()
	if size <= 0 && f.w != nil {
		if size = f.w.Size(); size > 0 {
			f.size.Store(size)
		}
	}
	if size <= 0 {
		return math.MaxInt64
	}
	return size - f.written.Load()
}

// run fetches the blob with as many workers as the endpoint's pipe may let
// through at once (or ParallelChunks, where set); the pipe decides how many
// actually run.
func (f *blobFetch) run(ctx context.Context) error {
	if err := f.learnSize(ctx); err != nil {
		return err
	}
	workers := f.r.fetch.MaxConnections
	if f.r.fetch.ParallelChunks > 0 {
		workers = min(workers, f.r.fetch.ParallelChunks)
	}
	f.workers = workers
	g, gctx := errgroup.WithContext(ctx)
	wctx, cancel := context.WithCancel(gctx)
	defer cancel()
	f.cancel = cancel
	for id := range workers {
		g.Go(func() error {
			err := f.worker(wctx, id+1)
			if f.isFinished() {
				return nil // every byte is in: requests ended with it do not count
			}
			return err
		})
	}
	return g.Wait()
}

// learnSize asks the endpoint for the blob's size with a HEAD, so that every
// chunk can ask for a range inside the blob (some registries refuse a range
// that runs past the end). Where HEAD gives no answer the first chunk does.
//
// A size a manifest declared needs no HEAD: the chunks ask for ranges
// inside it at once, and each answer's Content-Range (or a refused range's)
// is checked against it. The HEAD held every chunk back by its round trip,
// and by its connection's set-up and its redirect's on a cold start: about
// 150 ms of a pull at a 40 ms round trip, with the link idle.
func (f *blobFetch) learnSize(ctx context.Context) error {
	if f.w.Size() >= 0 && !f.complete() {
		return nil
	}
	q := request{method: http.MethodHead, repo: f.repo, path: "blobs/" + f.digest.String()}
	resp, err := f.r.send(ctx, f.ep, q)
	if err != nil {
		if errors.Is(err, ErrUnavailable) && ctx.Err() == nil {
			return nil // the first chunk learns the size, with the usual retries
		}
		return err
	}
	resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusOK && resp.ContentLength >= 0:
		return f.checkSize(resp.ContentLength, responseHost(resp))
	case resp.StatusCode == http.StatusTooManyRequests:
		return f.r.statusError(f.ep.host, q.op(), resp) // asking again adds to the count
	case resp.StatusCode >= 400 && resp.StatusCode < 500 && f.complete():
		// Every byte is in already (a download resumed after a crash in
		// its commit): no chunk will ask, so this refusal is the answer,
		// and the bytes are not the repository's.
		return f.r.statusError(f.ep.host, q.op(), resp)
	}
	// A refusal (404, 401, 403) comes again with the first chunk's GET,
	// whose body, unlike a HEAD's, gives the upstream's reason for it.
	return nil
}

// complete reports whether the writer holds every byte of a blob of known size.
func (f *blobFetch) complete() bool {
	if f.w.Size() < 0 {
		return false
	}
	start, end := f.w.Missing(0)
	return start == end
}

// checkSize compares the size the upstream claims with the size expected.
// A larger claim is logged and the declared bytes are fetched: ranges inside
// the declared size still yield the right content when an upload was stored
// twice. A smaller one cannot be right.
func (f *blobFetch) checkSize(claimed int64, host string) error {
	if claimed == 0 && f.digest != f.digest.Algorithm().FromBytes(nil) {
		// An empty blob would be "complete" before any check could run.
		return &Error{Upstream: f.r.name, Endpoint: host, Op: "GET /v2/" + f.repo + "/blobs/" + f.digest.String(),
			Kind: ErrInvalid, Message: fmt.Sprintf("the upstream says %s is empty, which it cannot be", f.digest)}
	}
	declared := f.w.Size()
	if declared < 0 {
		return f.w.SetSize(claimed)
	}
	if claimed == declared {
		return nil
	}
	if claimed < declared {
		return &Error{Upstream: f.r.name, Endpoint: host, Op: "GET /v2/" + f.repo + "/blobs/" + f.digest.String(),
			Kind: ErrInvalid, Message: fmt.Sprintf("the upstream holds %s as %d bytes, fewer than the %d the manifest declares",
				f.digest, claimed, declared)}
	}
	f.mu.Lock()
	warned := f.warned
	f.warned = true
	f.mu.Unlock()
	if !warned {
		f.r.log.Warn(SizeMismatchMessage(f.digest, claimed, declared), "endpoint", host, "repo", f.repo)
	}
	return nil
}

// SizeMismatchMessage says what an upstream holding d as claimed bytes,
// where a manifest declares declared, means, and what to do: an exact
// multiple is a blob stored several times over.
func SizeMismatchMessage(d digest.Digest, claimed, declared int64) string {
	if declared > 0 && claimed%declared == 0 {
		times := "twice"
		if k := claimed / declared; k != 2 {
			times = strconv.FormatInt(k, 10) + " times"
		}
		return fmt.Sprintf("the upstream holds %s as %d bytes, exactly %s the %d the manifest declares: "+
			"it was stored %s (overlapping uploads); delete and re-push it upstream", d, claimed, times, declared, times)
	}
	return fmt.Sprintf("the upstream holds %s as %d bytes, but the manifest declares %d: fetching the declared bytes; "+
		"if they fail the digest check, the upstream copy is corrupt: delete and re-push it", d, claimed, declared)
}

// worker fetches chunks until none is left to claim. It claims a chunk only
// once the pipe gives it a lane, so that the chunk is the one most wanted at
// the time its request goes out, sized to the lane's connection.
func (f *blobFetch) worker(ctx context.Context, id int) error {
	pipe := f.ep.pipe
	for {
		l, err := pipe.acquire(ctx, f)
		if errors.Is(err, errFinished) {
			return nil
		}
		if err != nil {
			return err
		}
		how := l.plan(f.ep, f.target())
		c, ok, wait := f.claim(time.Now(), how, pipe.free())
		if !ok {
			if how.probe != nil {
				how.probe.failed()
			}
			pipe.release(f, l, 0)
			if wait == nil {
				d := f.watch(id)
				if d == 0 {
					return nil
				}
				select { // chunks in flight are watched for one gone silent
				case <-time.After(d):
					continue
				case <-f.finished:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			select { // the first chunk is learning the size
			case <-wait:
				continue
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		start := time.Now()
		n, err := f.fetchChunk(ctx, l, c, how)
		if err != nil && !errors.Is(err, ErrUnavailable) {
			f.stop() // before the chunk is free to claim again: asking again would not help
		}
		f.release(c)
		pipe.release(f, l, time.Since(start))
		if err == nil {
			f.progress()
			f.checkFinished()
			continue
		}
		if f.isFinished() {
			return nil // another brought the rest, and this request was ended
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !errors.Is(err, ErrUnavailable) {
			return err // not found, refused, invalid: retrying will not help
		}
		if n > 0 && !errors.Is(err, errTooSlow) {
			// A cut after bytes came: the rest is asked for at once, on
			// another connection, as the path allows (see pipe).
			f.progress()
			f.checkFinished()
			continue
		}
		// A trickle brings bytes, but is no progress to keep trying on.
		attempts := f.failed()
		if attempts >= f.r.fetch.MaxAttempts {
			what := "brought no byte"
			if errors.Is(err, errTooSlow) {
				what = "were too slow (min_goodput)"
			}
			return fmt.Errorf("fetching %s from %s: %d attempts in a row %s: %w",
				f.digest, f.ep.host, attempts, what, err)
		}
		select {
		case <-time.After(backoff(attempts)):
		case <-f.finished: // the other workers brought the rest
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// errFinished ends a wait for a lane: the blob is complete.
var errFinished = errors.New("blob complete")

// checkFinished closes finished once the blob is complete, so that the
// workers waiting for a lane or to try again end at once, and ends the
// requests still in flight (a silent one whose rest another brought):
// FetchBlob returns, and the blob is committed and its held-back end
// served, only once every worker has.
func (f *blobFetch) checkFinished() {
	if f.complete() {
		f.finishedOnce.Do(func() {
			close(f.finished)
			if f.cancel != nil {
				f.cancel()
			}
		})
	}
}

func (f *blobFetch) isFinished() bool {
	select {
	case <-f.finished:
		return true
	default:
		return false
	}
}

// watch makes worker id, which found nothing to claim, the one that
// watches the chunks in flight for one gone silent (see plan.Planner.Watch),
// unless another does. It returns how long to wait before looking again,
// or 0 when the worker is done.
func (f *blobFetch) watch(id int) time.Duration {
	after := f.hedgeAfter()
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.planner.Watch(id, after)
}

// target is where the next chunk's request goes: the registry's redirect
// target while it is accepted, else the registry.
func (f *blobFetch) target() *url.URL {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.location != nil {
		return f.location
	}
	return f.ep.url
}

// claim asks the planner, at now, for the next chunk to fetch on a
// connection sized as how says, with free more slots of the pipe free (see
// plan.Planner.Claim). When there is nothing to claim yet but may be soon
// (the size is being learned), it returns a channel to wait on.
func (f *blobFetch) claim(now time.Time, how chunkPlan, free int) (plan.Chunk, bool, <-chan struct{}) {
	src := plan.Source{Free: free, Workers: f.workers, HedgeAfter: f.hedgeAfter()}
	conn := plan.Conn{Size: how.size, Room: how.room, Several: how.several}
	f.mu.Lock()
	defer f.mu.Unlock()
	b := plan.Blob{Size: f.w.Size(), Written: f.w}
	if b.Size >= 0 {
		b.Wanted = f.w.Wanted() // nil unless readers wait: no allocation per chunk
	}
	c, got := f.planner.Claim(now, b, src, conn)
	switch got {
	case plan.Wait:
		return c, false, f.sized
	case plan.None:
		return c, false, nil
	}
	if c.Sizing {
		f.sized = make(chan struct{})
	}
	if c.Hedge {
		f.hedges.Add(1)
		f.stats.chunk("hedged", "")
	}
	return c, true, nil
}

// hedgeAfter is how long a chunk in flight may bring nothing before its
// rest is asked for again (see plan.HedgeAfter).
func (f *blobFetch) hedgeAfter() time.Duration {
	var first time.Duration
	if d := f.r.dialer; d != nil {
		first = d.newConnFirstByte(f.ep.key)
	}
	return plan.HedgeAfter(first, f.r.fetch.StallTimeout)
}

// release tells the planner chunk c is over: what it left unwritten is
// free to claim again.
func (f *blobFetch) release(c plan.Chunk) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.planner.Release(c)
	if c.Sizing {
		close(f.sized)
	}
}

// attach records that the request for chunk c went out on conn, so that the
// planner can tell a silent path from a reader that lags. After a redirect
// the target's connection, which carries the body, replaces the registry's.
func (f *blobFetch) attach(c plan.Chunk, conn *chunkConn) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.planner.Attach(c.ID, conn)
}

// stop ends the claiming of chunks: one failed in a way that asking again
// would not change.
func (f *blobFetch) stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.planner.Stop()
}

// unclaimed reports whether some of the blob is neither written nor claimed.
func (f *blobFetch) unclaimed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.planner.Unclaimed(plan.Blob{Size: f.w.Size(), Written: f.w})
}

// progress resets the count of fruitless attempts; failed adds one and
// returns the count.
func (f *blobFetch) progress() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failures = 0
}

func (f *blobFetch) failed() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failures++
	return f.failures
}

// backoff is a jittered exponential delay: 100 ms doubling to 5 s.
func backoff(attempt int) time.Duration {
	d := min(100*time.Millisecond<<min(attempt, 6), 5*time.Second)
	return d/2 + rand.N(d/2+1)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
