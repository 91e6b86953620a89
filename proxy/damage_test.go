package proxy

import (
	"bytes"
	"net/http"
	"os"
	"path/filepath"
	"testing"

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
