package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/pullproxy/pullproxy/upstream"
)

// TestColdBlobFetchedOnce: twenty clients asking for one cold blob at once
// cause one upstream fetch, and all of them get the verified bytes.
func TestColdBlobFetchedOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 4<<20, 1)
	layer, want := layerDigest(t, img, 0)

	const clients = 20
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Get(e.proxy.URL + "/v2/test/app/blobs/" + layer.String() + "?ns=" + upstreamName)
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			got, err := io.ReadAll(resp.Body)
			if err != nil || !bytes.Equal(got, want) {
				errs <- fmt.Errorf("status %d, %d bytes, err %v", resp.StatusCode, len(got), err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Once: the blob's bytes, and at most the rest of a chunk asked for
	// again at its end when the chunk's connection looked silent (a
	// hedge, which a CPU-starved test run can set off), far from the
	// twenty blobs' worth that twenty fetches would bring.
	if n := e.counter.count("bytes " + layer.String()); n < len(want) || n > len(want)*5/4 {
		t.Errorf("upstream bytes of the layer: got %d, want %d, or up to a quarter more (fetched once)", n, len(want))
	}
}

// TestTagServedStaleWhenUpstreamFails: with the tag due for revalidation and
// the upstream failing (down, or rate limiting us), the cached digest is
// served, logged and counted: never an error when a cached answer exists.
func TestTagServedStaleWhenUpstreamFails(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusServiceUnavailable, http.StatusTooManyRequests, http.StatusUnauthorized} {
		t.Run(strconv.Itoa(status), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, WithTagTTL(0))
			img := e.push("test/app", "v1", 1000, 1)
			want, _ := img.Digest()
			path := "/v2/test/app/manifests/v1?ns=" + upstreamName
			if resp, body := e.get("GET", path, nil); resp.StatusCode != 200 {
				t.Fatalf("warm-up: status %d: %s", resp.StatusCode, body)
			}
			e.counter.downStatus.Store(int64(status))
			e.counter.down.Store(true)
			for _, method := range []string{"HEAD", "GET"} {
				resp, body := e.get(method, path, nil)
				if resp.StatusCode != 200 || resp.Header.Get("Docker-Content-Digest") != want.String() {
					t.Errorf("%s with upstream answering %d: status %d, digest %q, want 200 and %s: %s",
						method, status, resp.StatusCode, resp.Header.Get("Docker-Content-Digest"), want, body)
				}
			}
			if got := testutil.ToFloat64(e.srv.metrics.stale.WithLabelValues(upstreamName, "tag")); got != 2 {
				t.Errorf("stale tags served: got %v, want 2", got)
			}
		})
	}
}

// TestFreshTagNotRevalidated: within the TTL a tag is answered from cache
// without asking upstream.
func TestFreshTagNotRevalidated(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithTagTTL(time.Hour))
	e.push("test/app", "v1", 1000, 1)
	path := "/v2/test/app/manifests/v1?ns=" + upstreamName
	e.get("HEAD", path, nil)
	before := e.counter.count("HEAD manifests") + e.counter.count("GET manifests")
	for range 3 {
		if resp, _ := e.get("HEAD", path, nil); resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	if after := e.counter.count("HEAD manifests") + e.counter.count("GET manifests"); after != before {
		t.Errorf("upstream manifest requests went from %d to %d within the TTL", before, after)
	}
}

