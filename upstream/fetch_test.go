package upstream

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
)

// memBlobWriter is an in-memory BlobWriter.
type memBlobWriter struct {
	mu   sync.Mutex
	size int64
	data []byte
	have []bool // which bytes were written
}

func newMemBlobWriter(size int64) *memBlobWriter { return &memBlobWriter{size: size} }

// newPrefilled returns a writer of the given size (-1: unknown) holding the
// first n bytes of blob.
func newPrefilled(t *testing.T, size int64, blob []byte, n int) *memBlobWriter {
	t.Helper()
	w := newMemBlobWriter(size)
	if _, err := w.WriteAt(blob[:n], 0); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
	return w
}

func (w *memBlobWriter) WriteAt(p []byte, off int64) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	end := off + int64(len(p))
	if w.size >= 0 && end > w.size {
		return 0, fmt.Errorf("write of bytes %d-%d past the end, %d", off, end-1, w.size)
	}
	if end > int64(len(w.data)) {
		w.data = append(w.data, make([]byte, end-int64(len(w.data)))...)
		w.have = append(w.have, make([]bool, end-int64(len(w.have)))...)
	}
	copy(w.data[off:], p)
	for i := off; i < end; i++ {
		w.have[i] = true
	}
	return len(p), nil
}

func (w *memBlobWriter) Size() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.size
}

func (w *memBlobWriter) SetSize(n int64) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.size >= 0 && w.size != n {
		return fmt.Errorf("size %d contradicts the known %d", n, w.size)
	}
	if n < int64(len(w.data)) {
		return fmt.Errorf("size %d is below the %d bytes written", n, len(w.data))
	}
	w.size = n
	return nil
}

func (w *memBlobWriter) Written() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.written()
}

func (w *memBlobWriter) written() int64 {
	n := slices.Index(w.have, false)
	if n < 0 {
		n = len(w.have)
	}
	return int64(n)
}

func (w *memBlobWriter) Missing(off int64) (int64, int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.size < 0 {
		return off, off
	}
	start := off
	for start < w.size && start < int64(len(w.have)) && w.have[start] {
		start++
	}
	end := start
	for end < w.size && (end >= int64(len(w.have)) || !w.have[end]) {
		end++
	}
	return start, end
}

func (w *memBlobWriter) Wanted() []int64 { return nil }

// Bytes returns the contiguous prefix written.
func (w *memBlobWriter) Bytes() []byte {
	w.mu.Lock()
	defer w.mu.Unlock()
	return bytes.Clone(w.data[:w.written()])
}

func randomBlob(n int) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(uint64(n), 42))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// checkBlob checks that w holds exactly blob.
func checkBlob(t *testing.T, w *memBlobWriter, blob []byte) {
	t.Helper()
	if got := w.Size(); got != int64(len(blob)) {
		t.Errorf("Size: got %v, want %v", got, len(blob))
	}
	if got := w.Bytes(); !bytes.Equal(got, blob) {
		t.Errorf("content: got %d bytes hashing to %v, want %d hashing to %v",
			len(got), digest.FromBytes(got), len(blob), digest.FromBytes(blob))
	}
}

// rangeServer serves one blob, recording each request's Range header.
type rangeServer struct {
	blob        []byte
	ignoreRange bool // answer every request with the whole blob
	chunked     bool // send no Content-Length on 200 answers
	// dropAfter, when not 0, is how many body bytes a response carries
	// before the connection is cut; dropOnce cuts only the first.
	dropAfter int
	dropOnce  bool

	mu     sync.Mutex
	ranges []string
	auth   []string
	query  []string
}

