package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// manifestClients counts a registry's manifest requests by client, told
// apart by User-Agent: "podman" (containers/image), "containerd", or anyone
// else, here "pullproxy".
type manifestClients struct {
	next http.Handler
	mu   sync.Mutex
	n    map[string]int
}

func (m *manifestClients) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.Contains(r.URL.Path, "/manifests/") {
		client := "pullproxy"
		switch ua := r.UserAgent(); {
		case strings.Contains(ua, "containers/"):
			client = "podman"
		case strings.HasPrefix(ua, "containerd/"):
			client = "containerd"
		}
		m.mu.Lock()
		m.n[client]++
		m.mu.Unlock()
	}
	m.next.ServeHTTP(w, r)
}

// take returns the counts so far and starts again from zero.
func (m *manifestClients) take() map[string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.n
	m.n = map[string]int{}
	return n
}

// TestNodeConfigPodmanPulls: podman, configured with exactly what
// node-config --crio wrote, pulls a plain-HTTP registry with a port
// (127.0.0.1:PORT, whose mirror location names it 127.0.0.1_PORT) through
// the mirror, and from the registry itself once the mirror is down; and
// pulls a registry it cannot resolve through the mirror alone.
func TestNodeConfigPodmanPulls(t *testing.T) {
	requireTools(t, "podman")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	seen := &manifestClients{next: registry.New(registry.Logger(log.New(io.Discard, "", 0))), n: map[string]int{}}
	upstreamSrv := httptest.NewServer(seen)
	defer upstreamSrv.Close()
	idx, _ := pushIndex(t, upstreamSrv.URL, "e2e/app:v1")
	wantID := platformConfigID(t, idx)
	seen.take()

	plain := strings.TrimPrefix(upstreamSrv.URL, "http://") // 127.0.0.1:PORT, plain HTTP
	const unresolvable = "registry.test:5000"               // a fallback to it would fail loudly
	p := startProxy(t, "--data-dir", t.TempDir(),
		"--upstream", plain+"="+upstreamSrv.URL, "--upstream", unresolvable+"="+upstreamSrv.URL)

	conf := filepath.Join(t.TempDir(), "pullproxy.conf")
	out, err := exec.CommandContext(ctx, pullproxyBin, "node-config", "--crio", "--crio-file", conf, "--mirror", p.URL,
		"--registry", "http://"+plain, "--registry", unresolvable).CombinedOutput()
	if err != nil {
		t.Fatalf("node-config: %v\n%s", err, out)
	}
	written, err := os.ReadFile(conf)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("node-config wrote %s:\n%s", conf, written)

	for _, tc := range []struct {
		name, ref  string
		mirrorDown bool
		wantFrom   string // the client the registry saw ask for the manifest
	}{
		{"through the mirror", plain + "/e2e/app:v1", false, "pullproxy"},
		{"unresolvable registry, through the mirror", unresolvable + "/e2e/app:v1", false, "pullproxy"},
		{"mirror down: from the plain-HTTP registry", plain + "/e2e/app:v1", true, "podman"},
	} {
		if tc.mirrorDown {
			p.stop()
		}
		id, err := podmanPull(ctx, t, conf, tc.ref)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if id != wantID {
			t.Errorf("%s: podman pulled image %s, want %s", tc.name, id, wantID)
		}
		got := seen.take()
		for _, client := range []string{"pullproxy", "podman"} {
			if asked := got[client] > 0; asked != (client == tc.wantFrom) {
				t.Errorf("%s: the registry saw %d manifest requests from %s, want them from %s only",
					tc.name, got[client], client, tc.wantFrom)
			}
		}
	}
}

// podmanPull runs `podman pull ref` with registries.conf conf and nothing
// of the machine's: its own storage, state, signature policy and auth file.
// It returns the image ID podman prints.
func podmanPull(ctx context.Context, t *testing.T, conf, ref string) (string, error) {
	t.Helper()
	dir := t.TempDir()
	policy, auth := filepath.Join(dir, "policy.json"), filepath.Join(dir, "auth.json")
	for path, content := range map[string]string{policy: `{"default": [{"type": "insecureAcceptAnything"}]}`, auth: `{}`} {
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.CommandContext(ctx, "podman",
		"--root", filepath.Join(dir, "root"), "--runroot", filepath.Join(dir, "run"), "--tmpdir", filepath.Join(dir, "tmp"),
		"--storage-driver", "vfs", "--events-backend", "none", "--cgroup-manager", "cgroupfs",
		"pull", "--signature-policy", policy, ref)
	cmd.Env = append(os.Environ(),
		"CONTAINERS_REGISTRIES_CONF="+conf,
		"REGISTRY_AUTH_FILE="+auth,
		"HOME="+dir, // no per-user registries.conf.d
		"TMPDIR="+dir,
	)
	cmd.WaitDelay = time.Second
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("podman pull %s: %w\n%s", ref, err, stderr.String())
	}
	fields := strings.Fields(string(out))
	if len(fields) == 0 {
		return "", fmt.Errorf("podman pull %s printed no image ID\n%s", ref, stderr.String())
	}
	return fields[len(fields)-1], nil
}

// platformConfigID is the ID container storage gives idx's image for this
// machine's architecture: its config's digest, hex only.
func platformConfigID(t *testing.T, idx v1.ImageIndex) string {
	t.Helper()
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range m.Manifests {
		if d.Platform == nil || d.Platform.Architecture != runtime.GOARCH {
			continue
		}
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		c, err := img.ConfigName()
		if err != nil {
			t.Fatal(err)
		}
		return c.Hex
	}
	t.Skipf("the test image has no %s variant", runtime.GOARCH)
	return ""
}
