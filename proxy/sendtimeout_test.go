package proxy

import (
	"bytes"
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
			if resp, body := e.get(http.MethodGet, p, nil); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
				t.Fatalf("caching the blob: %s, %d bytes", resp.Status, len(body))
			}
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