func (s *rangeServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.ranges = append(s.ranges, r.Header.Get("Range"))
	s.auth = append(s.auth, r.Header.Get("Authorization"))
	s.query = append(s.query, r.URL.RawQuery)
	drop := s.dropAfter > 0 && (!s.dropOnce || len(s.ranges) == 1)
	s.mu.Unlock()

	body := s.blob
	rng := r.Header.Get("Range")
	if rng != "" && !s.ignoreRange {
		var first, last int
		spec := strings.TrimPrefix(rng, "bytes=")
		a, b, _ := strings.Cut(spec, "-")
		first, err := strconv.Atoi(a)
		if err != nil {
			http.Error(w, "bad range", http.StatusRequestedRangeNotSatisfiable)
			return
		}
		last = len(s.blob) - 1
		if b != "" {
			if last, err = strconv.Atoi(b); err != nil {
				http.Error(w, "bad range", http.StatusRequestedRangeNotSatisfiable)
				return
			}
		}
		body = s.blob[first : last+1]
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", first, last, len(s.blob)))
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(http.StatusPartialContent)
	} else {
		if !s.chunked {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		}
		w.WriteHeader(http.StatusOK)
	}
	if drop && len(body) > s.dropAfter {
		w.Write(body[:s.dropAfter])
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler) // cut the connection mid-body
	}
	w.Write(body)
}

func (s *rangeServer) seen() (ranges, auth, query []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.ranges), slices.Clone(s.auth), slices.Clone(s.query)
}

func TestFetchBlobWhole(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		size    int
		chunked bool
		known   bool // the writer knows the size beforehand
	}{
		{"small", 1000, false, false},
		{"small, size known", 1000, false, true},
		{"empty", 0, false, false},
		{"larger than the read buffer", 3*fetchBufferSize + 17, false, false},
		{"chunked", 100_000, true, false},
		{"chunked, size known", 100_000, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			blob := randomBlob(tt.size)
			s := &rangeServer{blob: blob, chunked: tt.chunked}
			srv := httptest.NewServer(s)
			t.Cleanup(srv.Close)
			r := newTestRegistry(t, srv.URL)
			w := newMemBlobWriter(-1)
			if tt.known {
				w = newMemBlobWriter(int64(tt.size))
			}
			if err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			checkBlob(t, w, blob)
			if ranges, _, _ := s.seen(); !slices.Equal(ranges, []string{""}) {
				t.Errorf("Range headers: got %q, want %q", ranges, []string{""})
			}
		})
	}
}

// TestFetchBlobResume checks resuming after cut connections and from a
// partly filled writer, with upstreams that honour Range and that ignore it.
func TestFetchBlobResume(t *testing.T) {
	t.Parallel()
	const size = 3500
	type server struct {
		ignoreRange, chunked bool
		dropAfter            int
		dropOnce             bool
	}
	tests := []struct {
		name       string
		server     server
		prefill    int
		knownSize  bool
		wantRanges []string
	}{
		{"every response cut after 1000 bytes",
			server{dropAfter: 1000}, 0, false,
			[]string{"", "bytes=1000-3499", "bytes=2000-3499", "bytes=3000-3499"}},
		{"every response cut, the first one chunked",
			server{dropAfter: 1000, chunked: true}, 0, false,
			[]string{"", "bytes=1000-", "bytes=2000-3499", "bytes=3000-3499"}},
		{"Range ignored after a cut",
			server{dropAfter: 1000, dropOnce: true, ignoreRange: true}, 0, false,
			[]string{"", "bytes=1000-3499"}},
		{"partly filled writer, size known",
			server{}, 1500, true,
			[]string{"bytes=1500-3499"}},
		{"partly filled writer, size unknown",
			server{}, 1500, false,
			[]string{"bytes=1500-"}},
		{"partly filled writer, Range ignored",
			server{ignoreRange: true}, 1500, true,
			[]string{"bytes=1500-3499"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			blob := randomBlob(size)
			s := &rangeServer{blob: blob, ignoreRange: tt.server.ignoreRange, chunked: tt.server.chunked,
				dropAfter: tt.server.dropAfter, dropOnce: tt.server.dropOnce}
			srv := httptest.NewServer(s)
			t.Cleanup(srv.Close)
			r := newTestRegistry(t, srv.URL)
			known := int64(-1)
			if tt.knownSize {
				known = size
			}
			w := newPrefilled(t, known, blob, tt.prefill)
			if err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			checkBlob(t, w, blob)
			if ranges, _, _ := s.seen(); !slices.Equal(ranges, tt.wantRanges) {
				t.Errorf("Range headers: got %q, want %q", ranges, tt.wantRanges)
			}
		})
	}
}

