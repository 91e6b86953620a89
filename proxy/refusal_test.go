package proxy

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// refuser answers requests for one blob with a fixed status and an OCI error
// body, and passes everything else to next.
type refuser struct {
	next       http.Handler
	blob       string // digest refused
	status     int
	retryAfter string
	refusals   atomic.Int64
}

func (f *refuser) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !strings.HasSuffix(r.URL.Path, "/blobs/"+f.blob) {
		f.next.ServeHTTP(w, r)
		return
	}
	f.refusals.Add(1)
	if f.retryAfter != "" {
		w.Header().Set("Retry-After", f.retryAfter)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(f.status)
	fmt.Fprintf(w, `{"errors":[{"code":"TEST","message":"refused with %d for the test"}]}`, f.status)
}

// TestRefusedBlobGetsUpstreamStatus: a cold blob whose size a served
// manifest declared, refused by the upstream, is answered with the matching
// OCI error and the upstream's reason, never with a 200 that ends with no
// byte: containerd can then fall back to its next host.
func TestRefusedBlobGetsUpstreamStatus(t *testing.T) {
	t.Parallel()
	tests := []struct {
		upstream   int
		status     int
		code       string
		retryAfter string // the upstream's; the client must get one too
	}{
		{http.StatusNotFound, http.StatusNotFound, "BLOB_UNKNOWN", ""},
		{http.StatusUnauthorized, http.StatusUnauthorized, "UNAUTHORIZED", ""},
		{http.StatusForbidden, http.StatusForbidden, "DENIED", ""},
		{http.StatusTooManyRequests, http.StatusTooManyRequests, "TOOMANYREQUESTS", "30"},
		{http.StatusInternalServerError, http.StatusServiceUnavailable, "UNAVAILABLE", ""},
		{http.StatusServiceUnavailable, http.StatusServiceUnavailable, "UNAVAILABLE", ""},
	}
	for _, tt := range tests {
		t.Run(strconv.Itoa(tt.upstream), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			img := e.push("test/app", "v1", 200_000, 1)
			layer, _ := layerDigest(t, img, 0)
			f := &refuser{next: e.counter.next, blob: layer.String(), status: tt.upstream, retryAfter: tt.retryAfter}
			e.counter.next = f
			ns := "?ns=" + upstreamName

			// The manifest is served, and declares the layer's size.
			if resp, _ := e.get("GET", "/v2/test/app/manifests/v1"+ns, nil); resp.StatusCode != http.StatusOK {
				t.Fatalf("manifest: got status %d, want 200", resp.StatusCode)
			}
			asks := 1
			if tt.upstream == http.StatusTooManyRequests {
				asks = 2 // the second while holding off: the upstream is not asked
			}
			for i := range asks {
				resp, body := e.get("GET", "/v2/test/app/blobs/"+layer.String()+ns, nil)
				if resp.StatusCode != tt.status {
					t.Fatalf("ask %d: got status %d, want %d (body %q)", i, resp.StatusCode, tt.status, body)
				}
				var oe struct {
					Errors []struct{ Code, Message string }
				}
				if err := json.Unmarshal(body, &oe); err != nil || len(oe.Errors) != 1 {
					t.Fatalf("ask %d: body %q is not one OCI error", i, body)
				}
				if got := oe.Errors[0].Code; got != tt.code {
					t.Errorf("ask %d: code: got %v, want %v", i, got, tt.code)
				}
				reason := fmt.Sprintf("refused with %d", tt.upstream)
				if tt.upstream == http.StatusTooManyRequests {
					reason = "429" // from a HEAD, which has no body: the status is the reason
				}
				if i == 0 && !strings.Contains(oe.Errors[0].Message, reason) {
					t.Errorf("ask %d: message %q does not give the upstream's reason %q", i, oe.Errors[0].Message, reason)
				}
				if got := resp.Header.Get("Retry-After"); (got != "") != (tt.retryAfter != "") {
					t.Errorf("ask %d: Retry-After: got %q, want one: %v", i, got, tt.retryAfter != "")
				}
				for _, h := range []string{"Docker-Content-Digest", "Etag", "Accept-Ranges"} {
					if v := resp.Header.Get(h); v != "" {
						t.Errorf("ask %d: an error carries %s: %q", i, h, v)
					}
				}
			}
			if tt.upstream == http.StatusTooManyRequests && f.refusals.Load() != 1 {
				t.Errorf("upstream asked %d times, want once: the rest held off", f.refusals.Load())
			}
		})
	}
}

