package upstream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/spans"
	"github.com/pullproxy/pullproxy/storage/content"
	"github.com/pullproxy/pullproxy/upstream/plan"
)

// FetchBlob writes blob d of repo into w as HTTP Range requests (chunks),
// several at once, on connections that each carry at most the endpoint's
// connection budget (see lane). A chunk cut short is re-requested from its
// first missing byte. Every endpoint that holds the upstream's content (all
// but those kept for failover only, and those down) fetches chunks of the
// blob at once, each at its own pace (see plan.Planner.Claim); one that
// keeps failing, or lacks the blob, leaves it to the others. When all of
// them fail, the failover-only endpoints are tried, one at a time. The
// report names the endpoints that brought bytes. The digest is not checked
// here: w's owner does that once every byte is in, and reports a mismatch
// with ReportCorrupt.
//
// A ctx marked as background (see WithBackground, WithPriority) fetches at
// a lower priority than other fetches, within FetchConfig.BackgroundShare
// of each endpoint's connections, until its Priority is promoted.
func (r *Registry) FetchBlob(ctx context.Context, repo string, d digest.Digest, w content.Writer) (FetchReport, error) {
	var stats fetchStats
	eps, err := r.usableFor(repo, d)
	if err != nil {
		return stats.report(nil), err
	}
	eps = r.ordered(eps)
	prio := priorityOf(ctx)
	for len(eps) > 0 {
		var group []*endpoint
		group, eps = r.sourcesOf(eps, d)
		f := newBlobFetch(r, repo, d, w, &stats, group)
		f.prio = prio
		err = f.run(ctx)
		if err == nil {
			return stats.report(f.sources), nil
		}
		stats.add(f.sources)
		if ctx.Err() != nil {
			return stats.report(nil), err
		}
		if len(eps) > 0 {
			r.log.Warn("blob fetch failed on its endpoints, trying the next", "digest", d,
				"endpoints", f.hosts(), "next", eps[0].host, "err", err)
		}
	}
	return stats.report(nil), err
}

// sourcesOf splits eps, ordered by health, into the endpoints that fetch d
// together now and those to try after them, in order: every endpoint that
// shares content and is not down, or, when there is none, or while d is to
// come from one endpoint at a time (it failed verification with bytes from
// several in it), the first alone. Failover-only endpoints come after the
// others, down ones last.
func (r *Registry) sourcesOf(eps []*endpoint, d digest.Digest) (group, rest []*endpoint) {
	now := time.Now()
	eps = slices.Clone(eps)
	slices.SortStableFunc(eps, func(a, b *endpoint) int {
		return cmp.Or(compareBool(a.health.down(now), b.health.down(now)), compareBool(a.failoverOnly, b.failoverOnly))
	})
	if !r.corrupt.alone(d, r.now()) {
		for _, ep := range eps {
			if !ep.failoverOnly && !ep.health.down(now) {
				group = append(group, ep)
			} else {
				rest = append(rest, ep)
			}
		}
		if len(group) > 0 {
			return group, rest
		}
	}
	return eps[:1], eps[1:]
}

// compareBool orders false before true.
func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case b:
		return -1
	}
	return 1
}

// FetchReport is what fetching one blob took, for the line the download
// logs: where it came from, and how the path treated it.
type FetchReport struct {
	// Endpoint is the endpoint that brought the blob, or the most of it
	// when several did; "" if the blob was not fetched.
	Endpoint string
	// Sources are the endpoints that brought its bytes, the most first:
	// several when endpoints sharing content fetched it together.
	Sources   []SourceShare
	Endpoints int   // endpoints tried
	Chunks    int64 // chunk requests answered to their end
	Failed    int64 // chunk requests that got no byte (refused, unreachable)
	// Cuts counts the connections that died mid-answer, by kind: reset,
	// eof, stall, slow, error.
	Cuts map[string]int64
	// Hedges counts chunks asked for again while their first request was
	// still open (see plan.HedgeAfter); Splits the backs of slow chunks
	// asked of a faster endpoint's connection (see plan.Planner.Claim);
	// Overtaken the requests that gave way to another for the same bytes;
	// Abandoned those pullproxy hung up on mid-answer as no longer needed
	// (the fetch ended). One too slow is a cut of kind slow.
	Hedges, Splits, Overtaken, Abandoned int64
	// DiscardedBytes and AbandonedBytes are what the upstream sent, or may
	// have sent, that the blob did not keep (see waste): a carrier bills
	// them.
	DiscardedBytes, AbandonedBytes int64
}

