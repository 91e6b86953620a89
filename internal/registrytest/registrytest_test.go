package registrytest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	digest "github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

func startRegistry(t testing.TB, opts ...Option) *Registry {
	t.Helper()
	r, err := Start(context.Background(), t.TempDir(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return r
}

func get(t *testing.T, url string, header map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func layerBytes(t *testing.T, img Image, i int) []byte {
	t.Helper()
	b, err := io.ReadAll(img.Layer(i))
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(b)) != img.LayerSizes[i] {
		t.Fatalf("layer %d: generated %d bytes, want %d", i, len(b), img.LayerSizes[i])
	}
	return b
}

var smallSizes = []int64{1 << 10, 300 << 10, 2 << 20}

func TestPushAndPull(t *testing.T) {
	var requests atomic.Int64
	r := startRegistry(t, WithHandlerWrapper(func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			requests.Add(1)
			h.ServeHTTP(w, req)
		})
	}))
	if !strings.HasPrefix(r.URL(), "http://127.0.0.1:") || r.URL() != "http://"+r.Host() {
		t.Fatalf("URL %q, Host %q", r.URL(), r.Host())
	}

	img := Image{Repo: "test/small", Tag: "v1", LayerSizes: smallSizes, Seed: 1, Platform: "linux/arm64/v8"}
	p, err := r.Push(context.Background(), img)
	if err != nil {
		t.Fatal(err)
	}
	if requests.Load() == 0 {
		t.Error("handler wrapper saw no request")
	}
	if p.Index != nil || len(p.Layers) != 3 {
		t.Fatalf("Pushed = %+v", p)
	}

	// Manifest by tag, with the OCI Accept header.
	resp, body := get(t, r.URL()+"/v2/test/small/manifests/v1", map[string]string{"Accept": ocispec.MediaTypeImageManifest})
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("manifest GET: %s: %s", resp.Status, body)
	}
	if got := resp.Header.Get("Docker-Content-Digest"); got != p.Manifest.Digest.String() {
		t.Errorf("Docker-Content-Digest %q, want %s", got, p.Manifest.Digest)
	}
	if got := resp.Header.Get("Content-Type"); got != ocispec.MediaTypeImageManifest {
		t.Errorf("Content-Type %q", got)
	}
	if digest.FromBytes(body) != p.Manifest.Digest || int64(len(body)) != p.Manifest.Size {
		t.Errorf("manifest body does not match descriptor %+v", p.Manifest)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatal(err)
	}
	if m.Config.Digest != p.Config.Digest || len(m.Layers) != 3 || m.Layers[2].Digest != p.Layers[2].Digest {
		t.Errorf("manifest %+v does not match %+v", m, p)
	}
	for i, l := range m.Layers {
		if l.MediaType != ocispec.MediaTypeImageLayer || l.Size != smallSizes[i] {
			t.Errorf("layer %d: %+v", i, l)
		}
	}

	// Config: valid OCI image config for the platform, diff_ids = layer digests.
	resp, body = get(t, r.URL()+"/v2/test/small/blobs/"+p.Config.Digest.String(), nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("config GET: %s", resp.Status)
	}
	var cfg ocispec.Image
	if err := json.Unmarshal(body, &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.OS != "linux" || cfg.Architecture != "arm64" || cfg.Variant != "v8" || cfg.RootFS.Type != "layers" {
		t.Errorf("config %s", body)
	}
	for i, d := range cfg.RootFS.DiffIDs {
		if d != p.Layers[i].Digest {
			t.Errorf("diff_id %d = %s, want %s", i, d, p.Layers[i].Digest)
		}
	}

	// Blobs: whole, closed range, open-ended range.
	for i, l := range p.Layers {
		want := layerBytes(t, img, i)
		if digest.FromBytes(want) != l.Digest {
			t.Fatalf("layer %d: Image.Layer content does not match pushed digest", i)
		}
		url := r.URL() + "/v2/test/small/blobs/" + l.Digest.String()
		resp, body := get(t, url, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("blob GET: %s", resp.Status)
		}
		if sum := sha256.Sum256(body); "sha256:"+hex.EncodeToString(sum[:]) != l.Digest.String() {
			t.Errorf("layer %d: body sha256 does not match %s", i, l.Digest)
		}
		if got := resp.Header.Get("Docker-Content-Digest"); got != l.Digest.String() {
			t.Errorf("layer %d: Docker-Content-Digest %q", i, got)
		}

		resp, body = get(t, url, map[string]string{"Range": "bytes=100-199"})
		if resp.StatusCode != http.StatusPartialContent {
			t.Fatalf("layer %d: Range bytes=100-199: %s", i, resp.Status)
		}
		if !bytes.Equal(body, want[100:200]) {
			t.Errorf("layer %d: bytes=100-199 returned wrong bytes (%d)", i, len(body))
		}
		if got, wantCR := resp.Header.Get("Content-Range"), fmt.Sprintf("bytes 100-199/%d", l.Size); got != wantCR {
			t.Errorf("layer %d: Content-Range %q, want %q", i, got, wantCR)
		}

		resp, body = get(t, url, map[string]string{"Range": "bytes=1000-"})
		if resp.StatusCode != http.StatusPartialContent {
			t.Fatalf("layer %d: Range bytes=1000-: %s", i, resp.Status)
		}
		if !bytes.Equal(body, want[1000:]) {
			t.Errorf("layer %d: bytes=1000- returned wrong bytes (%d, want %d)", i, len(body), len(want)-1000)
		}
		if got, wantCR := resp.Header.Get("Content-Range"), fmt.Sprintf("bytes 1000-%d/%d", l.Size-1, l.Size); got != wantCR {
			t.Errorf("layer %d: Content-Range %q, want %q", i, got, wantCR)
		}
	}
}

