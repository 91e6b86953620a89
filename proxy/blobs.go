package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/content"
	"github.com/pullproxy/pullproxy/upstream"
)

// serveBlob answers HEAD and GET of a blob, as storedBlobAllowed decides:
// from the store when it holds the blob, else from its download, which
// this request starts or joins.
func (s *Server) serveBlob(w http.ResponseWriter, r *http.Request, rt route) {
	ctx := r.Context()
	d := digest.Digest(rt.ref) // validated by resolve
	head := r.Method == http.MethodHead
	h := w.Header()
	// One allocation for the values that differ per blob; Content-Length's
	// is filled in once the size is known.
	vals := make([]string, 3)
	vals[0], vals[1] = d.String(), `"`+d.String()+`"`
	h["Content-Type"] = octetStream
	h["Docker-Content-Digest"] = vals[0:1:1]
	h["Etag"] = vals[1:2:2]
	h["Accept-Ranges"] = acceptRanges
	h["Cache-Control"] = immutable

	// Twice at most: a download may commit between the lookup and the join.
	for range 2 {
		f, size, err := s.blobs.OpenBlob(ctx, d)
		switch v, err := s.storedBlobAllowed(ctx, rt, r.RemoteAddr, head, err, true); v {
		case blobRefused:
			if f != nil {
				f.Close()
			}
			s.fail(w, r, rt, err)
			return
		case blobServe:
			s.serveStored(w, r, f, size, vals)
			f.Close()
			return
		}
		// blobMissing: with confirm set, never blobUnconfirmed.
		if head {
			s.headBlob(w, r, rt, d)
			return
		}
		if s.redirectToShared(w, r, rt, d) {
			return
		}
		p, own, err := s.downloads.join(ctx, rt, d)
		if errors.Is(err, errStored) {
			continue
		}
		if err != nil {
			s.fail(w, r, rt, err)
			return
		}
		setSource(w, sourceDownload)
		s.serveDownload(w, r, rt, p, own)
		return
	}
	s.fail(w, r, rt, fmt.Errorf("blob %s: committed but not readable", d))
}

// serveStored answers a GET or HEAD of a blob from its stored file f, of
// size bytes, its headers set but Content-Length: vals are serveBlob's
// values of the blob's header, to be completed with it.
func (s *Server) serveStored(w http.ResponseWriter, r *http.Request, f *os.File, size int64, vals []string) {
	setSource(w, sourceCache)
	tw, sent := s.timed(w)
	defer sent()
	if conditional(r.Header) {
		serveStoredPart(tw, r, f, size, vals[1])
		return
	}
	vals[2] = strconv.FormatInt(size, 10)
	w.Header()["Content-Length"] = vals[2:3:3]
	rw, _ := w.(*responseRecorder)
	switch {
	case rw != nil && s.sendStoredForLoop(rw, r, f, size):
		// sent as the blob loop sends, which takes the connection next
	case sendStored(tw, r, f, size) && rw != nil:
		rw.whole = true
	}
}

// sendStoredForLoop answers a plain GET of a stored blob of at least
// loopSendMin bytes, on a connection the blob loop takes over next (see
// takeOver), as the loop answers: the header through net/http, the body
// with sendBlob, which sends from the page cache without the runtime's
// thread hand-offs (see residency). A node's first request on a
// connection, often for its largest layer, would otherwise be net/http's
// to send. It reports whether it answered; when not, nothing was sent.
func (s *Server) sendStoredForLoop(rw *responseRecorder, r *http.Request, f *os.File, size int64) bool {
	fp := s.fast.Load()
	ci, _ := r.Context().Value(connKey{}).(*connInfo)
	if r.Method != http.MethodGet || size < loopSendMin || fp == nil || ci == nil || !loopCanTake(r) {
		return false
	}
	rw.WriteHeader(http.StatusOK)
	if http.NewResponseController(rw).Flush() != nil {
		return true // the client is gone
	}
	rw.flushed = true
	var until time.Time
	if fp.write > 0 {
		until = time.Now().Add(fp.write)
	}
	n, err := sendBlob(ci.tcp, ci.raw, nil, int(f.Fd()), size, s.sendTimeout, until)
	rw.written += n
	if err != nil {
		ci.tcp.Close() // net/http's next read fails and ends it
		return true
	}
	ci.tcp.SetWriteDeadline(time.Time{})
	rw.whole = true
	return true
}

// loopSendMin is the least body sendStoredForLoop sends: a smaller one
// goes out in a call or two, as cheaply through net/http.
const loopSendMin = 1 << 20

