package proxy

import (
	"bytes"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/pullproxy/pullproxy/upstream"
)

func TestParseClientList(t *testing.T) {
	t.Parallel()
	got, err := ParseClientList([]string{"10.0.0.0/8", " 192.0.2.7 ", "fd00::/8", "10.1.2.3/8", "::ffff:192.0.2.8"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.0/8", "192.0.2.7/32", "fd00::/8", "10.0.0.0/8", "192.0.2.8/32"}
	for i, p := range got {
		if p.String() != want[i] {
			t.Errorf("entry %d: got %s, want %s", i, p, want[i])
		}
	}
	for _, bad := range []string{"10.0.0.0/33", "example.com", "", "10.0.0.1-10.0.0.9"} {
		if _, err := ParseClientList([]string{bad}); err == nil {
			t.Errorf("%q: got no error", bad)
		}
	}
	l := clientList(got)
	for remote, ok := range map[string]bool{"10.9.8.7:5000": true, "192.0.2.7:1": true, "192.0.2.8:1": true, "[::ffff:10.1.1.1]:80": true,
		"[fd12::1]:443": true, "127.0.0.1:5000": false, "[::1]:5000": false, "garbage": false} {
		if l.allows(remote) != ok {
			t.Errorf("allows(%s): got %v, want %v", remote, !ok, ok)
		}
	}
}

// TestAllowedClients: a client outside the listener's networks is refused
// with 403 before its request is read; one outside an upstream's is
// refused that upstream's content, whether net/http or the blob loop
// serves its connection, and gets the rest.
func TestAllowedClients(t *testing.T) {
	t.Parallel()
	elsewhere := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	t.Run("listener", func(t *testing.T) {
		t.Parallel()
		for _, tt := range []struct {
			networks []netip.Prefix
			status   int
		}{
			{elsewhere, http.StatusForbidden},
			{[]netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, http.StatusOK},
		} {
			e := newEnv(t, WithAllowedClients(tt.networks))
			cc := dialProxy(t, e.proxy)
			cc.send(request("GET", "/v2/"))
			if resp, body := cc.response("GET"); resp.StatusCode != tt.status {
				t.Errorf("networks %v: got %d %s, want %d", tt.networks, resp.StatusCode, body, tt.status)
			}
		}
	})
	t.Run("upstream", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		other, err := upstream.New("other.test", []string{e.upstream.URL}, upstream.WithLogger(testLog(t)))
		if err != nil {
			t.Fatal(err)
		}
		e.stop()
		e.start(e.upstream.URL, WithUpstream(other), WithUpstreamAllowedClients("other.test", elsewhere))
		img := e.push("test/app", "v1", 100<<10, 1)
		d, content := layerDigest(t, img, 0)
		allowed := "/v2/test/app/blobs/" + d.String() + "?ns=" + upstreamName
		denied := "/v2/test/app/blobs/" + d.String() + "?ns=other.test"

		cc := dialProxy(t, e.proxy)
		for range 2 { // fetched, then sent stored: the loop serves the rest
			cc.send(request("GET", allowed))
			if resp, body := cc.response("GET"); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
				t.Fatalf("allowed upstream: %s, %d bytes", resp.Status, len(body))
			}
		}
		waitOnLoop(t, e.proxy, 1)
		cc.send(request("GET", denied))
		if resp, body := cc.response("GET"); resp.StatusCode != http.StatusForbidden || !strings.Contains(string(body), "DENIED") {
			t.Errorf("denied upstream, on the loop's connection: got %d %s, want 403 DENIED", resp.StatusCode, body)
		}
		if resp, body := e.get("GET", denied, nil); resp.StatusCode != http.StatusForbidden {
			t.Errorf("denied upstream, net/http: got %d %s, want 403", resp.StatusCode, body)
		}
		if _, err := New(WithStore(e.store), WithUpstreamAllowedClients("nope.test", elsewhere)); err == nil {
			t.Error("allowed clients for an unconfigured upstream: got no error")
		}
	})
}
