package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/pullproxy/pullproxy/upstream/plan"
)

// fetchBufferSize is the read size on the blob path, pooled per chunk.
const fetchBufferSize = 256 << 10

// Within tailSpan of a blob's end a chunk's bytes are written tailGather at
// a time. There, a chunk whose connection goes silent has its rest asked
// for again (see plan.HedgeAfter) from its first byte not written, and what
// the silent request holds for a larger write comes twice: smaller writes
// near the end, where hedges happen, keep that duplicate small, while the
// rest of the blob is written in large pieces.
const (
	tailSpan   = 16 << 20
	tailGather = 64 << 10
)

// fetchChunk fetches one chunk on l, as how says, and returns how many
// bytes it wrote. What happens to the connection is evidence about the path:
// a cut is recorded at the bytes the session carried in all, and a
// connection that used up its budget is retired.
func (s *source) fetchChunk(ctx context.Context, l *lane, c plan.Chunk, how chunkPlan) (int64, error) {
	// Timed against the endpoint, whichever host answers: the path to it,
	// or to where it redirects, is what the pipe fills.
	on := chunkTrace{got: func(conn *chunkConn) { s.attach(c, conn) }}
	on.firstByte.paths, on.firstByte.key = s.r.dialer, s.ep.key
	defer on.done()
	ctx = httptrace.WithClientTrace(ctx, on.trace())
	if how.probe != nil {
		ctx = withProbe(ctx, how.probe)
		// A request that went out on a connection already open probed
		// nothing.
		defer func() {
			if !how.probe.attached.Load() {
				how.probe.failed()
			}
		}()
	}
	chunks := s.ep.chunks
	resp, op, err := s.open(ctx, l, c)
	s.heard()
	if err != nil {
		chunks.WithLabelValues("failed").Inc()
		s.stats.chunk("failed", "")
		if ctx.Err() != nil && on.conn != nil && !c.Open && c.End >= 0 {
			// Sent, and no longer wanted before its answer came: the
			// upstream may send all of it.
			s.wasted(waste{abandoned: c.End - c.Start})
		}
		if e := (*Error)(nil); errors.As(err, &e) &&
			(e.Status == http.StatusTooManyRequests || e.Status == http.StatusServiceUnavailable) {
			s.ep.pipe.failed(pipeBusy)
		}
		return 0, err
	}
	conn := on.conn
	l.answered(resp.Request, conn)
	defer resp.Body.Close()
	host := responseHost(resp)
	fail := func(kind, cause error, format string, a ...any) *Error {
		return &Error{Upstream: s.r.name, Endpoint: host, Op: op, Status: resp.StatusCode,
			Kind: kind, Err: cause, Message: fmt.Sprintf(format, a...)}
	}

	start, end := c.Start, c.End
	switch resp.StatusCode {
	case http.StatusPartialContent:
		first, last, total, ok := parseContentRange(resp.Header.Get("Content-Range"))
		if !ok || first != start {
			return 0, fail(ErrInvalid, nil, "asked for bytes %d-, got Content-Range %q", start, resp.Header.Get("Content-Range"))
		}
		if total >= 0 {
			if err := s.checkSize(total, host); err != nil {
				return 0, err
			}
		}
		if s.w.Size() < 0 {
			return 0, fail(ErrInvalid, nil, "the upstream does not say how large %s is", s.digest)
		}
		end = min(last+1, s.w.Size())
		if !c.Open && c.End >= 0 {
			end = min(end, c.End) // a longer answer than asked for would overrun the budget
		}
	case http.StatusOK:
		// The upstream ignores Range: from now on one stream, from the start.
		s.mu.Lock()
		s.planner.Stream(c.Start)
		s.mu.Unlock()
		if resp.ContentLength >= 0 {
			if err := s.checkSize(resp.ContentLength, host); err != nil {
				return 0, err
			}
		}
		start, end = 0, s.w.Size()
	}
	if end < 0 {
		return 0, fail(ErrInvalid, nil, "the upstream does not say how large %s is", s.digest)
	}

	var ahead *warmup
	if how.last {
		ahead = s.warmupFor(resp.Request)
	}
	if conn != nil {
		conn.expect(end - start)
		defer conn.expect(0)
	}
	n, dropped, err := s.copyBody(ctx, resp.Body, start, end, resp.StatusCode == http.StatusPartialContent, ahead)
	s.covered(start, start+n)
	// A stream restarted from byte 0 re-sends bytes already held: only those
	// past the chunk's start are progress.
	fresh := max(0, start+n-c.Start)
	w := waste{discarded: dropped + n - fresh}
	if ended := errors.Is(err, errOvertaken) || errors.Is(err, errTooSlow) || err != nil && ctx.Err() != nil; ended {
		// pullproxy hangs up on the rest of the answer: what waits in
		// the socket came for nothing, and the rest may be on its way.
		var unread int64
		if conn != nil {
			unread = int64(conn.queued())
		}
		w.discarded += unread
		w.abandoned = max(0, end-start-n-dropped-unread)
	}
	s.wasted(w)
	if errors.Is(err, errOvertaken) {
		// Its connection closes with the unread answer: no evidence about
		// the path, and no cut.
		chunks.WithLabelValues("overtaken").Inc()
		s.stats.chunk("overtaken", "")
		if conn != nil {
			conn.retired.Store(true)
		}
		return fresh, nil
	}
	if err != nil {
		if errors.Is(err, errStore) {
			return fresh, fail(ErrInvalid, err, "storing %s at %d: %v", s.digest, start+n, err)
		}
		if ctx.Err() != nil {
			s.stats.chunk("abandoned", "")
			return fresh, ctx.Err() // we hung up: not the path's doing
		}
		kind := cutKind(err)
		chunks.WithLabelValues("cut").Inc()
		s.stats.chunk("cut", kind)
		s.ep.health.chunk(time.Now(), true, fresh, max(0, end-start-n))
		// Where the session died: the bytes it carried in all, chunks
		// before this one, handshake and headers included, as the carrier
		// counts them. A chunk that died before its first byte is no
		// evidence of a byte-count cut.
		carried, probe := n, (*probeConn)(nil)
		if conn != nil {
			carried, probe = conn.read.Load(), conn.probe.Load()
			conn.retired.Store(true)
		}
		if n == 0 {
			carried = 0
		}
		cutAt := carried
		if kind == "slow" {
			cutAt = 0 // abandoned here, not cut by the path: no evidence of a byte count
		}
		switch stalled := kind == "stall" || kind == "slow"; {
		case probe != nil && stalled:
			s.ep.pipe.failed(pipeProbeStall)
		case probe != nil: // finding where the path cuts is what a probe is for
		case stalled:
			s.ep.pipe.failed(pipeStall)
		default:
			s.ep.pipe.failed(pipeCut)
		}
		var next int64
		if probe != nil {
			next = probe.cut(cutAt, kind)
		} else {
			next = s.ep.budget.cut(cutAt, false, kind, time.Now())
		}
		if next > 0 {
			s.r.log.Info("connection budget lowered after a cut", "endpoint", s.ep.host,
				"cut_at", carried, "kind", kind, "budget", next)
		}
		return fresh, fail(ErrUnavailable, err, "%s: connection %s after %d of %d bytes (%d on the connection): %v",
			chunkName(s.digest, start, end), cutVerb(kind), n, end-start, carried, err)
	}
	chunks.WithLabelValues("complete").Inc()
	s.stats.chunk("complete", "")
	s.ep.health.chunk(time.Now(), false, fresh, 0)
	switch {
	case conn == nil:
	case c.Open || resp.StatusCode != http.StatusPartialContent:
		// Carried a whole stream: a probe on it won.
		resp.Body.Close()
		l.retire(conn)
	case conn.allowance(s.ep)-conn.read.Load() < minChunk:
		resp.Body.Close()
		l.spent(conn, s.ep) // used up: renewed on a clean path, else retired
	}
	return fresh, nil
}