// sendStored answers a plain GET or HEAD of a stored blob of size bytes,
// its headers, Content-Length included, already set: what
// http.ServeContent would send, without its seeks and checks. It reports
// whether the whole response was sent.
func sendStored(w http.ResponseWriter, r *http.Request, f *os.File, size int64) bool {
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return true
	}
	var raw syscall.RawConn
	if size <= maxCorked {
		raw = cork(r.Context())
	}
	// Limited to the size, sendfile stops there rather than calling again
	// to find the end of the file. An error is the client's going away.
	n, err := io.CopyN(w, f, size)
	uncork(raw)
	return err == nil && n == size
}

// maxCorked is the largest blob net/http's responses send corked (see
// cork). The cork saves the header's packet, which counts while a response
// is a few packets; for a larger blob that packet is one among many, and
// the cork's own costs (two more system calls, the last segment held back
// until uncork) are no longer paid back.
const maxCorked = 256 << 10

// conditional reports whether a request asks for part of a blob or depends
// on a validator: http.ServeContent answers those. Other requests for a
// stored blob, nearly all of them, get the whole blob without its work (two
// seeks, header parsing and checks), with the headers it would send.
func conditional(h http.Header) bool {
	for _, k := range conditionalHeaders {
		if _, ok := h[k]; ok {
			return true
		}
	}
	return false
}

// conditionalHeaders are the request headers http.ServeContent acts on, in
// canonical form, as net/http stores them.
var conditionalHeaders = []string{"Range", "If-Range", "If-Match", "If-None-Match", "If-Modified-Since", "If-Unmodified-Since"}

// Header values every blob response shares (net/http only reads them). A
// blob's content never changes under its digest, so caches between
// pullproxy and its clients may keep it as long as they like, as
// distribution's registry also tells them.
var (
	octetStream  = []string{"application/octet-stream"}
	acceptRanges = []string{"bytes"}
	immutable    = []string{"max-age=31536000"}
)

// redirectToShared answers a GET of a blob the shared bucket holds with a
// redirect to it, when so configured, and reports whether it did.
func (s *Server) redirectToShared(w http.ResponseWriter, r *http.Request, rt route, d digest.Digest) bool {
	if s.sharedBlobs == nil || !s.sharedBlobs.Redirect() {
		return false
	}
	url, err := s.sharedBlobs.BlobURL(r.Context(), d)
	if err != nil {
		if !errors.Is(err, storage.ErrNotFound) {
			s.log.Warn("looking for a blob in the shared bucket: fetching it", "digest", d, "err", err)
		}
		return false
	}
	if err := s.inRepository(r.Context(), rt, kindBlob, d); err != nil {
		s.fail(w, r, rt, err)
		return true
	}
	setSource(w, sourceBucket)
	h := w.Header()
	delete(h, "Etag")
	delete(h, "Accept-Ranges")
	delete(h, "Cache-Control")
	h.Set("Location", url)
	w.WriteHeader(http.StatusTemporaryRedirect)
	return true
}

// headBlob answers a HEAD for a blob not in the store without downloading it.
func (s *Server) headBlob(w http.ResponseWriter, r *http.Request, rt route, d digest.Digest) {
	var size int64
	var err error
	if s.sharedBlobs != nil {
		shared, serr := s.sharedBlobs.StatBlob(r.Context(), d)
		if serr == nil {
			if serr = s.inRepository(r.Context(), rt, kindBlob, d); serr != nil {
				s.fail(w, r, rt, serr)
				return
			}
			setSource(w, sourceBucket)
			w.Header().Set("Content-Length", strconv.FormatInt(shared, 10))
			w.WriteHeader(http.StatusOK)
			return
		}
		if !errors.Is(serr, storage.ErrNotFound) {
			s.log.Warn("looking for a blob in the shared bucket: asking the upstream", "digest", d, "err", serr)
		}
	}
	if p, own := s.downloads.lookup(r.Context(), rt, d); p != nil {
		if err = s.ownOrInRepository(r.Context(), rt, d, own); err == nil {
			size, err = p.WaitStarted(r.Context())
		}
	} else if size, err = rt.up.HeadBlob(r.Context(), rt.repo, d); err == nil && size < 0 {
		// The upstream's HEAD gave no size: the download will learn it.
		var p content.Reader
		if p, _, err = s.downloads.join(r.Context(), rt, d); err == nil {
			size, err = p.WaitStarted(r.Context())
		} else if errors.Is(err, errStored) {
			size, err = s.blobs.StatBlob(r.Context(), d)
		}
	} else if err == nil {
		s.addMember(r.Context(), rt, d) // the upstream has it there
		size, err = s.declaredHead(r.Context(), rt, d, size)
	}
	if err != nil {
		s.fail(w, r, rt, err)
		return
	}
	w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
	w.WriteHeader(http.StatusOK)
}

