package proxy

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"
	"time"
)

// waitOpen waits until the server counts n open client connections.
func waitOpen(t *testing.T, s *Server, n int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for s.clientConns.open.Load() != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d client connections open, want %d", s.clientConns.open.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestClientConnectionsBounded: past max_client_connections a connection
// gets a 503 with Retry-After, which containerd takes to try another host;
// a connection closed frees its place, whether net/http or the blob loop
// served it.
func TestClientConnectionsBounded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithMaxClientConnections(2))
	img := e.push("test/app", "v1", 100<<10, 1)
	d, content := layerDigest(t, img, 0)
	p := "/v2/test/app/blobs/" + d.String() + "?ns=" + upstreamName
	get := func(cc *clientConn, path string) (*http.Response, []byte) {
		cc.send(request("GET", path))
		return cc.response("GET")
	}

	loop := dialProxy(t, e.proxy) // a blob fetched, then sent stored: the loop serves the rest
	for range 2 {
		if resp, body := get(loop, p); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
			t.Fatalf("blob: %s, %d bytes", resp.Status, len(body))
		}
	}
	waitOnLoop(t, e.proxy, 1)
	plain := dialProxy(t, e.proxy) // net/http's, idle between requests
	if resp, _ := get(plain, "/v2/"); resp.StatusCode != http.StatusOK {
		t.Fatalf("ping: %s", resp.Status)
	}
	waitOpen(t, e.srv, 2)

	refused := dialProxy(t, e.proxy)
	resp, body := get(refused, p)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Errorf("past the bound: got %s, Retry-After %q; want 503 with Retry-After", resp.Status, resp.Header.Get("Retry-After"))
	}
	var oe struct {
		Errors []struct{ Code, Message string }
	}
	if err := json.Unmarshal(body, &oe); err != nil || len(oe.Errors) != 1 || oe.Errors[0].Code != "TOOMANYREQUESTS" {
		t.Errorf("past the bound: body %q, want one TOOMANYREQUESTS error", body)
	}
	waitOpen(t, e.srv, 2)

	for _, cc := range []*clientConn{loop, plain} {
		cc.c.Close()
		waitOpen(t, e.srv, 1)
		next := dialProxy(t, e.proxy)
		if resp, body := get(next, p); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
			t.Fatalf("after a connection closed: %s, %d bytes; want the blob", resp.Status, len(body))
		}
	}
	if got := e.srv.clientConns.refused.Load(); got != 1 {
		t.Errorf("refused: got %d, want 1", got)
	}
}