func TestDeterminism(t *testing.T) {
	var patches atomic.Int64
	r := startRegistry(t, WithHandlerWrapper(func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			if req.Method == http.MethodPatch {
				patches.Add(1)
			}
			h.ServeHTTP(w, req)
		})
	}))
	ctx := context.Background()
	img := Image{Repo: "test/det", Tag: "a", LayerSizes: smallSizes, Seed: 42}
	a, err := r.Push(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	if n := patches.Load(); n != int64(len(smallSizes)) {
		t.Errorf("%d PATCH requests for %d layers", n, len(smallSizes))
	}
	// Same seed, other registry (nothing memoised there) and other tag.
	r2 := startRegistry(t)
	img.Tag = "b"
	b, err := r2.Push(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	// Same seed, same registry again: blobs are found by HEAD.
	c, err := r.Push(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	if n := patches.Load(); n != int64(len(smallSizes)) {
		t.Errorf("pushing again uploaded layers: %d PATCH requests in all", n)
	}
	for _, other := range []Pushed{b, c} {
		if other.Manifest.Digest != a.Manifest.Digest || other.Config.Digest != a.Config.Digest {
			t.Errorf("same seed: manifest/config differ: %+v vs %+v", a, other)
		}
		for i := range a.Layers {
			if other.Layers[i].Digest != a.Layers[i].Digest {
				t.Errorf("same seed: layer %d differs", i)
			}
		}
	}

	img.Seed = 43
	d, err := r.Push(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	if d.Manifest.Digest == a.Manifest.Digest || d.Config.Digest == a.Config.Digest {
		t.Error("different seed: same manifest/config digest")
	}
	for i := range a.Layers {
		if d.Layers[i].Digest == a.Layers[i].Digest {
			t.Errorf("different seed: layer %d has the same digest", i)
		}
	}
	// Layers of one image differ from each other even at equal sizes.
	e, err := r.Push(ctx, Image{Repo: "test/det", Tag: "same", LayerSizes: []int64{4096, 4096}, Seed: 42})
	if err != nil {
		t.Fatal(err)
	}
	if e.Layers[0].Digest == e.Layers[1].Digest {
		t.Error("two layers of equal size have the same digest")
	}
}

func TestIndex(t *testing.T) {
	r := startRegistry(t)
	p, err := r.Push(context.Background(), Image{Repo: "idx", Tag: "latest", LayerSizes: []int64{10, 0}, Seed: 7, Index: true})
	if err != nil {
		t.Fatal(err)
	}
	if p.Index == nil {
		t.Fatal("no index descriptor")
	}
	resp, body := get(t, r.URL()+"/v2/idx/manifests/latest", map[string]string{"Accept": ocispec.MediaTypeImageIndex})
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Docker-Content-Digest") != p.Index.Digest.String() {
		t.Fatalf("index GET: %s %q: %s", resp.Status, resp.Header.Get("Docker-Content-Digest"), body)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(body, &idx); err != nil {
		t.Fatal(err)
	}
	if len(idx.Manifests) != 1 || idx.Manifests[0].Digest != p.Manifest.Digest {
		t.Fatalf("index %s", body)
	}
	if pl := idx.Manifests[0].Platform; pl == nil || pl.OS != runtime.GOOS || pl.Architecture != runtime.GOARCH {
		t.Errorf("index platform %+v", pl)
	}
	resp, body = get(t, r.URL()+"/v2/idx/manifests/"+p.Manifest.Digest.String(), map[string]string{"Accept": ocispec.MediaTypeImageManifest})
	if resp.StatusCode != http.StatusOK || digest.FromBytes(body) != p.Manifest.Digest {
		t.Fatalf("manifest by digest: %s", resp.Status)
	}
}

func TestNoLayers(t *testing.T) {
	r := startRegistry(t)
	p, err := r.Push(context.Background(), Image{Repo: "empty", Tag: "v0"})
	if err != nil {
		t.Fatal(err)
	}
	resp, body := get(t, r.URL()+"/v2/empty/manifests/v0", map[string]string{"Accept": ocispec.MediaTypeImageManifest})
	if resp.StatusCode != http.StatusOK || digest.FromBytes(body) != p.Manifest.Digest {
		t.Fatalf("manifest GET: %s: %s", resp.Status, body)
	}
	if !bytes.Contains(body, []byte(`"layers":[]`)) {
		t.Errorf("manifest %s", body)
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestLogOutput checks that distribution's logger lookups reach this
// package's logger (i.e. that the dcontext logger key is still recognised).
func TestLogOutput(t *testing.T) {
	var buf syncBuffer
	r := startRegistry(t, WithLogOutput(&buf))
	// A bad upload is logged at error level ("response completed with error").
	req, _ := http.NewRequest(http.MethodPut, r.URL()+"/v2/x/blobs/uploads/nonexistent?digest=sha256:00", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode < 400 {
		t.Fatalf("bad upload: %s", resp.Status)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(buf.String(), "level=error") {
		if time.Now().After(deadline) {
			t.Fatalf("no error-level log line reached WithLogOutput; got %q", buf.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestStartErrors(t *testing.T) {
	if _, err := Start(context.Background(), ""); err == nil {
		t.Error("Start with empty dir succeeded")
	}
	r := startRegistry(t)
	if _, err := r.Push(context.Background(), Image{Repo: "a", Tag: "b", Platform: "linux"}); err == nil {
		t.Error("bad platform accepted")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
}

// BenchmarkPush600MiB pushes a 600 MiB image (layers of 223, 197, 149 and
// 29 MiB and four of 1 MiB) into a fresh registry per iteration. Not part of
// CI; run with
//
//	go test -run '^$' -bench Push600MiB -benchtime 1x ./internal/registrytest/
//
// REGISTRYTEST_BENCH_DIR chooses the parent of the storage directories
// (default: the test's temporary directory).
func BenchmarkPush600MiB(b *testing.B) {
	const MiB = 1 << 20
	sizes := []int64{223 * MiB, 197 * MiB, 149 * MiB, 29 * MiB, MiB, MiB, MiB, MiB}
	var total int64
	for _, s := range sizes {
		total += s
	}
	parent := b.TempDir()
	if d := os.Getenv("REGISTRYTEST_BENCH_DIR"); d != "" {
		parent = d
	}
	b.SetBytes(total)
	for i := 0; b.Loop(); i++ {
		r, err := Start(context.Background(), parent+"/"+strconv.Itoa(i))
		if err != nil {
			b.Fatal(err)
		}
		// A new seed per iteration, so no blob is found already pushed.
		img := Image{Repo: "bench/big", Tag: "v1", LayerSizes: sizes, Seed: uint64(1000 + i)}
		start := time.Now()
		if _, err := r.Push(context.Background(), img); err != nil {
			b.Fatal(err)
		}
		b.Logf("push %d MiB: %v", total/MiB, time.Since(start))
		r.Close()
	}
}

// TestTLS: with WithTLS the registry is pushed to and pulled from over TLS,
// trusted through the CA it wrote, and refused by a client that does not
// trust it.
func TestTLS(t *testing.T) {
	t.Parallel()
	r := startRegistry(t, WithTLS())
	if !strings.HasPrefix(r.URL(), "https://") {
		t.Fatalf("URL: got %q, want https://", r.URL())
	}
	pushed, err := r.Push(t.Context(), Image{Repo: "org/app", Tag: "v1", LayerSizes: []int64{100 << 10}, Seed: 3})
	if err != nil {
		t.Fatalf("Push: %v", err)
	}
	pem, err := os.ReadFile(r.CAFile())
	if err != nil {
		t.Fatalf("reading the CA: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatalf("CA file %s holds no certificate", r.CAFile())
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	layer := pushed.Layers[0]
	resp, err := client.Get(r.URL() + "/v2/org/app/blobs/" + layer.Digest.String())
	if err != nil {
		t.Fatalf("GET over TLS: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || digest.FromBytes(b) != layer.Digest {
		t.Errorf("GET over TLS: got %d bytes (%v), want the layer", len(b), err)
	}
	if _, err := http.Get(r.URL() + "/v2/"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("GET without the CA: got %v, want a certificate error", err)
	}
}

func TestBlobRedirects(t *testing.T) {
	t.Parallel()
	r := startRegistry(t, WithBlobRedirects())
	img := Image{Repo: "org/app", Tag: "v1", LayerSizes: []int64{300 << 10}, Seed: 4}
	pushed, err := r.Push(t.Context(), img)
	if err != nil {
		t.Fatalf("Push: %v", err)
	}
	want := layerBytes(t, img, 0)
	blobURL := r.URL() + "/v2/org/app/blobs/" + pushed.Layers[0].Digest.String()

	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noFollow.Get(blobURL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	loc := resp.Header.Get("Location")
	if resp.StatusCode != http.StatusTemporaryRedirect || !strings.HasPrefix(loc, r.URL()+blobStorePrefix+"/") {
		t.Fatalf("GET %s: got %d to %q, want 307 to %s%s/…", blobURL, resp.StatusCode, loc, r.URL(), blobStorePrefix)
	}

	for _, tc := range []struct {
		rng        string
		status     int
		start, end int
	}{
		{"", http.StatusOK, 0, len(want)},
		{"bytes=1000-204799", http.StatusPartialContent, 1000, 204800},
		{"bytes=204800-", http.StatusPartialContent, 204800, len(want)},
	} {
		header := map[string]string{}
		if tc.rng != "" {
			header["Range"] = tc.rng
		}
		resp, b := get(t, blobURL, header)
		if resp.StatusCode != tc.status || !bytes.Equal(b, want[tc.start:tc.end]) {
			t.Errorf("GET %q, redirect followed: got %d and %d bytes, want %d and bytes %d-%d of the layer",
				tc.rng, resp.StatusCode, len(b), tc.status, tc.start, tc.end-1)
		}
	}
	// Manifests are served by the registry itself.
	resp, _ = get(t, r.URL()+"/v2/org/app/manifests/v1", map[string]string{"Accept": ocispec.MediaTypeImageManifest})
	if resp.StatusCode != http.StatusOK || resp.Request.URL.Path != "/v2/org/app/manifests/v1" {
		t.Errorf("GET manifest: got %d from %s, want 200 from the registry", resp.StatusCode, resp.Request.URL.Path)
	}
}
