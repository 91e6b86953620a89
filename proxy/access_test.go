package proxy

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// touchCounter counts the accesses recorded in the store.
type touchCounter struct {
	*storage.Store
	mu      sync.Mutex
	touched map[digest.Digest]int
}

func (c *touchCounter) Touch(ctx context.Context, d digest.Digest) error {
	c.mu.Lock()
	c.touched[d]++
	c.mu.Unlock()
	return c.Store.Touch(ctx, d)
}

func (c *touchCounter) count(d digest.Digest) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.touched[d]
}

// Serving a stored blob many times records its access in the store once,
// in the background, not once per request.
func TestBlobAccessRecordedOncePerFlush(t *testing.T) {
	t.Parallel()
	st, err := storage.Open(t.Context(), t.TempDir(), storage.WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	content := randomBytes(t, 1000)
	d := digest.FromBytes(content)
	if err := st.PutBlob(t.Context(), d, content); err != nil {
		t.Fatal(err)
	}
	if err := st.AddMembers(t.Context(), upstreamName, "app", d); err != nil {
		t.Fatal(err)
	}
	store := &touchCounter{Store: st, touched: map[digest.Digest]int{}}
	// The upstream is never asked: the blob is stored.
	up, err := upstream.New(upstreamName, []string{"http://127.0.0.1:1"}, upstream.WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(WithStore(store), WithUpstream(up), WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	defer hs.Close()

	url := hs.URL + "/v2/app/blobs/" + d.String() + "?ns=" + upstreamName
	for range 20 {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || string(body) != string(content) {
			t.Fatalf("GET: got %d, %d bytes, err %v, want 200 and the blob", resp.StatusCode, len(body), err)
		}
	}
	if got := store.count(d); got != 0 {
		t.Errorf("Touch calls while serving: got %d, want 0", got)
	}
	srv.flushAccesses()
	if got := store.count(d); got != 1 {
		t.Errorf("Touch calls after a flush: got %d, want 1", got)
	}
	srv.flushAccesses() // nothing served since
	if got := store.count(d); got != 1 {
		t.Errorf("Touch calls after a flush with nothing served: got %d, want 1", got)
	}
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	hs.Close()
	srv.Close() // records what is left
	if got := store.count(d); got != 2 {
		t.Errorf("Touch calls after Close: got %d, want 2", got)
	}
}