// open sends the chunk's request: to the URL the registry redirected to
// before, while it is accepted, else to the registry (which may redirect
// again). Authorization goes only to the registry.
func (s *source) open(ctx context.Context, l *lane, c plan.Chunk) (*http.Response, string, error) {
	rng := fmt.Sprintf("bytes=%d-", c.Start)
	if !c.Open && c.End >= 0 {
		rng += strconv.FormatInt(c.End-1, 10)
	}
	if loc := s.location.Load(); loc != nil {
		resp, err := s.getLocation(ctx, l, loc, rng)
		if err != nil {
			return nil, "GET " + redacted(loc), err
		}
		switch resp.StatusCode {
		case http.StatusOK, http.StatusPartialContent:
			return resp, "GET " + redacted(loc), nil
		}
		// Expired or refused: resolve it again through the registry.
		resp.Body.Close()
		s.location.CompareAndSwap(loc, nil)
	}

	q := request{method: http.MethodGet, repo: s.repo, path: "blobs/" + s.digest.String(),
		header: http.Header{"Range": {rng}}, client: l.client}
	resp, err := s.r.send(ctx, s.ep, q)
	if err != nil {
		return nil, q.op(), err
	}
	switch resp.StatusCode {
	case http.StatusOK, http.StatusPartialContent:
		return resp, q.op(), nil
	case http.StatusMovedPermanently, http.StatusFound, http.StatusSeeOther,
		http.StatusTemporaryRedirect, http.StatusPermanentRedirect:
		loc, err := resp.Request.URL.Parse(resp.Header.Get("Location"))
		resp.Body.Close()
		if err != nil || loc.Host == "" {
			return nil, q.op(), &Error{Upstream: s.r.name, Endpoint: s.ep.host, Op: q.op(), Status: resp.StatusCode,
				Kind: ErrInvalid, Message: "redirect without a usable Location"}
		}
		if err := s.r.targets.checkRedirect(resp.Request.URL, loc); err != nil {
			return nil, q.op(), &Error{Upstream: s.r.name, Endpoint: s.ep.host, Op: q.op(), Status: resp.StatusCode,
				Kind: ErrInvalid, Err: err}
		}
		s.location.Store(loc)
		op := "GET " + redacted(loc)
		resp, err := s.getLocation(ctx, l, loc, rng)
		if err != nil {
			return nil, op, err
		}
		if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusPartialContent {
			defer resp.Body.Close()
			if err := s.rangeRefused(resp, loc.Host); err != nil {
				return nil, op, err
			}
			return nil, op, s.r.statusError(loc.Host, op, resp)
		}
		return resp, op, nil
	}
	defer resp.Body.Close()
	if err := s.rangeRefused(resp, s.ep.host); err != nil {
		return nil, q.op(), err
	}
	return nil, q.op(), s.r.statusError(s.ep.host, q.op(), resp)
}

