package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// clientConn is one kept-alive client connection, driven by hand.
type clientConn struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

func dialProxy(t *testing.T, p *liveProxy) *clientConn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(30 * time.Second))
	return &clientConn{t: t, c: c, br: bufio.NewReader(c)}
}

// send writes raw requests.
func (cc *clientConn) send(reqs ...string) {
	cc.t.Helper()
	if _, err := io.WriteString(cc.c, strings.Join(reqs, "")); err != nil {
		cc.t.Fatal(err)
	}
}

// response reads the next response, body included.
func (cc *clientConn) response(method string) (*http.Response, []byte) {
	cc.t.Helper()
	resp, err := http.ReadResponse(cc.br, &http.Request{Method: method})
	if err != nil {
		cc.t.Fatalf("reading a response: %v", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		cc.t.Fatalf("reading a body: %v", err)
	}
	return resp, body
}

// closed reports whether the server closed the connection.
func (cc *clientConn) closed() bool {
	_, err := cc.br.ReadByte()
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || isReset(err)
}

func isReset(err error) bool { return err != nil && strings.Contains(err.Error(), "reset") }

func request(method, path string, headers ...string) string {
	return method + " " + path + " HTTP/1.1\r\nHost: mirror.test\r\nUser-Agent: containerd/1.7\r\n" +
		strings.Join(headers, "") + "\r\n"
}

// waitOnLoop waits until the blob loop serves n connections: a connection
// is taken over once its response is sent, so after its client has it.
func waitOnLoop(t *testing.T, p *liveProxy, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for onLoop(p) != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections on the blob loop, want %d", onLoop(p), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// onLoop is how many connections the blob loop serves.
func onLoop(p *liveProxy) int {
	f := p.srv.fast.Load()
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.conns)
}

// cachedLayer pushes an image, has the proxy fetch its first layer, and
// returns the layer's path and content.
func cachedLayer(t *testing.T, e *env, size int64) (string, []byte) {
	t.Helper()
	img := e.push("test/app", "v1", size, 1)
	d, content := layerDigest(t, img, 0)
	p := "/v2/test/app/blobs/" + d.String() + "?ns=" + upstreamName
	if resp, body := e.get(http.MethodGet, p, nil); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
		t.Fatalf("caching the layer: %s, %d bytes", resp.Status, len(body))
	}
	waitCommitted(t, e, d)
	return p, content
}

// waitCommitted waits for the download of d, if one is in the table, to
// leave it: its clients have every byte once the digest matched, a moment
// before the blob is in the store.
func waitCommitted(t *testing.T, e *env, d digest.Digest) {
	t.Helper()
	e.srv.downloads.mu.Lock()
	dl := e.srv.downloads.m[d]
	e.srv.downloads.mu.Unlock()
	if dl == nil {
		return
	}
	select {
	case <-dl.finished:
	case <-time.After(30 * time.Second):
		t.Fatalf("the download of %s never left the table", d)
	}
}

// cachedBlob starts a proxy in front of an upstream serving one blob of
// size random bytes, has it fetch the blob, and returns its path and content.
// Quicker than cachedLayer for large blobs.
func cachedBlob(t *testing.T, size int) (*env, string, []byte) {
	t.Helper()
	content := randomBytes(t, size)
	b, srv := newBlobServer(t, content)
	e := blobEnv(t, b, srv)
	p := "/v2/test/app/blobs/" + b.digest.String() + "?ns=" + upstreamName
	if resp, body := e.get(http.MethodGet, p, nil); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
		t.Fatalf("caching the blob: %s, %d bytes", resp.Status, len(body))
	}
	waitCommitted(t, e, b.digest)
	return e, p, content
}

