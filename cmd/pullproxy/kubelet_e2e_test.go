package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// The kubelet's path: the kubelet asks containerd's CRI plugin to pull
// (crictl stands in for it), the plugin reads the hosts.toml that
// `pullproxy node-config` wrote under its config_path, and pulls through
// pullproxy, or from the registry itself when pullproxy is down. The
// registries are named by their real address, 127.0.0.1:PORT over plain
// HTTP, so that a fallback to them works.

// TestKubeletPathColdPullAcrossCarrierThenFallback: a cold pull of
// multi-MB layers succeeds on its first try while the carrier cuts
// pullproxy's upstream sessions, and the CRI reports the registry's digest;
// then, with pullproxy stopped, the node pulls another image from the
// registry itself.
func TestKubeletPathColdPullAcrossCarrierThenFallback(t *testing.T) {
	ok, reason := containerdtest.CRIAvailable()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	var direct containerdRequests
	reg := startRegistry(t, registrytest.WithHandlerWrapper(direct.wrap))
	registryName := reg.Host() // 127.0.0.1:PORT
	big := pushTarImage(ctx, t, registryName+"/kubelet/big:v1", 8<<20, 3)
	other := pushTarImage(ctx, t, registryName+"/kubelet/other:v1", 1<<20, 2)

	path := incidentCarrier(t, registryName, carrier.Reset, 64e6, 0)
	// The default budget (1 MiB a connection) stays under the cuts: start
	// above them, as TestContainerdPullThroughCarrier does, so that sessions
	// are cut and the budget must learn the path during the pull.
	config := fmt.Sprintf("fetch:\n  connection_budget: 4MiB\n  max_connections: 8\n  stall_timeout: 1s\n"+
		"upstreams:\n  - name: %q\n    endpoints: [{url: %q}]\n", registryName, path.URL())
	proxy := startProxy(t, "--data-dir", filepath.Join(t.TempDir(), "data"), "--config", writeConfig(t, config))
	hostsDir := nodeConfigHosts(ctx, t, proxy.URL, "http://"+registryName)
	node, err := containerdtest.StartCRI(ctx, t.TempDir(), hostsDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Stop() })

	// a. Cold, across the cutting carrier: one crictl pull, no retry.
	ref := registryName + "/kubelet/big:v1"
	start := time.Now()
	if out, err := node.CrictlPull(ctx, ref); err != nil {
		t.Fatalf("cold pull through pullproxy across the carrier: %v\n%s", err, out)
	}
	st := path.Stats()
	t.Logf("cold pull of %s in %v; carrier: %d sessions, %d cut, %d bytes down",
		ref, time.Since(start).Round(time.Millisecond), st.Sessions, st.Cut, st.BytesDown)
	requireCRIImage(ctx, t, node, ref, big)
	if st.Cut == 0 {
		t.Errorf("the carrier cut no session: the test did not test anything")
	}
	if n := direct.n.Load(); n != 0 {
		t.Errorf("containerd sent %d requests to the registry itself, want 0: the pull fell back instead of going through pullproxy", n)
	}
	if out, err := node.Crictl(ctx, "images", "--digests"); err == nil {
		t.Logf("crictl images --digests:\n%s", out)
	}

	// b. pullproxy down: containerd falls back to the hosts.toml server,
	// the registry itself.
	proxy.stop()
	ref = registryName + "/kubelet/other:v1"
	if out, err := node.CrictlPull(ctx, ref); err != nil {
		t.Fatalf("pull with pullproxy stopped, falling back to the registry: %v\n%s", err, out)
	}
	requireCRIImage(ctx, t, node, ref, other)
	if direct.n.Load() == 0 {
		t.Errorf("the registry itself got no request from containerd, yet the pull with pullproxy stopped succeeded")
	}
}