// rangeRefused checks the size a 416 gives ("Content-Range: bytes */N")
// against the one declared: a range refused because the upstream holds
// fewer bytes than the manifest declares says so, rather than only that a
// range was refused. Nil for any other answer.
func (s *source) rangeRefused(resp *http.Response, host string) error {
	if resp.StatusCode != http.StatusRequestedRangeNotSatisfiable {
		return nil
	}
	tot, ok := strings.CutPrefix(resp.Header.Get("Content-Range"), "bytes */")
	if !ok {
		return nil
	}
	if total, err := strconv.ParseInt(tot, 10, 64); err == nil && total >= 0 {
		return s.checkSize(total, host)
	}
	return nil
}

// getLocation fetches a range from a redirect target, without credentials:
// a presigned URL carries its own, and object stores refuse a second kind.
func (s *source) getLocation(ctx context.Context, l *lane, loc *url.URL, rng string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, loc.String(), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Range", rng)
	resp, err := l.client.Do(req)
	if err != nil {
		s.r.metrics.request(s.r.name, http.MethodGet, 0)
		return nil, s.r.transportError(loc.Host, "GET "+redacted(loc), err)
	}
	s.r.metrics.request(s.r.name, http.MethodGet, resp.StatusCode)
	return resp, nil
}

// warmup opens the next chunk's connection while this chunk's last bytes
// arrive: once what is left would take about as long as opening a
// connection to the same address lately took.
type warmup struct {
	s    *source
	key  dialKey
	lead time.Duration
	done bool
}