// SourceEndpoints returns the endpoints of r.Sources, the most first.
func (r FetchReport) SourceEndpoints() []string {
	out := make([]string, len(r.Sources))
	for i, s := range r.Sources {
		out[i] = s.Endpoint
	}
	return out
}

// SourceShare is what one endpoint brought of a blob.
type SourceShare struct {
	Endpoint string // as Endpoints names it
	Bytes    int64  // written by its chunks
	// Spans are the byte ranges its answers covered: every byte it wrote,
	// and bytes another wrote first (a hedge, a stream resent from byte 0).
	// They are what is fetched again from the others when the blob fails
	// verification and the endpoint is suspected (see ReportCorrupt).
	Spans spans.Set
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
	splits    int64
	shares    map[string]int64     // bytes by endpoint, of endpoints tried before the last
	spans     map[string]spans.Set // the ranges their answers covered, by endpoint
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
	case "split":
		s.splits++
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

// add counts the bytes sources brought, on the way to other endpoints.
func (s *fetchStats) add(sources []*source) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, src := range sources {
		n := src.brought.Load()
		if n == 0 {
			continue
		}
		if s.shares == nil {
			s.shares, s.spans = map[string]int64{}, map[string]spans.Set{}
		}
		ep := src.ep.url.Redacted()
		s.shares[ep] += n
		src.wroteMu.Lock()
		set := s.spans[ep]
		for _, sp := range src.wrote {
			set.Add(sp.Start, sp.End)
		}
		src.wroteMu.Unlock()
		s.spans[ep] = set
	}
}