// TestFailedDownloadEndsReadersAtOnce: when one chunk of a download is
// refused for good, a client waiting on the download gets the refusal at
// once, not after the download's other chunks, stuck on a silent upstream,
// have been abandoned.
func TestFailedDownloadEndsReadersAtOnce(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 4<<20)
	d := digest.FromBytes(content)
	release := make(chan struct{})
	var silent atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rng := r.Header.Get("Range")
		switch {
		case r.Method == http.MethodHead:
			w.Header().Set("Content-Length", strconv.Itoa(len(content)))
		case strings.HasPrefix(rng, "bytes=0-"):
			<-time.After(100 * time.Millisecond) // the others are under way by then
			w.WriteHeader(http.StatusForbidden)
			io.WriteString(w, `{"errors":[{"code":"DENIED","message":"refused for the test"}]}`)
		default:
			silent.Add(1)
			var first, last int
			fmt.Sscanf(rng, "bytes=%d-%d", &first, &last)
			w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", first, last, len(content)))
			w.Header().Set("Content-Length", strconv.Itoa(last-first+1))
			w.WriteHeader(http.StatusPartialContent)
			w.(http.Flusher).Flush()
			<-release // silent until the test ends, whatever the client does
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	e := &env{t: t, dir: t.TempDir(), upstream: srv, counter: &counter{counts: map[string]int{}}}
	e.start(srv.URL)

	done := make(chan string, 1)
	go func() {
		resp, err := http.Get(e.proxy.URL + "/v2/test/app/blobs/" + d.String() + "?ns=" + upstreamName)
		if err != nil {
			done <- err.Error()
			return
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- fmt.Sprintf("%d, body read: %v", resp.StatusCode, err)
	}()
	select {
	case got := <-done:
		if want := "403, body read: <nil>"; got != want {
			t.Errorf("got %s, want %s", got, want)
		}
	case <-time.After(time.Minute): // a hang, not a measurement
		t.Fatal("the client was not answered while other chunks hung")
	}
	if silent.Load() == 0 {
		t.Error("no chunk hung: the test proved nothing")
	}
}

// sizeLiar answers HEADs of one blob with a Content-Length of its own.
type sizeLiar struct {
	next   http.Handler
	blob   string
	length int64
}

func (l *sizeLiar) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodHead || !strings.HasSuffix(r.URL.Path, "/blobs/"+l.blob) {
		l.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set("Content-Length", strconv.FormatInt(l.length, 10))
	w.WriteHeader(http.StatusOK)
}

// TestHeadOfColdBlobSaysWhatGetDelivers: a HEAD of a blob not yet stored
// answers the size the manifest declared, whatever the upstream's HEAD
// claims beyond it (a GET fetches the declared bytes), and fails, as the
// GET would, when the upstream claims fewer.
func TestHeadOfColdBlobSaysWhatGetDelivers(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		claim  func(declared int64) int64
		status int
	}{
		{"upstream claims twice the size", func(d int64) int64 { return 2 * d }, http.StatusOK},
		{"upstream claims 50 GiB", func(int64) int64 { return 50 << 30 }, http.StatusOK},
		{"upstream claims fewer bytes", func(d int64) int64 { return d / 2 }, http.StatusBadGateway},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			img := e.push("test/app", "v1", 200_000, 1)
			layer, content := layerDigest(t, img, 0)
			declared := int64(len(content))
			e.counter.next = &sizeLiar{next: e.counter.next, blob: layer.String(), length: tt.claim(declared)}
			ns := "?ns=" + upstreamName
			if resp, _ := e.get("GET", "/v2/test/app/manifests/v1"+ns, nil); resp.StatusCode != http.StatusOK {
				t.Fatalf("manifest: got status %d, want 200", resp.StatusCode)
			}
			resp, body := e.get("HEAD", "/v2/test/app/blobs/"+layer.String()+ns, nil)
			if resp.StatusCode != tt.status {
				t.Fatalf("HEAD: got %d %s, want %d", resp.StatusCode, body, tt.status)
			}
			if tt.status == http.StatusOK && resp.ContentLength != declared {
				t.Errorf("HEAD: Content-Length %d, want the declared %d", resp.ContentLength, declared)
			}
		})
	}
}

// TestClaimedSizeBeyondTheDiskIsRefused: an upstream whose HEAD claims a
// blob larger than the data dir can hold gets no byte written: the client
// gets 507 at once, with no path of the server in the message, and can go
// to its next host.
func TestClaimedSizeBeyondTheDiskIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 200_000, 1)
	layer, _ := layerDigest(t, img, 0)
	e.counter.next = &sizeLiar{next: e.counter.next, blob: layer.String(), length: 1 << 60}
	resp, body := e.get("GET", "/v2/test/app/blobs/"+layer.String()+"?ns="+upstreamName, nil)
	if resp.StatusCode != http.StatusInsufficientStorage {
		t.Fatalf("got %d %s, want 507", resp.StatusCode, body)
	}
	if strings.Contains(string(body), e.dir) {
		t.Errorf("the error tells the client the data dir's path: %s", body)
	}
	if !strings.Contains(string(body), "free") {
		t.Errorf("the error does not say why: %s", body)
	}
}
