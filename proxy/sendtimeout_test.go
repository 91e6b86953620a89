package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"
)

// TestStalledClientIsDropped: a client that stops reading a large stored
// blob is dropped once it has taken nothing for the send timeout, whether
// net/http or the blob loop serves its connection; with the timeout off it
// may resume whenever it likes.
func TestStalledClientIsDropped(t *testing.T) {
	t.Parallel()
	// More than the socket buffers of both ends hold, so that the sender
	// waits on the client.
	content := randomBytes(t, 48<<20)
	for _, tt := range []struct {
		name    string
		loop    bool
		timeout time.Duration
		dropped bool
	}{
		// Two seconds: reading 48 MiB to cache it, under the race detector
		// on a busy machine, has taken a 1 MiB piece longer than 300 ms,
		// and the first GET on the loop's connection, read into a growing
		// buffer, once paused for more than a second.
		{"net/http", false, 2 * time.Second, true},
		{"blob loop", true, 2 * time.Second, true},
		{"no timeout", true, 0, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b, srv := newBlobServer(t, content)
			e := &env{t: t, dir: t.TempDir(), upstream: srv, counter: &counter{counts: map[string]int{}}}
			e.start(srv.URL, WithSendTimeout(tt.timeout))
			p := "/v2/test/app/blobs/" + b.digest.String() + "?ns=" + upstreamName
			cacheBlob(t, e.proxy.URL+p, content)
			cc := dialProxy(t, e.proxy)
			if tt.loop {
				cc.send(request("GET", p))
				resp, err := http.ReadResponse(cc.br, &http.Request{Method: "GET"})
				if err != nil {
					t.Fatal(err)
				}
				n, err := io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if err != nil || resp.StatusCode != http.StatusOK || n != int64(len(content)) {
					t.Fatalf("first GET: %s, %d bytes, err %v", resp.Status, n, err)
				}
				waitOnLoop(t, e.proxy, 1)
			}
			cc.send(request("GET", p))
			resp, err := http.ReadResponse(cc.br, &http.Request{Method: "GET"})
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if _, err := io.ReadFull(resp.Body, make([]byte, 1)); err != nil {
				t.Fatal(err)
			}
			time.Sleep(6 * time.Second) // stalled: three times the timeout
			n, err := io.Copy(io.Discard, resp.Body)
			if dropped := err != nil || n+1 < int64(len(content)); dropped != tt.dropped {
				t.Errorf("after the stall: read %d more bytes of %d, err %v: dropped %v, want %v",
					n, len(content)-1, err, dropped, tt.dropped)
			}
		})
	}
}

// cacheBlob GETs url once so that the proxy stores content. The reader
// reads into a buffer sized up front: io.ReadAll's growing buffer, under the
// race detector on a busy two-core machine, has paused past the two-second
// send timeout and had the response cut. A cut response still leaves the
// download running to its commit, so one more GET, served from disk, ends
// the wait for it.
func cacheBlob(t *testing.T, url string, content []byte) {
	t.Helper()
	buf := make([]byte, len(content))
	var last error
	for attempt := 0; attempt < 3; attempt++ {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		n, err := io.ReadFull(resp.Body, buf)
		resp.Body.Close()
		switch {
		case resp.StatusCode != http.StatusOK:
			t.Fatalf("caching the blob: %s", resp.Status)
		case err == nil && bytes.Equal(buf, content):
			return
		case err == nil:
			t.Fatalf("caching the blob: %d bytes that differ from the blob's", n)
		}
		last = fmt.Errorf("%d of %d bytes: %w", n, len(content), err)
		t.Logf("caching the blob, attempt %d: %v", attempt+1, last)
	}
	t.Fatalf("caching the blob: %v", last)
}