// TestFetchBlobAlreadyComplete checks that a full writer needs no request.
func TestFetchBlobAlreadyComplete(t *testing.T) {
	t.Parallel()
	blob := randomBlob(100)
	h := &countingHandler{h: &rangeServer{blob: blob}}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	r := newTestRegistry(t, srv.URL)
	w := newPrefilled(t, int64(len(blob)), blob, len(blob))
	if err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	if got := h.n.Load(); got != 0 {
		t.Errorf("requests: got %v, want %v", got, 0)
	}
}

// TestFetchBlobFailover checks that a blob comes from the second endpoint
// when the first fails.
func TestFetchBlobFailover(t *testing.T) {
	t.Parallel()
	blob := randomBlob(5000)
	first := httptest.NewServer(statusHandler(http.StatusBadGateway))
	t.Cleanup(first.Close)
	second := httptest.NewServer(&rangeServer{blob: blob})
	t.Cleanup(second.Close)
	r := newTestRegistry(t, first.URL, second.URL)
	w := newMemBlobWriter(-1)
	if err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
}

// TestFetchBlobFailsAtOnce checks answers that are not worth a retry.
func TestFetchBlobFailsAtOnce(t *testing.T) {
	t.Parallel()
	blob := randomBlob(20)
	ok := func(h http.Header) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			for k, v := range h {
				w.Header()[k] = v
			}
			if h.Get("Content-Range") != "" {
				w.WriteHeader(http.StatusPartialContent)
				w.Write(blob[10:])
				return
			}
			w.Write(blob)
		})
	}
	chunked := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.(http.Flusher).Flush()
		w.Write(blob)
	})
	tests := []struct {
		name    string
		handler http.Handler
		writer  func(t *testing.T) *memBlobWriter
		kind    error
		status  int
	}{
		{"404", statusHandler(404), nil, ErrNotFound, 404},
		{"403", statusHandler(403), nil, ErrDenied, 403},
		{"401 without a challenge", statusHandler(401), nil, ErrUnauthorized, 401},
		{"429", statusHandler(429), nil, ErrTooManyRequests, 429},
		{"416", statusHandler(416), nil, ErrInvalid, 416},
		{"size conflict", ok(nil),
			func(*testing.T) *memBlobWriter { return newMemBlobWriter(10) }, ErrInvalid, 200},
		{"size conflict in Content-Range", ok(http.Header{"Content-Range": {"bytes 10-19/40"}}),
			func(t *testing.T) *memBlobWriter { return newPrefilled(t, 20, blob, 10) }, ErrInvalid, 206},
		{"more bytes than expected, chunked", chunked,
			func(*testing.T) *memBlobWriter { return newMemBlobWriter(10) }, ErrInvalid, 200},
		{"Content-Range at the wrong offset", ok(http.Header{"Content-Range": {"bytes 0-19/20"}}),
			func(t *testing.T) *memBlobWriter { return newPrefilled(t, 20, blob, 10) }, ErrInvalid, 206},
		{"206 with a garbled Content-Range", ok(http.Header{"Content-Range": {"garbage"}}),
			func(t *testing.T) *memBlobWriter { return newPrefilled(t, 20, blob, 10) }, ErrInvalid, 206},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := &countingHandler{h: tt.handler}
			srv := httptest.NewServer(h)
			t.Cleanup(srv.Close)
			r := newTestRegistry(t, srv.URL)
			w := newMemBlobWriter(-1)
			if tt.writer != nil {
				w = tt.writer(t)
			}
			err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w)
			checkKind(t, err, tt.kind)
			e := asError(t, err)
			if e.Status != tt.status {
				t.Errorf("Status: got %v, want %v", e.Status, tt.status)
			}
			if want := "GET /v2/org/app/blobs/" + digest.FromBytes(blob).String(); e.Op != want {
				t.Errorf("Op: got %v, want %v", e.Op, want)
			}
			if got := h.n.Load(); got != 1 {
				t.Errorf("requests: got %v, want %v", got, 1)
			}
		})
	}
}

