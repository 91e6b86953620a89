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
