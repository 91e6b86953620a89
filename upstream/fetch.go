package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
)

// BlobWriter receives a blob's bytes from FetchBlob, at their offsets.
type BlobWriter interface {
	io.WriterAt
	// Size returns the size the blob must have, or -1 when not yet known.
	Size() int64
	// SetSize records the size the upstream reports. It fails when that
	// contradicts a size already known.
	SetSize(n int64) error
	// Written returns the length of the contiguous prefix already written;
	// a fetch resumes there.
	Written() int64
}

const (
	// fetchBufferSize is the read size on the blob path: large enough that
	// syscalls and writes are few, small enough to pool one per fetch.
	fetchBufferSize = 256 << 10
	// maxAttemptsWithoutProgress bounds retries of a blob whose upstream
	// keeps failing before delivering a single new byte.
	maxAttemptsWithoutProgress = 5
)

// FetchBlob writes blob d of repo into w, resuming with a Range request from
// the first missing byte when a connection breaks. It does not verify the
// digest: w's owner does, once every byte is in.
func (r *Registry) FetchBlob(ctx context.Context, repo string, d digest.Digest, w BlobWriter) error {
	bufp := r.buffers.Get().(*[]byte)
	defer r.buffers.Put(bufp)
	failures := 0
	for {
		start := w.Written()
		if size := w.Size(); size >= 0 && start == size {
			return nil
		}
		end, err := r.fetchFrom(ctx, repo, d, w, start, *bufp)
		if err == nil {
			return nil
		}
		if !errors.Is(err, ErrUnavailable) || ctx.Err() != nil {
			return err
		}
		if end > start {
			failures = 0
		} else if failures++; failures >= maxAttemptsWithoutProgress {
			return fmt.Errorf("fetching %s: %d attempts in a row made no progress: %w", d, failures, err)
		}
		r.log.Info("blob fetch interrupted, resuming", "digest", d, "offset", end, "err", err)
		if err := sleep(ctx, backoff(failures)); err != nil {
			return err
		}
	}
}

// fetchFrom streams the blob from offset start to its end, returning the
// offset reached.
func (r *Registry) fetchFrom(ctx context.Context, repo string, d digest.Digest, w BlobWriter, start int64, buf []byte) (int64, error) {
	q := request{method: http.MethodGet, repo: repo, path: "blobs/" + d.String(), header: http.Header{}}
	if start > 0 {
		// A closed range where the size is known: some registries (among them
		// go-containerregistry's) refuse the open-ended form.
		last := ""
		if size := w.Size(); size > start {
			last = strconv.FormatInt(size-1, 10)
		}
		q.header.Set("Range", "bytes="+strconv.FormatInt(start, 10)+"-"+last)
	}
	resp, err := r.do(ctx, q, http.StatusOK, http.StatusPartialContent)
	if err != nil {
		return start, err
	}
	defer resp.Body.Close()
	host := responseHost(resp) // after redirects: where the bytes come from
	fail := func(kind error, cause error, format string, a ...any) *Error {
		return &Error{Upstream: r.name, Endpoint: host, Op: q.op(), Status: resp.StatusCode,
			Kind: kind, Err: cause, Message: fmt.Sprintf(format, a...)}
	}

	size := resp.ContentLength
	off := start
	if resp.StatusCode == http.StatusPartialContent {
		first, total, ok := parseContentRange(resp.Header.Get("Content-Range"))
		if !ok || first != start {
			return start, fail(ErrInvalid, nil, "asked for bytes %d-, got Content-Range %q", start, resp.Header.Get("Content-Range"))
		}
		size = total
	} else {
		off = 0 // the upstream ignored Range: take the whole blob again
	}
	if size >= 0 {
		if err := w.SetSize(size); err != nil {
			return start, fail(ErrInvalid, err, "the upstream holds %s as %d bytes, expected %d", d, size, w.Size())
		}
	}

	received := r.metrics.blobBytes.WithLabelValues(r.name)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			if _, err := w.WriteAt(buf[:n], off); err != nil {
				return off, fail(ErrInvalid, err, "storing bytes at %d", off)
			}
			off += int64(n)
			received.Add(float64(n))
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return off, fail(ErrUnavailable, rerr, "reading %s at byte %d of %d: %v", d, off, size, rerr)
		}
	}
	if size < 0 { // no length announced: the end of the stream is the end of the blob
		if err := w.SetSize(off); err != nil {
			return off, fail(ErrInvalid, err, "the upstream sent %d bytes of %s, expected %d", off, d, w.Size())
		}
	} else if off != size {
		return off, fail(ErrUnavailable, io.ErrUnexpectedEOF, "connection closed at byte %d of %d", off, size)
	}
	return off, nil
}

// parseContentRange parses "bytes first-last/total".
func parseContentRange(h string) (first, total int64, ok bool) {
	rng, ok := strings.CutPrefix(h, "bytes ")
	if !ok {
		return 0, 0, false
	}
	span, tot, ok := strings.Cut(rng, "/")
	if !ok {
		return 0, 0, false
	}
	a, _, ok := strings.Cut(span, "-")
	if !ok {
		return 0, 0, false
	}
	first, err1 := strconv.ParseInt(a, 10, 64)
	total, err2 := strconv.ParseInt(tot, 10, 64)
	return first, total, err1 == nil && err2 == nil && first >= 0 && total > first
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