func TestBlobLoopAnswersAsNetHTTP(t *testing.T) {
	e := newEnv(t)
	p, content := cachedLayer(t, e, 100<<10)
	cc := dialProxy(t, e.proxy)

	cc.send(request("GET", p))
	first, body := cc.response("GET")
	if first.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
		t.Fatalf("first GET: %s, %d bytes", first.Status, len(body))
	}
	waitOnLoop(t, e.proxy, 1)
	for _, method := range []string{"GET", "HEAD", "GET"} {
		cc.send(request(method, p))
		resp, body := cc.response(method)
		want := content
		if method == "HEAD" {
			want = nil
		}
		if resp.StatusCode != http.StatusOK || !bytes.Equal(body, want) {
			t.Fatalf("%s on the loop: %s, %d bytes", method, resp.Status, len(body))
		}
		if resp.Close {
			t.Fatalf("%s on the loop closes the connection", method)
		}
		first.Header.Del("Date")
		if date, err := http.ParseTime(resp.Header.Get("Date")); err != nil || time.Since(date) > time.Minute {
			t.Errorf("%s on the loop: Date %q", method, resp.Header.Get("Date"))
		}
		resp.Header.Del("Date")
		if !equalHeaders(resp.Header, first.Header) {
			t.Errorf("%s on the loop answers\n%v\nnet/http answered\n%v", method, resp.Header, first.Header)
		}
		if resp.ContentLength != int64(len(content)) {
			t.Errorf("%s on the loop: Content-Length %d, want %d", method, resp.ContentLength, len(content))
		}
	}
	if n := onLoop(e.proxy); n != 1 {
		t.Fatalf("%d connections on the blob loop, want 1", n)
	}
	// Counted as net/http's requests are: the first GET, caching the layer,
	// is a download. A request is counted once its answer is sent: the
	// client may read it a moment before.
	for deadline := time.Now().Add(5 * time.Second); (testutil.ToFloat64(e.srv.metrics.request(kindBlob, "GET", 200)) < 4 ||
		testutil.ToFloat64(e.srv.metrics.served["cache"]) < float64(3*len(content))) && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if got := testutil.ToFloat64(e.srv.metrics.request(kindBlob, "GET", 200)); got != 4 {
		t.Errorf("%v blob GETs counted, want 4", got)
	}
	if got := testutil.ToFloat64(e.srv.metrics.request(kindBlob, "HEAD", 200)); got != 1 {
		t.Errorf("%v blob HEADs counted, want 1", got)
	}
	if got, want := testutil.ToFloat64(e.srv.metrics.served["cache"]), float64(3*len(content)); got != want {
		t.Errorf("%v bytes served from the cache counted, want %v", got, want)
	}
}

// TestLargeBlobFirstOnAConnection: a stored blob of loopSendMin or more,
// the first request on its connection, is sent as the loop sends it, with
// net/http's header, counted as net/http counts it; the connection then
// goes on to the loop, and answers as before.
func TestLargeBlobFirstOnAConnection(t *testing.T) {
	e, p, content := cachedBlob(t, loopSendMin+300<<10)
	head, _ := e.get(http.MethodHead, p, nil) // its connection goes on to the loop
	waitOnLoop(t, e.proxy, 1)
	cc := dialProxy(t, e.proxy)
	for i := range 2 {
		cc.send(request("GET", p))
		resp, body := cc.response("GET")
		if resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) || resp.Close {
			t.Fatalf("GET %d: %s, %d bytes, closes: %v", i, resp.Status, len(body), resp.Close)
		}
		for _, h := range []http.Header{resp.Header, head.Header} {
			h.Del("Date")
		}
		if !equalHeaders(resp.Header, head.Header) {
			t.Errorf("GET %d answers\n%v\nHEAD answered\n%v", i, resp.Header, head.Header)
		}
		waitOnLoop(t, e.proxy, 2)
	}
	want := float64(3 * len(content)) // with the GET that cached it
	for deadline := time.Now().Add(5 * time.Second); testutil.ToFloat64(e.srv.metrics.served["cache"]) < want-float64(len(content)) && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	got := testutil.ToFloat64(e.srv.metrics.served["cache"]) + testutil.ToFloat64(e.srv.metrics.served["download"])
	if got != want {
		t.Errorf("%v bytes served counted, want %v", got, want)
	}
}

func equalHeaders(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if strings.Join(v, ",") != strings.Join(b[k], ",") {
			return false
		}
	}
	return true
}