// TestFetchBlobRedirect checks that a blob redirected to another host (as to
// object storage) is fetched from there without the registry's token.
func TestFetchBlobRedirect(t *testing.T) {
	t.Parallel()
	blob := randomBlob(4000)
	cdn := &rangeServer{blob: blob}
	cdnSrv := httptest.NewServer(cdn)
	t.Cleanup(cdnSrv.Close)
	// net/http keeps Authorization on a redirect to the same host name on
	// another port; name the storage host differently, as S3 would be.
	location := strings.Replace(cdnSrv.URL, "127.0.0.1", "localhost", 1) + "/blobs/x?X-Amz-Signature=SECRET"
	ts, g, r := newBearerSetup(t, func(_ *tokenServer, g *bearerRegistry) {
		g.blob = blob
		g.blobLocation = location
	})
	w := newMemBlobWriter(-1)
	if err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	_, auth, query := cdn.seen()
	if !slices.Equal(auth, []string{""}) {
		t.Errorf("Authorization at the storage host: got %q, want %q", auth, []string{""})
	}
	if !slices.Equal(query, []string{"X-Amz-Signature=SECRET"}) {
		t.Errorf("query at the storage host: got %q, want %q", query, []string{"X-Amz-Signature=SECRET"})
	}
	if got := ts.totalFetches(); got != 1 {
		t.Errorf("token fetches: got %v, want %v", got, 1)
	}
	if n, rejected := g.counts(); n != 1 || len(rejected) != 0 {
		t.Errorf("registry: got %d unauthenticated and %q rejected, want 1 and none", n, rejected)
	}
}

// TestFetchBlobRedirectResume checks a resume through a redirect: the Range
// header reaches the storage host.
func TestFetchBlobRedirectResume(t *testing.T) {
	t.Parallel()
	blob := randomBlob(4000)
	cdn := &rangeServer{blob: blob, dropAfter: 2500, dropOnce: true}
	cdnSrv := httptest.NewServer(cdn)
	t.Cleanup(cdnSrv.Close)
	regSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, cdnSrv.URL+"/b?sig=x", http.StatusTemporaryRedirect)
	}))
	t.Cleanup(regSrv.Close)
	r := newTestRegistry(t, regSrv.URL)
	w := newMemBlobWriter(-1)
	if err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	if ranges, _, _ := cdn.seen(); !slices.Equal(ranges, []string{"", "bytes=2500-3999"}) {
		t.Errorf("Range headers: got %q, want %q", ranges, []string{"", "bytes=2500-3999"})
	}
}

// failingReader fails every read.
type failingReader struct{ err error }

func (f failingReader) Read([]byte) (int, error) { return 0, f.err }

// response builds a response for memNet.
func response(status int, header http.Header, contentLength int64, body io.Reader) *http.Response {
	if header == nil {
		header = http.Header{}
	}
	return &http.Response{
		Status:        fmt.Sprintf("%d %s", status, http.StatusText(status)),
		StatusCode:    status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        header,
		ContentLength: contentLength,
		Body:          io.NopCloser(body),
	}
}

// cutBody is a body that ends in a broken connection after n bytes of b.
func cutBody(b []byte, n int) io.Reader {
	return io.MultiReader(bytes.NewReader(b[:n]), failingReader{errors.New("read tcp: connection reset by peer")})
}

// scriptedBlob serves a blob in a synctest bubble: answer i (from 0) is
// script(i, range header).
type scriptedBlob struct {
	mu     sync.Mutex
	ranges []string
	script func(i int, rng string) *http.Response
}

func (s *scriptedBlob) RoundTrip(req *http.Request) (*http.Response, error) {
	s.mu.Lock()
	i := len(s.ranges)
	s.ranges = append(s.ranges, req.Header.Get("Range"))
	s.mu.Unlock()
	return s.script(i, req.Header.Get("Range")), nil
}

func (s *scriptedBlob) seen() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.ranges)
}

