package proxy

import (
	"bytes"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/pullproxy/pullproxy/internal/registrytest"
	"github.com/pullproxy/pullproxy/upstream"
)

// TestRepositoryScoping: content stored through one repository is served
// under another only when the upstream holds it there too; under a
// repository that does not hold it, or another upstream's name, it is
// refused as unknown, though stored. What the upstream confirmed is
// remembered, across restarts: it is served with the upstream down.
func TestRepositoryScoping(t *testing.T) {
	t.Parallel()
	// A second upstream, holding nothing.
	emptyReg := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(emptyReg.Close)
	other, err := upstream.New("other.test", []string{emptyReg.URL}, upstream.WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	// distribution's registry: it keeps blobs per repository, as
	// registries with access control do (go-containerregistry's in-memory
	// one serves any blob under any name).
	reg, err := registrytest.NewHandler(t.Context(), t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	e := newEnvRegistry(t, reg, WithUpstream(other))
	img := e.push("test/app", "v1", 2000, 1)
	e.write("test/copy", "v1", img) // the same content in a second repository
	layer, content := layerDigest(t, img, 0)
	manifest, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	ns := "?ns=" + upstreamName
	// Pulled through test/app: its manifest and layer are stored.
	for _, p := range []string{"/v2/test/app/manifests/v1", "/v2/test/app/blobs/" + layer.String()} {
		if resp, _ := e.get(http.MethodGet, p+ns, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d", p, resp.StatusCode)
		}
	}

	tests := []struct {
		name, method, path string
		status             int
		code               string
	}{
		{"layer under a repository without it", "GET", "/v2/test/no-such-repo/blobs/" + layer.String() + ns, 404, "BLOB_UNKNOWN"},
		{"HEAD of it", "HEAD", "/v2/test/no-such-repo/blobs/" + layer.String() + ns, 404, ""},
		{"manifest under a repository without it", "GET", "/v2/test/no-such-repo/manifests/" + manifest.String() + ns, 404, "MANIFEST_UNKNOWN"},
		{"layer under another upstream", "GET", "/v2/test/app/blobs/" + layer.String() + "?ns=other.test", 404, "BLOB_UNKNOWN"},
		{"manifest under another upstream", "GET", "/v2/test/app/manifests/" + manifest.String() + "?ns=other.test", 404, "MANIFEST_UNKNOWN"},
		{"layer in a second repository holding it", "GET", "/v2/test/copy/blobs/" + layer.String() + ns, 200, ""},
		{"manifest in a second repository holding it", "GET", "/v2/test/copy/manifests/" + manifest.String() + ns, 200, ""},
		{"layer in its own repository", "GET", "/v2/test/app/blobs/" + layer.String() + ns, 200, ""},
	}
	for _, tc := range tests {
		// Twice: the second on a kept-alive connection, which the blob
		// loop serves.
		for i := range 2 {
			resp, body := e.get(tc.method, tc.path, nil)
			if resp.StatusCode != tc.status || !strings.Contains(string(body), tc.code) {
				t.Errorf("%s (%d): got %d %.100q, want %d %s", tc.name, i, resp.StatusCode, body, tc.status, tc.code)
			}
			if tc.status != 200 && bytes.Contains(body, content) {
				t.Errorf("%s: the refusal carries the layer", tc.name)
			}
		}
	}
	// Confirmed once, remembered: no HEAD the next time.
	heads := e.counter.count("HEAD " + layer.String())
	e.get("GET", "/v2/test/copy/blobs/"+layer.String()+ns, nil)
	if got := e.counter.count("HEAD " + layer.String()); got != heads {
		t.Errorf("upstream HEADs of the layer: %d, then %d: the confirmation was not remembered", heads, got)
	}

	// Upstream down, after a restart: what is known is served, what is not
	// is not.
	e.counter.down.Store(true)
	e.stop()
	e.start(e.upstream.URL, WithUpstream(other))
	for _, repo := range []string{"test/app", "test/copy"} {
		if resp, body := e.get("GET", "/v2/"+repo+"/blobs/"+layer.String()+ns, nil); resp.StatusCode != 200 || !bytes.Equal(body, content) {
			t.Errorf("%s with the upstream down: got %d, want 200 and the layer", repo, resp.StatusCode)
		}
	}
	if resp, body := e.get("GET", "/v2/test/unknown/blobs/"+layer.String()+ns, nil); resp.StatusCode == 200 || bytes.Contains(body, content) {
		t.Errorf("a repository never confirmed, with the upstream down: got %d, want a refusal", resp.StatusCode)
	}
}

// TestScopingWhileDownloading: a download in flight for one repository is
// not joined under a repository that does not hold the blob.
func TestScopingWhileDownloading(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 2<<20)
	b, srv := newBlobServer(t, content)
	b.holdAt, b.hold = 512<<10, make(chan struct{})
	b.repo = "test/app"
	e := blobEnv(t, b, srv)
	resp, err := http.Get(e.proxy.URL + "/v2/test/app/blobs/" + b.digest.String() + "?ns=" + upstreamName)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadFull(resp.Body, make([]byte, 100<<10)); err != nil {
		t.Fatal(err)
	}
	// Bounded: joining the download would wait for the held upstream.
	client := &http.Client{Timeout: 10 * time.Second}
	for _, method := range []string{"GET", "HEAD"} {
		req, _ := http.NewRequest(method, e.proxy.URL+"/v2/test/elsewhere/blobs/"+b.digest.String()+"?ns="+upstreamName, nil)
		r, err := client.Do(req)
		if err != nil {
			t.Errorf("%s under another repository while downloading: %v", method, err)
			continue
		}
		body, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if r.StatusCode != http.StatusNotFound || len(body) > 0 && bytes.Contains(content, body) {
			t.Errorf("%s under another repository while downloading: got %d, want 404", method, r.StatusCode)
		}
	}
	close(b.hold)
	if got, err := io.ReadAll(resp.Body); err != nil || len(got) != len(content)-100<<10 {
		t.Fatalf("the download's own client: %d bytes, err %v", len(got), err)
	}
}