// TestBlobLoopHandsBackWhatItDoesNotServe drives one connection through
// requests the loop answers and requests it hands back to net/http, one at
// a time and pipelined.
func TestBlobLoopHandsBackWhatItDoesNotServe(t *testing.T) {
	e := newEnv(t)
	img := e.push("test/app", "v1", 64<<10, 2)
	d0, layer0 := layerDigest(t, img, 0)
	d1, layer1 := layerDigest(t, img, 1)
	blob0 := "/v2/test/app/blobs/" + d0.String() + "?ns=" + upstreamName
	blob1 := "/v2/test/app/blobs/" + d1.String() + "?ns=" + upstreamName
	if resp, _ := e.get("GET", blob0, nil); resp.StatusCode != http.StatusOK {
		t.Fatal(resp.Status)
	}
	manifest := "/v2/test/app/manifests/v1?ns=" + upstreamName

	cc := dialProxy(t, e.proxy)
	steps := []struct {
		name, req, method string
		status            int
		body              []byte // nil: not checked
		loop              int    // connections on the loop after it
	}{
		{"stored blob, through net/http", request("GET", blob0), "GET", 200, layer0, 1},
		{"stored blob, on the loop", request("GET", blob0), "GET", 200, layer0, 1},
		{"manifest, handed back", request("GET", manifest, "Accept: application/vnd.oci.image.manifest.v1+json\r\n"), "GET", 200, nil, 0},
		{"stored blob, taken over again", request("GET", blob0), "GET", 200, layer0, 1},
		{"range, handed back", request("GET", blob0, "Range: bytes=10-19\r\n"), "GET", 206, layer0[10:20], 0},
		{"stored blob", request("GET", blob0), "GET", 200, layer0, 1},
		{"ping, handed back", request("GET", "/v2/"), "GET", 200, []byte("{}"), 0},
		{"stored blob", request("GET", blob0), "GET", 200, layer0, 1},
		{"blob not stored: fetched by net/http", request("GET", blob1), "GET", 200, layer1, 0},
		{"conditional, handed back", request("GET", blob0, "If-None-Match: \""+d0.String()+"\"\r\n"), "GET", 304, []byte{}, 0},
		{"stored blob", request("GET", blob0), "GET", 200, layer0, 1},
		{"POST, handed back", request("POST", blob0, "Content-Length: 3\r\n") + "abc", "POST", 405, nil, 0},
		{"stored blob after a body", request("GET", blob0), "GET", 200, layer0, 1},
		{"unknown upstream, handed back", request("GET", strings.Replace(blob0, upstreamName, "elsewhere.test", 1)), "GET", 404, nil, 0},
	}
	for _, s := range steps {
		cc.send(s.req)
		resp, body := cc.response(s.method)
		if resp.StatusCode != s.status || (s.body != nil && !bytes.Equal(body, s.body)) {
			t.Fatalf("%s: %s, %d bytes", s.name, resp.Status, len(body))
		}
		t.Log(s.name)
		waitOnLoop(t, e.proxy, s.loop)
	}

	// Pipelined, starting on the loop: the loop answers, hands back
	// mid-stream, net/http takes the rest (and the loop takes over again).
	cc.send(request("GET", blob0))
	cc.response("GET")
	cc.send(request("GET", blob0), request("HEAD", blob1),
		request("GET", manifest, "Accept: application/vnd.oci.image.manifest.v1+json\r\n"),
		request("GET", blob1), request("GET", blob0, "Range: bytes=0-0\r\n"), request("GET", blob0))
	for i, want := range []struct {
		method string
		status int
		body   []byte
	}{{"GET", 200, layer0}, {"HEAD", 200, []byte{}}, {"GET", 200, nil}, {"GET", 200, layer1}, {"GET", 206, layer0[:1]}, {"GET", 200, layer0}} {
		resp, body := cc.response(want.method)
		if resp.StatusCode != want.status || (want.body != nil && !bytes.Equal(body, want.body)) {
			t.Fatalf("pipelined response %d: %s, %d bytes", i, resp.Status, len(body))
		}
	}

	// A client that asks to close gets its answer, then the close.
	cc.send(request("GET", blob0, "Connection: close\r\n"))
	if resp, body := cc.response("GET"); resp.StatusCode != 200 || !bytes.Equal(body, layer0) || !resp.Close {
		t.Fatalf("GET with Connection: close: %s, %d bytes, close %v", resp.Status, len(body), resp.Close)
	}
	if !cc.closed() {
		t.Fatal("connection still open after Connection: close")
	}
}

func TestBlobLoopTimesOutAsNetHTTP(t *testing.T) {
	e := newEnv(t)
	p, _ := cachedLayer(t, e, 10<<10)
	// A second server on the same store, with short timeouts.
	srv, err := New(WithStore(e.store), WithUpstream(e.srv.upstreams[upstreamName]), WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lp := &liveProxy{URL: "http://" + ln.Addr().String(), t: t, srv: srv, done: make(chan error, 1),
		hs: &http.Server{ReadHeaderTimeout: 100 * time.Millisecond, IdleTimeout: 300 * time.Millisecond}}
	go func() { lp.done <- srv.Serve(ln, lp.hs) }()
	defer lp.Close()

	for _, tt := range []struct {
		name string
		then string // sent once on the loop
	}{
		{"idle", ""},
		{"head never ended", "GET /v2/test/app/blobs/sha256:"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cc := dialProxy(t, lp)
			for range 2 {
				cc.send(request("GET", p))
				if resp, _ := cc.response("GET"); resp.StatusCode != 200 {
					t.Fatal(resp.Status)
				}
			}
			waitOnLoop(t, lp, 1)
			cc.send(tt.then)
			if !cc.closed() { // bounded by the connection's 30 s deadline
				t.Fatal("connection not closed")
			}
		})
	}
}