// TestFetchBlobGivesUp checks that a fetch that keeps failing without
// progress stops after maxAttemptsWithoutProgress attempts, backing off in
// between. It runs in a bubble: the backoff adds up to seconds of real time.
func TestFetchBlobGivesUp(t *testing.T) {
	t.Parallel()
	const size = 3000
	blob := randomBlob(size)
	serverError := func() *http.Response { return response(500, nil, 0, strings.NewReader("")) }
	tests := []struct {
		name       string
		script     func(i int, rng string) *http.Response // nil: connection refused
		wantRanges []string
		status     int
		// minWait and maxWait bound the total backoff.
		minWait, maxWait time.Duration
		wantWritten      int64
	}{
		{"500 after a partial response",
			func(i int, _ string) *http.Response {
				if i == 0 {
					return response(200, nil, size, cutBody(blob, 1000))
				}
				return serverError()
			},
			[]string{"", "bytes=1000-2999", "bytes=1000-2999", "bytes=1000-2999", "bytes=1000-2999", "bytes=1000-2999"},
			500, 1550 * time.Millisecond, 3100 * time.Millisecond, 1000},
		{"500 from the start",
			func(int, string) *http.Response { return serverError() },
			[]string{"", "", "", "", ""},
			500, 1500 * time.Millisecond, 3000 * time.Millisecond, 0},
		{"connection refused", nil, nil, 0, 1500 * time.Millisecond, 3000 * time.Millisecond, 0},
		{"Range ignored, every answer cut at the same byte",
			func(int, string) *http.Response { return response(200, nil, size, cutBody(blob, 2000)) },
			[]string{"", "bytes=2000-2999", "bytes=2000-2999", "bytes=2000-2999", "bytes=2000-2999", "bytes=2000-2999"},
			200, 1550 * time.Millisecond, 3100 * time.Millisecond, 2000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				n := memNet{}
				s := &scriptedBlob{script: tt.script}
				if tt.script != nil {
					n["registry.test"] = s
				}
				r := newMemRegistry(t, n, "https://registry.test")
				w := newMemBlobWriter(-1)
				start := time.Now()
				err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w)
				waited := time.Since(start)
				checkKind(t, err, ErrUnavailable)
				if e := asError(t, err); e.Status != tt.status {
					t.Errorf("Status: got %v, want %v", e.Status, tt.status)
				}
				if got := s.seen(); !slices.Equal(got, tt.wantRanges) {
					t.Errorf("Range headers: got %q, want %q", got, tt.wantRanges)
				}
				if waited < tt.minWait || waited > tt.maxWait {
					t.Errorf("time spent backing off: got %v, want %v to %v", waited, tt.minWait, tt.maxWait)
				}
				if got := w.Written(); got != tt.wantWritten {
					t.Errorf("Written: got %v, want %v", got, tt.wantWritten)
				}
			})
		})
	}
}

// TestFetchBlobProgressResetsAttempts checks that the attempt count is per
// stretch without progress: a blob that advances now and then completes.
func TestFetchBlobProgressResetsAttempts(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const size = 3000
		blob := randomBlob(size)
		// Per cycle of five: a response cut 1000 bytes on, then four 500s
		// (one short of giving up).
		s := &scriptedBlob{script: func(i int, rng string) *http.Response {
			if i%5 != 0 {
				return response(503, nil, 0, strings.NewReader(""))
			}
			first := 0
			if rng != "" {
				first, _ = strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(rng, "bytes="), "-2999"))
			}
			h := http.Header{"Content-Range": {fmt.Sprintf("bytes %d-%d/%d", first, size-1, size)}}
			return response(206, h, int64(size-first), cutBody(blob[first:], min(1000, size-first)))
		}}
		r := newMemRegistry(t, memNet{"registry.test": s}, "https://registry.test")
		w := newMemBlobWriter(-1)
		err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w)
		if err != nil {
			t.Fatalf("got %v, want no error", err)
		}
		checkBlob(t, w, blob)
		if got := len(s.seen()); got != 11 {
			t.Errorf("requests: got %v, want %v", got, 11)
		}
	})
}

// TestFetchBlobCancelledWhileBackingOff checks that the context ends the
// backoff.
func TestFetchBlobCancelledWhileBackingOff(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := &scriptedBlob{script: func(int, string) *http.Response { return response(502, nil, 0, strings.NewReader("")) }}
		r := newMemRegistry(t, memNet{"registry.test": s}, "https://registry.test")
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		start := time.Now()
		err := r.FetchBlob(ctx, "org/app", digest.FromString("x"), newMemBlobWriter(-1))
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("got %v, want %v", err, context.DeadlineExceeded)
		}
		if got := time.Since(start); got != time.Second {
			t.Errorf("returned after %v, want %v", got, time.Second)
		}
	})
}