// TestKubeletPathErrorsNameTheCause: what a node's operator reads in
// `crictl pull` (and the kubelet's events) when pullproxy cannot answer,
// with no fallback, so that the error is pullproxy's: an unreachable
// upstream names the refused connection, and a missing image says not found.
func TestKubeletPathErrorsNameTheCause(t *testing.T) {
	ok, reason := containerdtest.CRIAvailable()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	// The registry refuses one layer to pullproxy, as one that lacks it or
	// will not give it to pullproxy's credentials.
	refuser := &blobRefuser{status: http.StatusForbidden}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(next http.Handler) http.Handler {
		refuser.next = next
		return refuser
	}))
	reachable := reg.Host()
	refused := pushTarImage(ctx, t, reachable+"/kubelet/refused:v1", 1<<20, 1)
	layers, err := refused.Layers()
	if err != nil {
		t.Fatal(err)
	}
	layer, err := layers[0].Digest()
	if err != nil {
		t.Fatal(err)
	}
	refuser.blob.Store(layer.String())
	unreachable := closedAddr(t) // a registry whose port refuses connections
	proxy := startProxy(t, "--data-dir", filepath.Join(t.TempDir(), "data"),
		"--upstream", reachable+"="+reg.URL(), "--upstream", unreachable+"=http://"+unreachable)
	hostsDir := nodeConfigHosts(ctx, t, proxy.URL, "http://"+reachable, "--registry", "http://"+unreachable, "--no-fallback")
	node, err := containerdtest.StartCRI(ctx, t.TempDir(), hostsDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { node.Stop() })

	for _, tc := range []struct {
		name, ref string
		want      string // in crictl's output
	}{
		// containerd resolves with HEAD: the status line is all it has.
		{"upstream unreachable", unreachable + "/kubelet/app:v1",
			"failed with status code [manifests v1]: 503 upstream " + unreachable + " unreachable: connection refused"},
		{"image missing", reachable + "/kubelet/missing:v1", "kubelet/missing:v1: not found"},
		{"layer refused upstream", reachable + "/kubelet/refused:v1",
			"403 upstream " + reachable + " denied pullproxy access to kubelet/refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pullCtx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			out, err := node.CrictlPull(pullCtx, tc.ref)
			if err == nil {
				t.Fatalf("crictl pull %s succeeded, want an error:\n%s", tc.ref, out)
			}
			if pullCtx.Err() != nil {
				t.Fatalf("crictl pull %s did not fail within a minute: %v", tc.ref, err)
			}
			t.Logf("crictl pull %s:\n%s", tc.ref, bytes.TrimSpace(out))
			if !strings.Contains(string(out), tc.want) {
				t.Errorf("crictl's error does not contain %q: the node is not told the cause", tc.want)
			}
		})
	}
}

// nodeConfigHosts runs `pullproxy node-config` for the mirror at mirrorURL
// and the registry at registryURL (plus any further args) into a fresh
// directory, checks that the registry's hosts.toml names it as the server,
// and returns the directory: containerd's config_path.
func nodeConfigHosts(ctx context.Context, t *testing.T, mirrorURL, registryURL string, args ...string) string {
	t.Helper()
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, pullproxyBin, append([]string{"node-config",
		"--mirror", mirrorURL, "--registry", registryURL, "--dir", dir}, args...)...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("node-config --registry %s: %v\n%s%s", registryURL, err, stdout.String(), stderr.String())
	}
	host := strings.TrimPrefix(registryURL, "http://")
	hostsTOML, err := os.ReadFile(filepath.Join(dir, host, "hosts.toml"))
	if err != nil {
		t.Fatalf("node-config --registry %s: %v", registryURL, err)
	}
	if want := `server = "` + registryURL + `"`; !strings.Contains(string(hostsTOML), want) {
		t.Errorf("node-config's hosts.toml for %s lacks %s:\n%s", host, want, hostsTOML)
	}
	return dir
}

// pushTarImage pushes an image of layers layers, each a tarball holding
// size random bytes (the CRI plugin unpacks what it pulls, so layers must
// be real tarballs), to ref on a plain-HTTP registry.
func pushTarImage(ctx context.Context, t *testing.T, ref string, size int64, layers int) v1.Image {
	t.Helper()
	img, err := random.Image(size, int64(layers))
	if err != nil {
		t.Fatal(err)
	}
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img, remote.WithContext(ctx)); err != nil {
		t.Fatalf("pushing %s: %v", ref, err)
	}
	return img
}

// requireCRIImage checks that the CRI knows ref as img: the config's
// digest as its ID, and the registry's manifest digest among its repo
// digests.
func requireCRIImage(ctx context.Context, t *testing.T, node *containerdtest.Daemon, ref string, img v1.Image) {
	t.Helper()
	got, err := node.CrictlImage(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	manifest, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	config, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if want := parsed.Context().Name() + "@" + manifest.String(); !slices.Contains(got.RepoDigests, want) {
		t.Errorf("crictl inspecti %s: repo digests %v, want %s (the registry's)", ref, got.RepoDigests, want)
	}
	if got.ID != config.String() {
		t.Errorf("crictl inspecti %s: image ID %s, want %s (the config's digest)", ref, got.ID, config)
	}
}

// containerdRequests counts the requests containerd itself sends to a
// registry (pullproxy's carry another User-Agent).
type containerdRequests struct{ n atomic.Int64 }

func (c *containerdRequests) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.UserAgent(), "containerd/") {
			c.n.Add(1)
		}
		next.ServeHTTP(w, r)
	})
}

// closedAddr returns a loopback address nothing listens on: a port just
// released, which the kernel does not hand out again at once.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}