// declaredHead checks the size an upstream's HEAD gave for d against the
// one a manifest of rt's repository declared, if any, and returns what a
// GET would deliver: the declared size, for the download fetches that many
// bytes (an upstream holding more, such as a blob stored twice, still
// verifies); an error, as the download's, when the upstream holds fewer.
func (s *Server) declaredHead(ctx context.Context, rt route, d digest.Digest, size int64) (int64, error) {
	declared, err := s.blobs.DeclaredSize(ctx, rt.up.Name(), rt.repo, d)
	if err != nil || declared < 0 || declared == size {
		return size, nil
	}
	if size < declared {
		return 0, &upstream.Error{Upstream: rt.up.Name(), Op: "HEAD /v2/" + rt.repo + "/blobs/" + d.String(),
			Status: http.StatusOK, Kind: upstream.ErrInvalid,
			Message: fmt.Sprintf("the upstream holds %s as %d bytes, fewer than the %d the manifest declares", d, size, declared)}
	}
	return declared, nil
}

// serveDownload streams a blob from its download as its bytes land. The
// status goes out only once the upstream has started sending the blob: a
// refusal (404, 401, 429, …) is the client's answer too, so that it can fall
// back to another host, rather than a 200 that ends with no byte. If the
// download fails after that, the response ends short with a clean close, and
// the client resumes with a Range request that joins or starts the next one.
//
// own says the download was started for rt's upstream and repository: once
// the upstream has started sending, the blob is known to be there.
func (s *Server) serveDownload(w http.ResponseWriter, r *http.Request, rt route, p content.Reader, own bool) {
	ctx := r.Context()
	s.metrics.waiters.Add(1)
	defer s.metrics.waiters.Add(-1)
	size, err := p.WaitStarted(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.fail(w, r, rt, err)
		}
		return
	}
	if own {
		s.addMember(ctx, rt, p.Digest())
	}
	etag := `"` + p.Digest().String() + `"`
	if preconditions(w, r, etag) {
		return
	}
	start, end, kind := requestedRange(r, etag, size)
	if kind == rangeUnsatisfiable {
		writeRangeHead(w, r, start, end, size, kind)
		return
	}
	// Open before committing to a status, so a failure here is still an error response.
	f, err := p.Open()
	if err != nil {
		s.fail(w, r, rt, err)
		return
	}
	defer f.Close()
	writeRangeHead(w, r, start, end, size, kind)
	tw, sent := s.timed(w)
	defer sent()
	if err := copyAvailable(ctx, tw, f, p, start, end); err != nil && ctx.Err() == nil {
		// Returning with fewer bytes written than Content-Length makes
		// net/http close the connection: a FIN, which containerd resumes
		// from, not a reset, which fails its whole pull.
		s.log.Warn("blob response ended short: the download failed", "digest", p.Digest(),
			"upstream", rt.up.Name(), "err", err)
	}
}

// copyAvailable copies [start, end) of the download to w, waiting for bytes
// as they land. Copying from the *os.File lets net/http use sendfile.
func copyAvailable(ctx context.Context, w io.Writer, f *os.File, p content.Reader, start, end int64) error {
	for off := start; off < end; {
		n, err := p.WaitAvailable(ctx, off)
		if err != nil {
			return err
		}
		n = min(n, end-off)
		if _, err := f.Seek(off, io.SeekStart); err != nil {
			return err
		}
		copied, err := io.CopyN(w, f, n)
		off += copied
		if err != nil {
			return err
		}
	}
	return nil
}

// Where an answer came from, as the Pullproxy-Source header says it: the
// store, a download in flight (its bytes as they land), or the upstream
// just now (a manifest, tag list or referrers fetched for this request).
// A benchmark of a warm cache can check it is one. With a shared bucket,
// "bucket" is a HEAD answered from it or a redirect to it.
const (
	sourceCache    = "cache"
	sourceDownload = "download"
	sourceUpstream = "upstream"
	sourceBucket   = "bucket" // the bucket replicas share (a HEAD, or a redirect to it)
)

var sourceValues = map[string][]string{
	sourceCache: {sourceCache}, sourceDownload: {sourceDownload}, sourceUpstream: {sourceUpstream}, sourceBucket: {sourceBucket},
}

// setSource says where the answer came from, in its header and to the
// request's metrics.
func setSource(w http.ResponseWriter, source string) {
	w.Header()["Pullproxy-Source"] = sourceValues[source]
	if rw, ok := w.(*responseRecorder); ok {
		rw.source = source
	}
}