// report is the FetchReport of a fetch completed by sources (nil: not
// completed), with what earlier endpoints brought.
func (s *fetchStats) report(sources []*source) FetchReport {
	if sources != nil {
		s.add(sources)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rep := FetchReport{Endpoints: s.endpoints, Chunks: s.chunks, Failed: s.failed, Cuts: maps.Clone(s.cuts),
		Hedges: s.hedges, Splits: s.splits, Overtaken: s.overtaken, Abandoned: s.abandoned,
		DiscardedBytes: s.waste.discarded, AbandonedBytes: s.waste.abandoned}
	if sources == nil {
		return rep
	}
	for ep, n := range s.shares {
		rep.Sources = append(rep.Sources, SourceShare{Endpoint: ep, Bytes: n, Spans: s.spans[ep]})
	}
	slices.SortFunc(rep.Sources, func(a, b SourceShare) int {
		return cmp.Or(cmp.Compare(b.Bytes, a.Bytes), cmp.Compare(a.Endpoint, b.Endpoint))
	})
	if len(rep.Sources) > 0 {
		rep.Endpoint = rep.Sources[0].Endpoint
	} else if len(sources) > 0 {
		rep.Endpoint = sources[0].ep.url.Redacted() // nothing was missing: a resumed download's commit
	}
	return rep
}

// blobFetch is one blob being fetched, from one or more endpoints at once
// (its sources). Which chunk comes next is the planner's to decide (see
// package plan); each source runs the workers that fetch chunks from its
// endpoint, and tells the planner what became of each.
type blobFetch struct {
	r       *Registry
	repo    string
	digest  digest.Digest
	w       content.Writer
	stats   *fetchStats // shared by the blob's endpoints; nil: not kept
	sources []*source
	prio    *Priority // nil: foreground

	mu      sync.Mutex
	planner plan.Planner  // the blob's chunks: claimed, in flight, hedged
	sized   chan struct{} // while the size is unknown: closed when the chunk learning it is released
	warned  bool          // the size disagreement was logged
	stops   []error       // why the sources that stopped did, in turn

	hedges       atomic.Int32  // chunks claimed again (see plan.Chunk.Hedge, Split): requests may race for the same bytes
	size         atomic.Int64  // the blob's size once known, for left; 0: not yet
	written      atomic.Int64  // bytes written, a re-sent byte again
	finished     chan struct{} // closed once every byte is written: workers waiting for a lane or a retry end
	finishedOnce sync.Once
	cancel       context.CancelFunc // ends the workers' requests once finished
}

// source is one endpoint fetching chunks of a blob: its workers, and what
// is the endpoint's own in fetching it (where the registry redirected,
// fruitless attempts in a row). It is what the endpoint's pipe gives
// connection slots to.
type source struct {
	*blobFetch
	ep       *endpoint
	location atomic.Pointer[url.URL] // where the registry redirected blob GETs: reused until refused
	index    int                     // in blobFetch.sources
	workers  int                     // fetching chunks at once at most
	failures int                     // attempts in a row without a new byte; under blobFetch.mu
	brought  atomic.Int64            // bytes its chunks wrote
	wroteMu  sync.Mutex
	wrote    spans.Set     // the bytes its answers covered: those it wrote, and any it found written
	stopped  chan struct{} // closed when the source gives up (see stop)
	// answered, when the source scouts (see scout), is closed once its
	// first request was answered or given up; nil: no scouting.
	answered   chan struct{}
	scoutTaken atomic.Bool // a worker went first
	heardOnce  sync.Once
	stopOnce   sync.Once
	ctx        context.Context    // its workers'
	cancel     context.CancelFunc // ends its workers' requests when it stops
}

func newBlobFetch(r *Registry, repo string, d digest.Digest, w content.Writer, stats *fetchStats, eps []*endpoint) *blobFetch {
	f := &blobFetch{r: r, repo: repo, digest: d, w: w, stats: stats, finished: make(chan struct{})}
	workers := r.fetch.MaxConnections
	if r.fetch.ParallelChunks > 0 {
		workers = min(workers, r.fetch.ParallelChunks)
	}
	for i, ep := range eps {
		f.sources = append(f.sources, &source{blobFetch: f, ep: ep, index: i, workers: workers, stopped: make(chan struct{})})
	}
	if stats != nil {
		stats.mu.Lock()
		stats.endpoints += len(eps)
		stats.mu.Unlock()
	}
	return f
}

// hosts names the blob's sources, for logs.
func (f *blobFetch) hosts() []string {
	hosts := make([]string, len(f.sources))
	for i, s := range f.sources {
		hosts[i] = s.ep.host
	}
	return hosts
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

// run fetches the blob with each source's workers, as many as its
// endpoint's pipe may let through at once (or ParallelChunks, where set);
// the pipes decide how many actually run. A source that fails for good
// stops alone, and the others fetch what it left; the blob fails once
// every source has stopped, with what each found.
func (f *blobFetch) run(ctx context.Context) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	f.cancel = cancel
	for _, s := range f.sources {
		var scancel context.CancelFunc
		s.ctx, scancel = context.WithCancel(wctx)
		defer scancel()
		s.cancel = scancel
	}
	// The size, where the manifest did not declare it, from the first
	// source whose HEAD tells it: a chunk learning it would ask for a
	// range past the end, which some registries refuse.
	for _, s := range f.sources {
		err := f.learnSize(ctx, s)
		if err == nil && f.w.Size() >= 0 {
			break
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			s.stop(err)
		}
	}
	if !f.live() {
		return f.failure()
	}
	for _, s := range f.sources {
		if len(f.sources) > 1 && s.ep.pipe.pathRoundTrip() == 0 {
			s.answered = make(chan struct{})
		}
	}
	for {
		var wg sync.WaitGroup
		id := 0 // worker ids are the blob's, not a source's: one watches for them all
		for _, s := range f.sources {
			if s.isStopped() {
				continue
			}
			for range s.workers {
				id++
				wid := id
				wg.Go(func() {
					if err := s.worker(s.ctx, wid); err != nil && !f.isFinished() && ctx.Err() == nil {
						s.stop(err)
					}
				})
			}
		}
		wg.Wait()
		switch {
		case f.isFinished() || f.complete():
			for _, s := range f.sources {
				if !s.isStopped() && (s.brought.Load() > 0 || len(f.sources) == 1) {
					s.ep.markUp()
				}
			}
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case !f.resumable():
			return f.failure()
		}
		// A source stopped after the others' workers had found nothing
		// left to claim: those still fetching take up what it left.
	}
}

// resumable reports whether workers of the sources still fetching could
// claim more of the blob: some are, the planner was not stopped, and some
// of the blob is neither written nor claimed.
func (f *blobFetch) resumable() bool {
	if !f.live() {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return !f.planner.Stopped() && f.planner.Unclaimed(plan.Blob{Size: f.w.Size(), Written: f.w})
}

// live reports whether some source is still fetching.
func (f *blobFetch) live() bool {
	for _, s := range f.sources {
		if !s.isStopped() {
			return true
		}
	}
	return false
}

// failure is why the blob could not be fetched: the one source's error, or
// every source's.
func (f *blobFetch) failure() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch len(f.stops) {
	case 0:
		return fmt.Errorf("fetching %s: no endpoint brought it, and none failed", f.digest)
	case 1:
		return f.stops[0]
	}
	return fmt.Errorf("fetching %s: every endpoint failed: %w", f.digest, errors.Join(f.stops...))
}

// stop ends source s, which failed for good with err: its workers end, and
// what it left is claimed by the other sources. With none left, the
// planner stops too. An endpoint unavailable is left aside for a while
// (when there are others); one that lacks the blob or refuses it is not.
func (s *source) stop(err error) {
	s.stopOnce.Do(func() {
		close(s.stopped)
		s.cancel()
		f := s.blobFetch
		f.mu.Lock()
		f.stops = append(f.stops, err)
		last := len(f.stops) == len(f.sources)
		if last || errors.Is(err, errStore) {
			f.planner.Stop()
		}
		f.mu.Unlock()
		if errors.Is(err, ErrUnavailable) && len(f.r.endpoints) > 1 {
			s.ep.markFailed(f.r, err)
		}
		switch {
		case last:
			f.cancel()
		case errors.Is(err, ErrNotFound):
			f.r.log.Info("an endpoint lacks a blob the others hold: they fetch it", "digest", f.digest,
				"endpoint", s.ep.host, "err", err)
		default:
			f.r.log.Warn("an endpoint stopped fetching a blob: the others fetch the rest", "digest", f.digest,
				"endpoint", s.ep.host, "err", err)
		}
	})
}

// givesWay reports whether source s is to leave the blob to the others
// now: at least giveWayPct of the bytes its recent chunks asked for were
// lost to cuts and stalls (see health.lossShare), twice another still
// fetching source's share or more. Those bytes are what its path swallowed,
// or may have: a carrier bills them, and a stall swallows what its request
// had on the way. A path that cuts its sessions late, near the budget,
// loses little, and keeps fetching at its pace; one whose sessions stall
// early in their requests loses about as much as it brings. It gives way
// without failing: it claims again once it is among the soundest left.
func (s *source) givesWay(now time.Time) bool {
	if len(s.sources) < 2 {
		return false
	}
	n, pct := s.ep.health.lossShare(now)
	if n < degradedMin || pct < giveWayPct {
		return false
	}
	for _, o := range s.sources {
		if o == s || o.isStopped() {
			continue
		}
		if on, opct := o.ep.health.lossShare(now); on >= degradedMin && 2*opct <= pct {
			return true
		}
	}
	return false
}

// giveWayPct is the least share of the bytes its chunks asked for lost to
// cuts, in percent, at which a source gives way to a sounder one: one in
// ten.
const giveWayPct = 10

func (s *source) isStopped() bool {
	select {
	case <-s.stopped:
		return true
	default:
		return false
	}
}

// learnSize asks source s for the blob's size with a HEAD, so that every
// chunk can ask for a range inside the blob (some registries refuse a range
// that runs past the end). Where HEAD gives no answer the first chunk does.
//
// A size a manifest declared needs no HEAD: the chunks ask for ranges
// inside it at once, and each answer's Content-Range (or a refused range's)
// is checked against it. The HEAD held every chunk back by its round trip,
// and by its connection's set-up and its redirect's on a cold start: about
// 150 ms of a pull at a 40 ms round trip, with the link idle.
func (f *blobFetch) learnSize(ctx context.Context, s *source) error {
	if f.w.Size() >= 0 && !f.complete() {
		return nil
	}
	q := request{method: http.MethodHead, repo: f.repo, path: "blobs/" + f.digest.String()}
	resp, err := f.r.send(ctx, s.ep, q)
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
		return f.r.statusError(s.ep.host, q.op(), resp) // asking again adds to the count
	case resp.StatusCode >= 400 && resp.StatusCode < 500 && f.complete():
		// Every byte is in already (a download resumed after a crash in
		// its commit): no chunk will ask, so this refusal is the answer,
		// and the bytes are not the repository's.
		return f.r.statusError(s.ep.host, q.op(), resp)
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

// scout holds a worker of s until its endpoint's first request is
// answered, when s scouts: one of several sources whose path's round trip
// is not known yet (an endpoint asked for blobs only, never for
// manifests). One worker's request goes first; its answer tells the
// round trip, by which the pipe sets its start (see pipe.judgeStart), as
// the manifests' do for the first endpoint. Without it every worker's
// request would go out at once, the initial limit's worth: on a path that
// stalls, each swallowing what it had on the way. The others fetch
// meanwhile. It reports whether the worker is the one to go first, and
// false in ok when it is to end.
func (s *source) scout(ctx context.Context) (first, ok bool) {
	if s.answered == nil || s.scoutTaken.CompareAndSwap(false, true) {
		return s.answered != nil, true
	}
	select {
	case <-s.answered:
		return false, true
	case <-s.finished:
	case <-s.stopped:
	case <-ctx.Done():
	}
	return false, false
}

// heard records that s's first request was answered, or given up: the
// workers held by scout go, and the pipe judges the path's start.
func (s *source) heard() {
	if s.answered == nil {
		return
	}
	s.heardOnce.Do(func() {
		s.ep.pipe.judgeStart()
		close(s.answered)
	})
}

// worker fetches chunks until none is left to claim. It claims a chunk only
// once the pipe gives it a lane, so that the chunk is the one most wanted at
// the time its request goes out, sized to the lane's connection.
func (s *source) worker(ctx context.Context, id int) error {
	defer s.unwatch(id)
	if first, ok := s.scout(ctx); !ok {
		return ctx.Err()
	} else if first {
		defer s.heard() // should it end before a request was answered
	}
	pipe := s.ep.pipe
	for {
		if s.givesWay(time.Now()) {
			return nil
		}
		l, err := pipe.acquire(ctx, s)
		if errors.Is(err, errFinished) {
			return nil
		}
		if err != nil {
			return err
		}
		if s.givesWay(time.Now()) {
			// Judged again with the lane in hand: a wait for it can be
			// long, and many workers may be let through at once (a stall
			// lifting the limit), each to claim a chunk on the path that
			// made the others sounder meanwhile.
			pipe.release(s, l, 0)
			return nil
		}
		how := l.plan(s.ep, s.target())
		c, ok, wait := s.claim(time.Now(), how, pipe.free(s))
		if !ok {
			if how.probe != nil {
				how.probe.failed()
			}
			pipe.release(s, l, 0)
			if wait == nil {
				d := s.watch(id)
				if d == 0 {
					return nil
				}
				select { // chunks in flight are watched for one gone silent
				case <-time.After(d):
					continue
				case <-s.finished:
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
		n, err := s.fetchChunk(ctx, l, c, how)
		if err != nil && !errors.Is(err, ErrUnavailable) && !s.isFinished() && ctx.Err() == nil {
			s.stop(err) // before the chunk is free to claim again: asking this endpoint again would not help
		}
		s.release(c)
		pipe.release(s, l, time.Since(start))
		if err == nil {
			s.progress()
			s.checkFinished()
			continue
		}
		if s.isFinished() {
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
			s.progress()
			s.checkFinished()
			continue
		}
		// A trickle brings bytes, but is no progress to keep trying on.
		attempts := s.failed()
		if attempts >= s.r.fetch.MaxAttempts {
			what := "brought no byte"
			if errors.Is(err, errTooSlow) {
				what = "were too slow (min_goodput)"
			}
			return fmt.Errorf("fetching %s from %s: %d attempts in a row %s: %w",
				s.digest, s.ep.host, attempts, what, err)
		}
		select {
		case <-time.After(backoff(attempts)):
		case <-s.finished: // the other workers brought the rest
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
func (s *source) watch(id int) time.Duration {
	after := s.hedgeAfter()
	f := s.blobFetch
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.planner.Watch(id, after)
}

// unwatch ends worker id's watch of the chunks in flight, if it watches:
// another worker, perhaps another source's, takes it up.
func (s *source) unwatch(id int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.planner.Unwatch(id)
}

// target is where the next chunk's request goes: the registry's redirect
// target while it is accepted, else the registry.
func (s *source) target() *url.URL {
	if loc := s.location.Load(); loc != nil {
		return loc
	}
	return s.ep.url
}

// claim asks the planner, at now, for the next chunk to fetch on a
// connection sized as how says, with free more slots of the pipe free (see
// plan.Planner.Claim). When there is nothing to claim yet but may be soon
// (the size is being learned), it returns a channel to wait on.
func (s *source) claim(now time.Time, how chunkPlan, free int) (plan.Chunk, bool, <-chan struct{}) {
	if s.isStopped() {
		return plan.Chunk{}, false, nil
	}
	src := plan.Source{Free: free, Workers: s.workers, HedgeAfter: s.hedgeAfter(), Index: s.index}
	conn := plan.Conn{Size: how.size, Room: how.room, Several: how.several}
	b := plan.Blob{Size: s.w.Size(), Written: s.w}
	if len(s.sources) > 1 {
		conn.Rate, b.Rate, b.BestConnRate = s.paces()
	}
	f := s.blobFetch
	f.mu.Lock()
	defer f.mu.Unlock()
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
	switch {
	case c.Hedge:
		f.hedges.Add(1)
		f.stats.chunk("hedged", "")
		// The hedged chunk was silent with nothing waiting in its socket:
		// its path stalled, which its endpoint's health counts as it counts
		// a cut, even when the request later gives way or is ended with the
		// blob rather than timing out.
		f.sources[c.OfSource].ep.health.chunk(now, true, 0, c.End-c.Start)
	case c.Split:
		f.hedges.Add(1)
		f.stats.chunk("split", "")
	}
	return c, true, nil
}

// paces returns what the planner weighs a blob's end by when several
// sources fetch it (see plan.Blob.Rate): the goodput a connection of s
// brings, that of the blob's connections from every source together (each
// source's per connection, times the slots it holds or may take for the
// blob), and the fastest source's per connection. All 0 until every source
// still fetching has a measured pace.
func (s *source) paces() (conn, blob, best float64) {
	for _, o := range s.sources {
		if o.isStopped() {
			continue
		}
		rate, slots := o.ep.pipe.pace(o)
		if rate <= 0 {
			return 0, 0, 0
		}
		if o == s {
			conn = rate
		}
		blob += rate * float64(min(slots, o.workers))
		best = max(best, rate)
	}
	return conn, blob, best
}

// hedgeAfter is how long a chunk in flight may bring nothing before its
// rest is asked for again (see plan.HedgeAfter).
func (s *source) hedgeAfter() time.Duration {
	var first time.Duration
	if d := s.r.dialer; d != nil {
		first = d.newConnFirstByte(s.ep.key)
	}
	return plan.HedgeAfter(first, s.r.fetch.StallTimeout)
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

// unclaimed reports whether some of the blob is neither written nor claimed.
func (f *blobFetch) unclaimed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.planner.Unclaimed(plan.Blob{Size: f.w.Size(), Written: f.w})
}

// progress resets the source's count of fruitless attempts; failed adds
// one and returns the count.
func (s *source) progress() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failures = 0
}

func (s *source) failed() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failures++
	return s.failures
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