// TestBlobLoopShutdown: an idle connection on the loop is closed at once; a
// busy one gets its whole response first, and Shutdown waits for it.
func TestBlobLoopShutdown(t *testing.T) {
	e, p, content := cachedBlob(t, 16<<20)
	idle, busy := dialProxy(t, e.proxy), dialProxy(t, e.proxy)
	for _, cc := range []*clientConn{idle, busy} {
		cc.send(request("HEAD", p))
		cc.response("HEAD")
		cc.send(request("HEAD", p))
		cc.response("HEAD")
	}
	waitOnLoop(t, e.proxy, 2)
	busy.send(request("GET", p))
	resp, err := http.ReadResponse(busy.br, &http.Request{Method: "GET"})
	if err != nil {
		t.Fatal(err)
	}
	// Once the response has started, the loop is busy with it until it ends.
	for onLoopBusy(e.proxy) == 0 {
		time.Sleep(time.Millisecond)
	}

	stopped := make(chan struct{})
	go func() {
		e.proxy.Close()
		close(stopped)
	}()
	if !idle.closed() {
		t.Error("idle connection on the loop not closed at shutdown")
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil || !bytes.Equal(body, content) {
		t.Fatalf("busy connection's response: %d bytes of %d, %v", len(body), len(content), err)
	}
	<-stopped
	if !busy.closed() {
		t.Error("busy connection not closed after its response")
	}
	e.proxy = nil // closed
	e.store.Close()
}

func onLoopBusy(p *liveProxy) int {
	f := p.srv.fast.Load()
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, busy := range f.conns {
		if busy {
			n++
		}
	}
	return n
}

// A client that goes away mid-response leaves nothing behind.
func TestBlobLoopClientGoesAway(t *testing.T) {
	e, p, _ := cachedBlob(t, 16<<20)
	cc := dialProxy(t, e.proxy)
	cc.send(request("HEAD", p))
	cc.response("HEAD")
	cc.send(request("GET", p))
	if _, err := http.ReadResponse(cc.br, &http.Request{Method: "GET"}); err != nil {
		t.Fatal(err)
	}
	cc.c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for onLoop(e.proxy) != 0 {
		if ctx.Err() != nil {
			t.Fatal("the loop still holds a connection its client closed")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSendBlob sends a header and a file whole, from the page cache or not
// (on Linux, sendfile from cached pages is made another way), and stops
// with an error at the end of a file shorter than the size it was said to
// have (a damaged store).
func TestSendBlob(t *testing.T) {
	content := randomBytes(t, 10<<20+123) // more than one residency window, not in whole pages
	name := t.TempDir() + "/blob"
	if err := os.WriteFile(name, content, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name  string
		size  int64
		evict bool // drop the file from the page cache first
		want  error
	}{
		{"whole", int64(len(content)), false, nil},
		{"whole, not in the page cache", int64(len(content)), true, nil},
		{"shorter than said", int64(len(content)) + 10, false, io.ErrUnexpectedEOF},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.evict {
				evictFromPageCache(t, name)
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			received := make(chan []byte)
			go func() {
				c, err := ln.Accept()
				if err != nil {
					close(received)
					return
				}
				defer c.Close()
				b, _ := io.ReadAll(c)
				received <- b
			}()
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			tc := c.(*net.TCPConn)
			raw, err := tc.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			fd, err := syscall.Open(name, syscall.O_RDONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer syscall.Close(fd)
			hdr := []byte("HTTP/1.1 200 OK\r\n\r\n")
			n, err := sendBlob(tc, raw, hdr, fd, tt.size, 0, time.Time{})
			c.Close()
			if n != int64(len(content)) || !errors.Is(err, tt.want) {
				t.Errorf("sent %d bytes, %v; want %d, %v", n, err, len(content), tt.want)
			}
			if got := <-received; !bytes.Equal(got, append(hdr, content...)) {
				t.Errorf("received %d bytes, not the header and the file's %d", len(got), len(hdr)+len(content))
			}
		})
	}
}

// TestBlobLoopTurnedOff: with WithBlobLoop(false), net/http answers every
// request, on a connection it keeps.
func TestBlobLoopTurnedOff(t *testing.T) {
	e := newEnv(t, WithBlobLoop(false))
	p, content := cachedLayer(t, e, 10<<10)
	cc := dialProxy(t, e.proxy)
	for range 3 {
		cc.send(request("GET", p))
		if resp, body := cc.response("GET"); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
			t.Fatalf("GET: %s, %d bytes", resp.Status, len(body))
		}
	}
	if e.srv.fast.Load() != nil {
		t.Fatal("the blob loop runs though turned off")
	}
}