// TestRestartServesFromDisk: after a restart on the same data dir, with the
// upstream gone, everything pulled before is still served.
func TestRestartServesFromDisk(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithTagTTL(time.Hour))
	img := e.push("test/app", "v1", 100_000, 2)
	layer, want := layerDigest(t, img, 1)
	tag := "/v2/test/app/manifests/v1?ns=" + upstreamName
	blob := "/v2/test/app/blobs/" + layer.String() + "?ns=" + upstreamName
	e.get("GET", tag, nil)
	e.get("GET", blob, nil)

	e.stop()
	e.upstream.Close()
	e.start(e.upstream.URL, WithTagTTL(time.Hour))
	if resp, body := e.get("GET", tag, nil); resp.StatusCode != 200 {
		t.Errorf("tag after restart: status %d: %s", resp.StatusCode, body)
	}
	if resp, body := e.get("GET", blob, nil); resp.StatusCode != 200 || !bytes.Equal(body, want) {
		t.Errorf("blob after restart: status %d, %d bytes", resp.StatusCode, len(body))
	}
}

// blobServer is an upstream serving one blob, with faults: it cuts every
// response after cut bytes, fails every request after failAfter ones, or
// serves corrupt bytes.
type blobServer struct {
	content []byte
	digest  digest.Digest
	// cut and failAfter may change while a download's requests still run.
	cut       atomic.Int64  // bytes per response before the connection is dropped; 0: none
	failAfter atomic.Int64  // requests answered before every further one gets 500; 0: none
	failGate  chan struct{} // when set, a failing request waits for it to close
	corrupt   bool
	holdAt    int64         // offset in the blob at which responses wait for hold to close; 0: none
	hold      chan struct{} // see holdAt
	repo      string        // the only repository holding the blob; "": any
	requests  atomic.Int64
	sent      atomic.Int64 // body bytes written to clients
}

func newBlobServer(t testing.TB, content []byte) (*blobServer, *httptest.Server) {
	b := &blobServer{content: content, digest: digest.FromBytes(content)}
	srv := httptest.NewServer(b)
	t.Cleanup(srv.Close)
	return b, srv
}

func (b *blobServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if b.repo != "" && !strings.HasPrefix(r.URL.Path, "/v2/"+b.repo+"/") {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown to registry"}]}`)
		return
	}
	n := b.requests.Add(1)
	if fail := b.failAfter.Load(); fail > 0 && n > fail {
		if b.failGate != nil {
			select {
			case <-b.failGate:
			case <-r.Context().Done():
			}
		}
		http.Error(w, "broken", http.StatusInternalServerError)
		return
	}
	content := b.content
	if b.corrupt {
		// A byte in every 64 KiB: every range of a chunk's size is wrong.
		content = bytes.Clone(content)
		for i := min(len(content)/2, 32<<10); i < len(content); i += 64 << 10 {
			content[i] ^= 0xff
		}
	}
	var out io.Writer = &sentCounter{w: w, n: &b.sent}
	if cut := b.cut.Load(); cut > 0 {
		out = &cutWriter{w: out, flush: w.(http.Flusher), left: cut}
	}
	if b.holdAt > 0 && r.Method == http.MethodGet {
		if first, _, ok := strings.Cut(strings.TrimPrefix(r.Header.Get("Range"), "bytes="), "-"); ok || r.Header.Get("Range") == "" {
			start, _ := strconv.ParseInt(first, 10, 64)
			if start <= b.holdAt {
				out = &holdWriter{w: out, flush: w.(http.Flusher), left: b.holdAt - start, hold: b.hold}
			}
		}
	}
	w.Header().Set("Docker-Content-Digest", b.digest.String())
	http.ServeContent(writerFunc{w, out}, r, "", time.Time{}, bytes.NewReader(content))
}

// sentCounter counts bytes written.
type sentCounter struct {
	w io.Writer
	n *atomic.Int64
}

func (c *sentCounter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n.Add(int64(n))
	return n, err
}

// cutWriter aborts the response once left bytes are written.
type cutWriter struct {
	w     io.Writer
	flush http.Flusher
	left  int64
}

func (c *cutWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > c.left {
		c.w.Write(p[:c.left])
		c.flush.Flush()
		panic(http.ErrAbortHandler)
	}
	c.left -= int64(len(p))
	return c.w.Write(p)
}