// TestFetchBlobRedirectErrorHidesQuery checks that giving up on a presigned
// URL that cannot be reached does not put its query in the error.
func TestFetchBlobRedirectErrorHidesQuery(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		redirect := roundTripFunc(func(req *http.Request) (*http.Response, error) {
			h := http.Header{"Location": {"https://bucket.s3.test/blob?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=SECRET"}}
			return response(http.StatusTemporaryRedirect, h, 0, strings.NewReader("")), nil
		})
		r := newMemRegistry(t, memNet{"registry.test": redirect}, "https://registry.test")
		err := r.FetchBlob(t.Context(), "org/app", digest.FromString("x"), newMemBlobWriter(-1))
		checkKind(t, err, ErrUnavailable)
		msg := err.Error()
		for _, secret := range []string{"SECRET", "AKIAEXAMPLE", "X-Amz"} {
			if strings.Contains(msg, secret) {
				t.Errorf("got %q, want no %q in it", msg, secret)
			}
		}
		if !strings.Contains(msg, "bucket.s3.test/blob") {
			t.Errorf("got %q, want it to name %q", msg, "bucket.s3.test/blob")
		}
	})
}

// TestFetchBlobResumeAgainstRegistry resumes a blob half in the writer from
// go-containerregistry's registry, which refuses open-ended ranges.
func TestFetchBlobResumeAgainstRegistry(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	layer, err := random.Layer(50_000, "application/octet-stream")
	if err != nil {
		t.Fatalf("random.Layer: %v", err)
	}
	repo, err := name.NewRepository(host(srv)+"/org/app", name.Insecure)
	if err != nil {
		t.Fatalf("NewRepository: %v", err)
	}
	if err := remote.WriteLayer(repo, layer, remote.WithContext(t.Context())); err != nil {
		t.Fatalf("remote.WriteLayer: %v", err)
	}
	rc, err := layer.Compressed()
	if err != nil {
		t.Fatalf("Compressed: %v", err)
	}
	blob, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("reading the layer: %v", err)
	}
	d := digest.FromBytes(blob)
	r := newTestRegistry(t, srv.URL)
	w := newPrefilled(t, int64(len(blob)), blob, len(blob)/2)
	if err := r.FetchBlob(t.Context(), "org/app", d, w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
}

func TestParseContentRange(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in           string
		first, total int64
		ok           bool
	}{
		{"bytes 0-99/100", 0, 100, true},
		{"bytes 1000-3499/3500", 1000, 3500, true},
		{"bytes 5-9/*", 0, 0, false},
		{"bytes 9-5/100", 0, 0, false}, // ends before it starts
		{"bytes */100", 0, 0, false},
		{"bytes 100-199/100", 0, 0, false}, // starts past the end
		{"bytes -1-5/10", 0, 0, false},
		{"items 0-9/10", 0, 0, false},
		{"bytes 0-9", 0, 0, false},
		{"", 0, 0, false},
	}
	for _, tt := range tests {
		first, _, total, ok := parseContentRange(tt.in)
		if ok != tt.ok || (ok && (first != tt.first || total != tt.total)) {
			t.Errorf("parseContentRange(%q): got %v, %v, %v, want %v, %v, %v", tt.in, first, total, ok, tt.first, tt.total, tt.ok)
		}
	}
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	tests := []struct {
		attempt  int
		min, max time.Duration
	}{
		{0, 50 * time.Millisecond, 100 * time.Millisecond},
		{1, 100 * time.Millisecond, 200 * time.Millisecond},
		{4, 800 * time.Millisecond, 1600 * time.Millisecond},
		{5, 1600 * time.Millisecond, 3200 * time.Millisecond},
		{6, 2500 * time.Millisecond, 5 * time.Second},
		{50, 2500 * time.Millisecond, 5 * time.Second},
	}
	for _, tt := range tests {
		for range 200 {
			if got := backoff(tt.attempt); got < tt.min || got > tt.max {
				t.Errorf("backoff(%d): got %v, want %v to %v", tt.attempt, got, tt.min, tt.max)
				break
			}
		}
	}
}