// warmupFor returns the warm-up for a chunk requested with req, or nil when
// there is nothing to warm: a caller's own transport, a proxied request, or
// no connection measured yet.
func (s *source) warmupFor(req *http.Request) *warmup {
	d := s.r.dialer
	if d == nil || req == nil || d.proxied(req) {
		return nil
	}
	key := dialKey{secure: req.URL.Scheme == "https", addr: hostPort(req.URL.Scheme, req.URL.Host)}
	setup := d.setupTime(key)
	if setup <= 0 {
		return nil
	}
	return &warmup{s: s, key: key, lead: setup*3/2 + 10*time.Millisecond}
}

// check starts the warm-up, within ctx, when the chunk's rest, at its pace
// so far (received bytes in elapsed), would arrive within the lead.
func (w *warmup) check(ctx context.Context, received, rest int64, elapsed time.Duration) {
	if w == nil || w.done || received <= 0 {
		return
	}
	if time.Duration(float64(elapsed)*float64(rest)/float64(received)) > w.lead {
		return
	}
	w.done = true
	if w.s.unclaimed() {
		w.s.r.dialer.prewarm(ctx, w.key, w.s.r.fetch.FirstByteTimeout)
	}
}

// covered records that an answer of s covered [start, end) of the blob:
// the evidence of which endpoint brought which bytes, should the blob fail
// verification (see SourceShare.Spans). One entry per chunk, merged with
// the one before when the chunks follow each other.
func (s *source) covered(start, end int64) {
	if start >= end {
		return
	}
	s.wroteMu.Lock()
	s.wrote.Add(start, end)
	s.wroteMu.Unlock()
}

// errStore marks a failure to store bytes, as opposed to receiving them.
var errStore = errors.New("store")

// errOvertaken ends a chunk's request that another request for the same
// bytes (a hedge, or the request it hedged) has got ahead of: what it would
// bring next is held already.
var errOvertaken = errors.New("overtaken by another request for the same bytes")

// errTooSlow marks a chunk connection abandoned for bringing less than
// MinGoodput.
var errTooSlow = errors.New("slower than min_goodput")

// waste is what a chunk's request cost beyond the bytes it kept:
// discarded bytes were received and thrown away (held already, or left
// unread in the socket when the request was ended); abandoned ones were
// asked for and never received by a request pullproxy ended, which the
// upstream may have sent all the same (on a fast path, most of them).
type waste struct{ discarded, abandoned int64 }

// wasted counts w in the endpoint's metrics and the blob's report.
func (s *source) wasted(w waste) {
	if w.discarded > 0 {
		s.ep.discarded.Add(float64(w.discarded))
	}
	if w.abandoned > 0 {
		s.ep.abandoned.Add(float64(w.abandoned))
	}
	s.stats.wasted(w)
}

// copyBody writes body to [start, end) of the blob, returning the bytes
// written, and those received and dropped, held already (errOvertaken). It gathers up to a buffer's worth per write (see gather): a TLS
// body arrives 16 KiB at a time, and each write is a syscall and wakes the
// blob's readers. Near the end it starts ahead's warm-up. An answer to a
// range request (ranged) stops as soon as it finds its next byte written
// already, once the blob has a hedged chunk (errOvertaken): racing requests
// would otherwise both bring the rest. A stream from byte 0 re-sends bytes
// held before on purpose, and reads on.
func (s *source) copyBody(ctx context.Context, body io.Reader, start, end int64, ranged bool, ahead *warmup) (written, dropped int64, err error) {
	bufp := s.r.buffers.Get().(*[]byte)
	defer s.r.buffers.Put(bufp)
	buf := *bufp
	received, epBytes, pipe := s.r.received, s.ep.bytes, s.ep.pipe
	began := time.Now()
	minRate, slowCheck := float64(s.r.fetch.MinGoodput), began.Add(slowAfter*s.r.fetch.StallTimeout)
	off := start
	tail := s.w.Size() - tailSpan // past it, writes are smaller (see tailGather)
	for off < end {
		want := min(int64(len(buf)), end-off)
		if off >= tail {
			want = min(want, tailGather)
		}
		n, err := gather(body, buf[:want])
		if n > 0 && ranged && s.hedges.Load() > 0 && plan.Overtaken(s.w, off) {
			// Racing another request for these bytes: the one that finds
			// its next byte written is behind, and gives way.
			return off - start, int64(n), errOvertaken
		}
		if n > 0 {
			if _, werr := s.w.WriteAt(buf[:n], off); werr != nil {
				return off - start, 0, fmt.Errorf("%w: %w", errStore, werr)
			}
			off += int64(n)
			s.written.Add(int64(n))
			s.brought.Add(int64(n))
			received.Add(float64(n))
			epBytes.Add(float64(n))
			pipe.add(n)
			if ahead != nil {
				ahead.check(ctx, off-start, end-off, time.Since(began))
			}
		}
		switch {
		case err == nil:
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			if off < end {
				return off - start, 0, io.ErrUnexpectedEOF
			}
		default:
			return off - start, 0, err
		}
		if minRate > 0 && off < end {
			if now := time.Now(); now.After(slowCheck) && float64(off-start) < minRate*now.Sub(began).Seconds() {
				return off - start, 0, fmt.Errorf("%w: %d bytes in %v", errTooSlow, off-start, now.Sub(began).Round(time.Millisecond))
			}
		}
	}
	// Read on to the answer's end: net/http keeps a connection for the next
	// chunk only once it has seen it. An answer longer than asked for ends
	// its connection here instead, as it should.
	body.Read(buf[:1])
	return off - start, 0, nil
}

