package proxy

import (
	"net/http"
	"testing"
	"time"
)

// TestNotFoundRemembered: a tag the upstream lacks, asked for again and
// again (a pod in a crash loop), costs the upstream one lookup per TTL.
func TestNotFoundRemembered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithNotFoundTTL(time.Minute))
	path := "/v2/test/app/manifests/later?ns=" + upstreamName
	for range 20 {
		resp, body := e.get(http.MethodGet, path, nil)
		if resp.StatusCode != http.StatusNotFound {
			t.Fatalf("got %d %s, want 404", resp.StatusCode, body)
		}
	}
	if n := e.counter.count("HEAD later") + e.counter.count("GET later"); n == 0 || n > 2 {
		t.Errorf("upstream lookups of the missing tag: got %d, want 1 or 2 (a HEAD, maybe a GET)", n)
	}
}

// TestNotFoundExpires: once the TTL has passed, the upstream is asked
// again, and a tag pushed meanwhile is found.
func TestNotFoundExpires(t *testing.T) {
	t.Parallel()
	const ttl = 500 * time.Millisecond
	e := newEnv(t, WithNotFoundTTL(ttl))
	path := "/v2/test/app/manifests/later?ns=" + upstreamName
	if resp, _ := e.get(http.MethodGet, path, nil); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("got %d, want 404", resp.StatusCode)
	}
	e.push("test/app", "later", 100, 1)
	time.Sleep(ttl + 100*time.Millisecond)
	if resp, body := e.get(http.MethodGet, path, nil); resp.StatusCode != http.StatusOK {
		t.Errorf("after the TTL, a tag pushed meanwhile: got %d %s, want 200", resp.StatusCode, body)
	}
}

// TestNotFoundTTLZero: with the TTL at 0, every request asks the upstream.
func TestNotFoundTTLZero(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithNotFoundTTL(0))
	path := "/v2/test/app/manifests/nope?ns=" + upstreamName
	for range 5 {
		if resp, _ := e.get(http.MethodGet, path, nil); resp.StatusCode != http.StatusNotFound {
			t.Fatalf("got %d, want 404", resp.StatusCode)
		}
	}
	if n := e.counter.count("HEAD nope"); n != 5 {
		t.Errorf("upstream HEADs of the missing tag: got %d, want 5", n)
	}
}
