package proxy

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// TestDamagedBlobIsFetchedAgain: a stored layer cut short on disk, or
// grown, is not served again, whether its connection is served by net/http
// or by the blob loop: the next GET fetches it anew and serves the right
// bytes, and a HEAD tells the right size.
func TestDamagedBlobIsFetchedAgain(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"truncated", "grown"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			img := e.push("test/app", "v1", 300_000, 1)
			layer, content := layerDigest(t, img, 0)
			path := "/v2/test/app/blobs/" + layer.String() + "?ns=" + upstreamName
			for i := range 2 { // the second on a connection the blob loop serves
				if resp, body := e.get("GET", path, nil); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
					t.Fatalf("GET %d: got %d and %d bytes, want 200 and the layer", i, resp.StatusCode, len(body))
				}
			}
			file := filepath.Join(e.dir, "blobs", "sha256", layer.Encoded()[:2], layer.Encoded())
			b, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			if how == "truncated" {
				b = b[:100]
			} else {
				b = append(b, 0)
			}
			if err := os.WriteFile(file, b, 0o644); err != nil {
				t.Fatal(err)
			}
			before := e.counter.count("GET " + layer.String())
			if resp, _ := e.get("HEAD", path, nil); resp.StatusCode != http.StatusOK || resp.ContentLength != int64(len(content)) {
				t.Errorf("HEAD: got %d, Content-Length %d; want 200, %d", resp.StatusCode, resp.ContentLength, len(content))
			}
			resp, body := e.get("GET", path, nil)
			if resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) || digest.FromBytes(body) != layer {
				t.Fatalf("GET after the damage: got %d and %d bytes, want 200 and the layer's %d", resp.StatusCode, len(body), len(content))
			}
			if got := e.counter.count("GET " + layer.String()); got <= before {
				t.Errorf("upstream GETs of the layer: %d before the damage, %d after: want it fetched again", before, got)
			}
			if resp, body := e.get("GET", path, nil); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
				t.Errorf("GET from the fresh copy: got %d and %d bytes", resp.StatusCode, len(body))
			}
		})
	}
}

// TestJoinCommittedDownloadOfQuarantinedBlob: a download stays in the table
// for a moment after its commit, writing its records. A GET that finds the
// blob damaged meanwhile (quarantined, so not in the store) does not join
// that download, whose file is gone, but waits for it to leave and fetches
// the blob anew.
func TestJoinCommittedDownloadOfQuarantinedBlob(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 300_000, 1)
	layer, content := layerDigest(t, img, 0)
	path := "/v2/test/app/blobs/" + layer.String() + "?ns=" + upstreamName
	if resp, body := e.get("GET", path, nil); resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
		t.Fatalf("first GET: got %d and %d bytes, want 200 and the layer", resp.StatusCode, len(body))
	}
	for i := 0; e.srv.downloads.running() > 0; i++ {
		if i == 500 {
			t.Fatal("the first download never left the table")
		}
		time.Sleep(10 * time.Millisecond)
	}

	// A committed download still in the table, as one is while it writes
	// its records.
	ctx := context.Background()
	p, err := e.store.NewPartial(ctx, layer, int64(len(content)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.WriteAt(content, 0); err != nil {
		t.Fatal(err)
	}
	if err := p.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	dl := &download{upstream: upstreamName, repo: "test/app", ready: make(chan struct{}), finished: make(chan struct{}), partial: p}
	close(dl.ready)
	e.srv.downloads.mu.Lock()
	e.srv.downloads.m[layer] = dl
	e.srv.downloads.mu.Unlock()
	left := make(chan struct{})
	go func() {
		defer close(left)
		time.Sleep(100 * time.Millisecond)
		e.srv.downloads.remove(layer, dl)
	}()
	defer func() { <-left }()

	// Damaged: the GET's own look-up quarantines it.
	file := filepath.Join(e.dir, "blobs", "sha256", layer.Encoded()[:2], layer.Encoded())
	if err := os.Truncate(file, 100); err != nil {
		t.Fatal(err)
	}
	before := e.counter.count("GET " + layer.String())
	resp, body := e.get("GET", path, nil)
	if resp.StatusCode != http.StatusOK || !bytes.Equal(body, content) {
		t.Fatalf("GET after the damage: got %d and %d bytes (%.200s), want 200 and the layer's %d", resp.StatusCode, len(body), body, len(content))
	}
	if got := e.counter.count("GET " + layer.String()); got <= before {
		t.Errorf("upstream GETs of the layer: %d before the damage, %d after: want it fetched again", before, got)
	}
}
