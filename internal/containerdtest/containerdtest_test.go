package containerdtest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
)

// requireTools skips the test when containerd cannot be run here, or fails
// it when PULLPROXY_REQUIRE_TOOLS=1 says the tools must be present.
func requireTools(t *testing.T) {
	t.Helper()
	if ok, reason := Available(); !ok {
		if os.Getenv("PULLPROXY_REQUIRE_TOOLS") == "1" {
			t.Fatalf("containerd unavailable and PULLPROXY_REQUIRE_TOOLS=1: %s", reason)
		}
		t.Skip(reason)
	}
}

// requestLog records the requests a handler receives.
type requestLog struct {
	mu   sync.Mutex
	reqs []string
}

func (l *requestLog) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		l.reqs = append(l.reqs, r.Method+" "+r.URL.RequestURI())
		l.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

func (l *requestLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.reqs)
}

func TestContentFetchThroughPlainHTTPMirror(t *testing.T) {
	requireTools(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := startMirror(ctx, t)
	layers, err := m.img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	want := []string{m.manifest.String(), m.config.String()}
	for _, l := range layers {
		dig, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, dig.String())
	}

	start := time.Now()
	d, err := Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	stopAtCleanup(t, d)
	t.Logf("containerd ready in %v (socket %s)", time.Since(start), d.Address())
	hostsDir, err := d.WriteHostsDir(mirroredHost, m.reg.URL)
	if err != nil {
		t.Fatal(err)
	}

	before, err := d.ContentDigests(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != 0 {
		t.Fatalf("content store not empty before fetch: %v", before)
	}
	out, err := d.ContentFetch(ctx, hostsDir, mirroredHost+"/test/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ctr content fetch output:\n%s", out)
	got, err := d.ContentDigests(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, dig := range want {
		if !slices.Contains(got, dig) {
			t.Errorf("digest %s missing from content store %v", dig, got)
		}
	}
	m.requireMirrored(t)
}

// mirroredHost is the registry the tests' images are pulled as, through
// the mirror: a name no resolver knows, so a fallback to it fails loudly.
const mirroredHost = "registry.invalid:5000"

// testMirror is an in-process registry standing in for a mirror, with one
// image pushed as test/app:v1.
type testMirror struct {
	reqs             *requestLog
	reg              *httptest.Server
	img              v1.Image
	manifest, config v1.Hash
}

func startMirror(ctx context.Context, t *testing.T) *testMirror {
	t.Helper()
	m := &testMirror{reqs: &requestLog{}}
	m.reg = httptest.NewServer(m.reqs.wrap(registry.New(registry.Logger(log.New(io.Discard, "", 0)))))
	t.Cleanup(m.reg.Close)
	// The CRI plugin unpacks what it pulls: random.Image's layers are real tarballs.
	img, err := random.Image(1024, 2)
	if err != nil {
		t.Fatal(err)
	}
	pushImage(ctx, t, m.reg.URL, "test/app", "v1", img)
	m.img = img
	if m.manifest, err = img.Digest(); err != nil {
		t.Fatal(err)
	}
	if m.config, err = img.ConfigName(); err != nil {
		t.Fatal(err)
	}
	return m
}

// requireMirrored checks that containerd's requests reached the mirror
// naming the upstream registry (ns=).
func (m *testMirror) requireMirrored(t *testing.T) {
	t.Helper()
	seen := m.reqs.all()
	var mirrored int
	for _, r := range seen {
		if strings.Contains(r, "ns=registry.invalid%3A5000") {
			mirrored++
		}
	}
	if mirrored == 0 {
		t.Errorf("no mirror request carried ns=registry.invalid%%3A5000; requests: %v", seen)
	}
	t.Logf("registry requests:\n%s", strings.Join(seen, "\n"))
}

// stopAtCleanup stops d when the test ends.
func stopAtCleanup(t *testing.T, d *Daemon) {
	t.Cleanup(func() {
		if err := d.Stop(); err != nil {
			t.Errorf("Stop: %v", err)
		}
	})
}

func TestStopIsIdempotentAndStartChecksDir(t *testing.T) {
	requireTools(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	dir := t.TempDir()
	first, err := Start(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = first.Stop() })
	if err := first.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := first.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}

	if _, err := Start(ctx, dir+"/missing"); err == nil {
		t.Fatal("Start in a missing directory succeeded")
	}
}

// pushImage uploads img to the registry at baseURL as repo:tag using the
// distribution API directly (monolithic blob uploads, then the manifest).
func pushImage(ctx context.Context, t *testing.T, baseURL, repo, tag string, img v1.Image) {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range layers {
		dig, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		rc, err := l.Compressed()
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		pushBlob(ctx, t, baseURL, repo, dig.String(), b)
	}
	cfgName, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	pushBlob(ctx, t, baseURL, repo, cfgName.String(), cfg)

	manifest, err := img.RawManifest()
	if err != nil {
		t.Fatal(err)
	}
	mt, err := img.MediaType()
	if err != nil {
		t.Fatal(err)
	}
	put(ctx, t, http.MethodPut, fmt.Sprintf("%s/v2/%s/manifests/%s", baseURL, repo, tag), string(mt), manifest, http.StatusCreated)
}

func pushBlob(ctx context.Context, t *testing.T, baseURL, repo, digest string, b []byte) {
	t.Helper()
	put(ctx, t, http.MethodPost, fmt.Sprintf("%s/v2/%s/blobs/uploads/?digest=%s", baseURL, repo, digest), "application/octet-stream", b, http.StatusCreated)
}

func put(ctx context.Context, t *testing.T, method, url, contentType string, body []byte, wantStatus int) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", contentType)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != wantStatus {
		t.Fatalf("%s %s: status %d, want %d: %s", method, url, resp.StatusCode, wantStatus, msg)
	}
}

