package main

import (
	"bytes"
	"context"
	"io"
	"log"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/pullproxy/pullproxy/internal/containerdtest"
)

// TestNodeConfigContainerdPulls: containerd, configured with exactly what
// node-config wrote, pulls through the mirror, with and without fallback.
func TestNodeConfigContainerdPulls(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	upstreamSrv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer upstreamSrv.Close()
	_, img := pushIndex(t, upstreamSrv.URL, "e2e/app:v1")
	const host = "registry.test:5000" // never resolvable: a fallback to it would fail loudly
	p := startProxy(t, "--data-dir", t.TempDir(), "--upstream", host+"="+upstreamSrv.URL)

	for _, tc := range []struct {
		name string
		args []string
	}{
		{"with fallback", nil},
		{"no fallback", []string{"--no-fallback"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			var out, errOut bytes.Buffer
			cmd := exec.CommandContext(ctx, pullproxyBin, append([]string{"node-config", "--mirror", p.URL,
				"--registry", host, "--dir", dir}, tc.args...)...)
			cmd.Stdout, cmd.Stderr = &out, &errOut
			if err := cmd.Run(); err != nil {
				t.Fatalf("node-config: %v\n%s%s", err, out.String(), errOut.String())
			}
			if !strings.Contains(out.String(), `config_path = "`+dir+`"`) {
				t.Errorf("node-config printed no config_path line for %s:\n%s", dir, out.String())
			}
			d, err := containerdtest.Start(ctx, t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { d.Stop() })
			if out, err := d.ContentFetch(ctx, dir, host+"/e2e/app:v1"); err != nil {
				t.Fatalf("containerd with node-config's %s: %v\n%s", filepath.Join(dir, host, "hosts.toml"), err, out)
			}
			have, err := d.ContentDigests(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range imageDigests(t, img) {
				if !slices.Contains(have, w) {
					t.Errorf("containerd lacks %s", w)
				}
			}
		})
	}
}

// TestNodeConfigContainerdPlainHTTP: for a plain-HTTP registry given as
// http://HOST:PORT, containerd with node-config's hosts.toml reports an
// image the mirror and the registry lack as not found (not as an HTTPS
// client talking to an HTTP server), and falls back to the registry itself
// once pullproxy is stopped.
func TestNodeConfigContainerdPlainHTTP(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	seen := &manifestClients{next: registry.New(registry.Logger(log.New(io.Discard, "", 0))), n: map[string]int{}}
	upstreamSrv := httptest.NewServer(seen)
	defer upstreamSrv.Close()
	_, img := pushIndex(t, upstreamSrv.URL, "e2e/app:v1")
	seen.take()
	plain := strings.TrimPrefix(upstreamSrv.URL, "http://") // 127.0.0.1:PORT
	p := startProxy(t, "--data-dir", t.TempDir(), "--upstream", plain+"="+upstreamSrv.URL)

	dir := t.TempDir()
	if out, err := exec.CommandContext(ctx, pullproxyBin, "node-config", "--mirror", p.URL,
		"--registry", "http://"+plain, "--dir", dir).CombinedOutput(); err != nil {
		t.Fatalf("node-config: %v\n%s", err, out)
	}
	d, err := containerdtest.Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })

	out, err := d.ContentFetch(ctx, dir, plain+"/e2e/missing:v1")
	if err == nil {
		t.Fatalf("containerd fetched an image no one has:\n%s", out)
	}
	if msg := err.Error(); !strings.Contains(msg, "e2e/missing:v1: not found") || strings.Contains(msg, "HTTP response to HTTPS client") {
		t.Errorf("containerd on a missing image: %v, want not found", err)
	}
	if got := seen.take(); got["pullproxy"] == 0 || got["containerd"] == 0 {
		t.Errorf("missing image: manifest requests %v, want the mirror's and then the fallback's", got)
	}

	p.stop()
	if out, err := d.ContentFetch(ctx, dir, plain+"/e2e/app:v1"); err != nil {
		t.Fatalf("mirror stopped: containerd did not fall back to %s: %v\n%s", plain, err, out)
	}
	have, err := d.ContentDigests(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range imageDigests(t, img) {
		if !slices.Contains(have, w) {
			t.Errorf("mirror stopped: containerd lacks %s", w)
		}
	}
	if got := seen.take(); got["containerd"] == 0 || got["pullproxy"] != 0 {
		t.Errorf("mirror stopped: manifest requests %v, want containerd's own only", got)
	}
}