// holdWriter pauses the response after left bytes until hold is closed.
type holdWriter struct {
	w     io.Writer
	flush http.Flusher
	left  int64
	hold  chan struct{}
}

func (h *holdWriter) Write(p []byte) (int, error) {
	if h.left >= 0 && int64(len(p)) > h.left {
		n, err := h.w.Write(p[:h.left])
		if err != nil {
			return n, err
		}
		h.flush.Flush()
		<-h.hold
		p, h.left = p[h.left:], -1
		m, err := h.w.Write(p)
		return n + m, err
	}
	if h.left >= 0 {
		h.left -= int64(len(p))
	}
	return h.w.Write(p)
}

type writerFunc struct {
	http.ResponseWriter
	out io.Writer
}

func (w writerFunc) Write(p []byte) (int, error) { return w.out.Write(p) }

func blobEnv(t testing.TB, b *blobServer, srv *httptest.Server) *env {
	e := &env{t: t, dir: t.TempDir(), upstream: srv, counter: &counter{counts: map[string]int{}}}
	e.start(srv.URL)
	return e
}

// TestFetchResumesAfterCuts: an upstream that drops every connection after
// 256 KiB still yields the whole blob, fetched by resuming with Range.
func TestFetchResumesAfterCuts(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 3<<20)
	b, srv := newBlobServer(t, content)
	b.cut.Store(256 << 10)
	e := blobEnv(t, b, srv)
	resp, body := e.get("GET", "/v2/test/app/blobs/"+b.digest.String()+"?ns="+upstreamName, nil)
	if resp.StatusCode != 200 || !bytes.Equal(body, content) {
		t.Fatalf("status %d, %d bytes of %d", resp.StatusCode, len(body), len(content))
	}
	if n := b.sent.Load(); n != int64(len(content)) {
		t.Errorf("upstream bytes: got %d, want %d (every byte received kept)", n, len(content))
	}
}

// TestFailedFetchEndsResponseCleanly: when the upstream fails for good in the
// middle of a blob, the client's response ends short with a clean close
// (unexpected EOF, which containerd resumes from), never a reset; and the
// next request starts a fresh download.
func TestFailedFetchEndsResponseCleanly(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 2<<20)
	b, srv := newBlobServer(t, content)
	b.cut.Store(512 << 10) // the HEAD and the first chunk are answered
	b.failAfter.Store(2)
	// The failures wait until the client has its answer's header: the
	// first chunk's cut is asked for again at once.
	b.failGate = make(chan struct{})
	e := blobEnv(t, b, srv)
	url := e.proxy.URL + "/v2/test/app/blobs/" + b.digest.String() + "?ns=" + upstreamName

	resp, err := http.Get(url)
	close(b.failGate)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("reading the body: got %v, want unexpected EOF (a clean close)", err)
	}
	if resp.ContentLength != int64(len(content)) || len(got) >= len(content) || !bytes.Equal(got, content[:len(got)]) {
		t.Errorf("got %d correct-prefix bytes of Content-Length %d; want a short, correct prefix of %d",
			len(got), resp.ContentLength, len(content))
	}

	b.cut.Store(0)
	b.failAfter.Store(0)
	if resp, body := e.get("GET", "/v2/test/app/blobs/"+b.digest.String()+"?ns="+upstreamName, nil); resp.StatusCode != 200 || !bytes.Equal(body, content) {
		t.Errorf("retry after the upstream recovered: status %d, %d bytes", resp.StatusCode, len(body))
	}
}