// requireCRITools is requireTools for the CRI mode, which also needs crictl.
func requireCRITools(t *testing.T) {
	t.Helper()
	if ok, reason := CRIAvailable(); !ok {
		if os.Getenv("PULLPROXY_REQUIRE_TOOLS") == "1" {
			t.Fatalf("containerd's CRI unavailable and PULLPROXY_REQUIRE_TOOLS=1: %s", reason)
		}
		t.Skip(reason)
	}
}

func TestCrictlPullThroughPlainHTTPMirror(t *testing.T) {
	requireCRITools(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m := startMirror(ctx, t)

	dir := t.TempDir()
	start := time.Now()
	d, err := StartCRI(ctx, dir, dir+"/hosts")
	if err != nil {
		t.Fatal(err)
	}
	stopAtCleanup(t, d)
	t.Logf("containerd with CRI ready in %v (socket %s)", time.Since(start), d.Address())
	hostsDir, err := d.WriteHostsDir(mirroredHost, m.reg.URL)
	if err != nil {
		t.Fatal(err)
	}
	if hostsDir != dir+"/hosts" {
		t.Fatalf("WriteHostsDir wrote %s, want the CRI's config_path %s", hostsDir, dir+"/hosts")
	}

	ref := mirroredHost + "/test/app:v1"
	out, err := d.CrictlPull(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("crictl pull output:\n%s", out)
	got, err := d.CrictlImage(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != m.config.String() {
		t.Errorf("image ID %s, want the config digest %s", got.ID, m.config)
	}
	if want := mirroredHost + "/test/app@" + m.manifest.String(); !slices.Contains(got.RepoDigests, want) {
		t.Errorf("repo digests %v, want %s among them", got.RepoDigests, want)
	}
	if !slices.Contains(got.RepoTags, ref) {
		t.Errorf("repo tags %v, want %s among them", got.RepoTags, ref)
	}
	m.requireMirrored(t)
}

// TestCrictlNeedsCRIDaemon: the crictl helpers refuse a daemon without CRI
// rather than talking to whatever crictl would find by default.
func TestCrictlNeedsCRIDaemon(t *testing.T) {
	requireTools(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d, err := Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Stop() })
	if out, err := d.CrictlPull(ctx, "registry.invalid/test/app:v1"); err == nil {
		t.Fatalf("CrictlPull on a daemon without CRI succeeded:\n%s", out)
	}
	if _, err := StartCRI(ctx, t.TempDir(), ""); err == nil {
		t.Fatal("StartCRI without a hosts directory succeeded")
	}
}