// gather reads from body into buf until buf is full, the body ends or
// fails, or gatherFor has passed since the first byte: bytes are written
// in large pieces on a fast connection (each write is a system call and
// wakes the blob's readers, and small ones cost CPU), and without delay on
// a slow one, such as a session still in slow start across a long path,
// whose reader would otherwise wait for a buffer's worth.
func gather(body io.Reader, buf []byte) (int, error) {
	var first time.Time
	n := 0
	for n < len(buf) {
		m, err := body.Read(buf[n:])
		n += m
		if err != nil {
			if err == io.EOF && n > 0 {
				err = nil // the caller learns of the end on its next read
			}
			return n, err
		}
		if m > 0 && first.IsZero() {
			first = time.Now()
		} else if n > 0 && time.Since(first) >= gatherFor {
			break
		}
	}
	return n, nil
}

// gatherFor bounds how long gather holds received bytes before writing.
const gatherFor = 20 * time.Millisecond

// cutKind names how a connection died, for metrics and logs.
func cutKind(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ECONNRESET):
		return "reset"
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return "eof"
	case errors.As(err, &ne) && ne.Timeout():
		return "stall"
	case errors.Is(err, errTooSlow):
		return "slow"
	}
	return "error"
}

func cutVerb(kind string) string {
	switch kind {
	case "reset":
		return "reset"
	case "eof":
		return "closed"
	case "stall":
		return "went silent"
	case "slow":
		return "was too slow"
	}
	return "failed"
}

func chunkName(d digest.Digest, start, end int64) string {
	return fmt.Sprintf("%s range %d-%d", d, start, end-1)
}

// redacted is a URL without its query, which for a presigned URL is a credential.
func redacted(u *url.URL) string {
	c := *u
	c.RawQuery, c.User = "", nil
	return c.String()
}

// parseContentRange parses "bytes first-last/total"; total is -1 when the
// upstream gives it as "*".
func parseContentRange(h string) (first, last, total int64, ok bool) {
	rng, ok := strings.CutPrefix(h, "bytes ")
	if !ok {
		return 0, 0, 0, false
	}
	span, tot, ok := strings.Cut(rng, "/")
	if !ok {
		return 0, 0, 0, false
	}
	a, b, ok := strings.Cut(span, "-")
	if !ok {
		return 0, 0, 0, false
	}
	first, err1 := strconv.ParseInt(a, 10, 64)
	last, err2 := strconv.ParseInt(b, 10, 64)
	if tot == "*" {
		return first, last, -1, err1 == nil && err2 == nil && first >= 0 && last >= first
	}
	total, err3 := strconv.ParseInt(tot, 10, 64)
	return first, last, total, err1 == nil && err2 == nil && err3 == nil && first >= 0 && last >= first && total > last
}