// TestCorruptBlobNeverCompleteNorCached: bytes that do not match their digest
// are never delivered whole, and never cached; with no other endpoint to ask,
// the next request is answered at once with an error that names the
// endpoint and what was found, instead of downloading the bad bytes again.
func TestCorruptBlobNeverCompleteNorCached(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 1<<20)
	b, srv := newBlobServer(t, content)
	b.corrupt = true
	e := blobEnv(t, b, srv)
	path := "/v2/test/app/blobs/" + b.digest.String() + "?ns=" + upstreamName
	resp, err := http.Get(e.proxy.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil && resp.StatusCode == 200 {
		t.Fatalf("got a complete 200 response of %d bytes for a corrupt blob", len(got))
	}

	resp, body := e.get("GET", path, nil)
	host := strings.TrimPrefix(srv.URL, "http://")
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), host) ||
		!strings.Contains(string(body), "hash to sha256:") {
		t.Errorf("asked again: got %d %s, want 502 naming %s and the digest the bytes had", resp.StatusCode, body, host)
	}
	if n := b.sent.Load(); n != int64(len(content)) {
		t.Errorf("upstream bytes: got %d, want %d (fetched once)", n, len(content))
	}
	if _, err := e.store.StatBlob(context.Background(), b.digest); err == nil {
		t.Error("the corrupt blob was stored")
	}
}

// TestDownloadOutlivesClient: a client that reads part of a cold blob and
// hangs up (as containerd's multipart fetch does) does not stop the
// download; the blob is committed and the next client is served from disk.
func TestDownloadOutlivesClient(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 2<<20)
	b, srv := newBlobServer(t, content)
	b.holdAt, b.hold = 512<<10, make(chan struct{})
	e := blobEnv(t, b, srv)
	path := "/v2/test/app/blobs/" + b.digest.String() + "?ns=" + upstreamName

	resp, err := http.Get(e.proxy.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 100<<10)); err != nil {
		t.Fatal(err)
	}
	p, _ := e.srv.downloads.lookup(t.Context(), route{up: e.srv.upstreams[upstreamName], repo: "test/app"}, b.digest)
	resp.Body.Close() // hang up mid-blob
	if p == nil {
		t.Fatal("no download in flight while the upstream is held")
	}
	close(b.hold)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The last bytes become available only once the blob is verified.
	if _, err := p.WaitAvailable(ctx, int64(len(content))-1); err != nil {
		t.Fatalf("waiting for the download to finish: %v", err)
	}
	waitCommitted(t, e, b.digest)
	if _, err := e.store.StatBlob(ctx, b.digest); err != nil {
		t.Fatalf("download finished but not committed: %v", err)
	}
	if resp, body := e.get("GET", path, nil); resp.StatusCode != 200 || !bytes.Equal(body, content) {
		t.Errorf("after the download: status %d, %d bytes", resp.StatusCode, len(body))
	}
	if n := b.sent.Load(); n != int64(len(content)) {
		t.Errorf("upstream bytes: got %d, want %d", n, len(content))
	}
}

// TestCorruptEndpointFallsBackToNext: a blob that fails verification from
// the first endpoint is fetched again from the next, and only the good
// bytes are ever served complete.
func TestCorruptEndpointFallsBackToNext(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 1<<20)
	bad, badSrv := newBlobServer(t, content)
	bad.corrupt = true
	good, goodSrv := newBlobServer(t, content)
	e := &env{t: t, dir: t.TempDir(), upstream: badSrv, counter: &counter{counts: map[string]int{}},
		upOpts: []upstream.Option{upstream.WithFailoverOnly(goodSrv.URL)}}
	e.start(badSrv.URL + "," + goodSrv.URL)
	url := e.proxy.URL + "/v2/test/app/blobs/" + bad.digest.String() + "?ns=" + upstreamName

	// The first client may be served from the corrupt attempt: a short
	// read, or, when the attempt failed before the client's answer began,
	// its error (502).
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil && resp.StatusCode == http.StatusOK && !bytes.Equal(got, content) {
		t.Fatalf("a complete response with the wrong bytes")
	}
	// Asking again, as containerd does after a short read, gets the blob.
	if resp, body := e.get("GET", "/v2/test/app/blobs/"+bad.digest.String()+"?ns="+upstreamName, nil); resp.StatusCode != 200 || !bytes.Equal(body, content) {
		t.Fatalf("retry: status %d, %d bytes", resp.StatusCode, len(body))
	}
	// The good endpoint sends the blob once: not a second download of it.
	// Part of it may come twice: a chunk that looks silent has its rest
	// asked for again, and once, under the race detector with every
	// package's tests at once, the good endpoint's answer took 2.4 s and
	// it sent 1.5 MiB of the 1 MiB blob (90 runs under load: never again).
	if n := good.sent.Load(); bad.sent.Load() == 0 || n < int64(len(content)) || n >= 2*int64(len(content)) {
		t.Errorf("bytes sent: corrupt endpoint %d, good endpoint %d; want some, and the blob once (with at most part of it again)", bad.sent.Load(), n)
	}
}

// TestCorruptEndpointAmongSharing: of two endpoints that fetch a blob
// together, one serves it corrupt, first or second in the configuration.
// Which one is not known from a digest over bytes from both: the ranges of
// the one that brought fewer are fetched again from the other, keeping the
// rest, until the digest matches or the failure names the corrupt one. It
// is kept from the blob; clients asking again get the right bytes.
func TestCorruptEndpointAmongSharing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		badFirst bool
		core     bool // through the mirror core's EnsureBlob, not HTTP
	}{{true, false}, {false, false}, {true, true}} {
		badFirst := tc.badFirst
		t.Run(fmt.Sprintf("corrupt endpoint first: %v, core: %v", badFirst, tc.core), func(t *testing.T) {
			t.Parallel()
			content := randomBytes(t, 4<<20)
			bad, badSrv := newBlobServer(t, content)
			bad.corrupt = true
			good, goodSrv := newBlobServer(t, content)
			e := &env{t: t, dir: t.TempDir(), upstream: badSrv, counter: &counter{counts: map[string]int{}}}
			if badFirst {
				e.start(badSrv.URL + "," + goodSrv.URL)
			} else {
				e.start(goodSrv.URL + "," + badSrv.URL)
			}
			path := "/v2/test/app/blobs/" + bad.digest.String() + "?ns=" + upstreamName
			var attempts int
			if tc.core {
				// A Go caller waits through the attempts, in one call; the
				// request below then finds the blob stored.
				var landed int64
				size, err := e.srv.EnsureBlob(t.Context(), upstreamName, "test/app", bad.digest, func(n int64) { landed += n })
				if err != nil || size != int64(len(content)) || landed != size {
					t.Fatalf("EnsureBlob: %d bytes, %d landed, %v; want %d, each byte landed once", size, landed, err, len(content))
				}
			}
			for attempts = 1; attempts <= 4; attempts++ {
				// A request joined to an attempt that fails verification gets a
				// short read (or a 502 when it failed before its answer began),
				// and asks again, as containerd does.
				resp, err := http.Get(e.proxy.URL + path)
				if err != nil {
					t.Fatal(err)
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err == nil && resp.StatusCode == http.StatusOK {
					if !bytes.Equal(body, content) {
						t.Fatalf("request %d: a complete response with the wrong bytes", attempts)
					}
					break
				}
			}
			if attempts > 4 {
				t.Fatal("the blob was not served intact within four requests")
			}
			// The verified download names the suspect just after serving
			// the blob's end.
			var corrupt []string
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				corrupt = corrupt[:0]
				for _, c := range e.up.Status().Corrupt {
					corrupt = append(corrupt, c.Endpoint)
				}
				if len(corrupt) > 0 || time.Now().After(deadline) {
					break
				}
			}
			if len(corrupt) != 1 || corrupt[0] != badSrv.URL {
				t.Errorf("endpoints recorded as serving the blob corrupt: %v, want only %s", corrupt, badSrv.URL)
			}
			t.Logf("requests until served intact: %d; bytes sent: corrupt endpoint %d, good endpoint %d (the blob is %d)",
				attempts, bad.sent.Load(), good.sent.Load(), len(content))
		})
	}
}
