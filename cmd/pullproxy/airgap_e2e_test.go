package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// runPullproxy runs a pullproxy command to its end and returns its output.
func runPullproxy(ctx context.Context, t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, pullproxyBin, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// TestSeedThenServeOffline: an image is seeded into a data dir through the
// incident's carrier; a second is seeded into a running server through its
// admin endpoint; then, every upstream unreachable, pullproxy serves the
// first --offline and containerd, configured by node-config without
// fallback, pulls it.
func TestSeedThenServeOffline(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	img := registrytest.Image{Repo: "app/big", Tag: "v1", Seed: 77, Index: true,
		LayerSizes: []int64{8 << 20, 4 << 20, 300 << 10}}
	pushed, err := reg.Push(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	other, err := reg.Push(ctx, registrytest.Image{Repo: "app/small", Tag: "v1", Seed: 78, LayerSizes: []int64{100 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	path := incidentCarrier(t, reg.Host(), carrier.Reset, 64e6, 0)
	const host = "registry.test:5000"
	data := filepath.Join(t.TempDir(), "data")
	config := writeConfig(t, fmt.Sprintf("fetch:\n  connection_budget: 4MiB\n  max_connections: 8\n  stall_timeout: 1s\n"+
		"upstreams:\n  - name: %s\n    endpoints: [{url: %q}]\n", host, path.URL()))

	// Into a data dir, through the carrier.
	out, err := runPullproxy(ctx, t, "seed", "--data-dir", data, "--config", config, host+"/app/big:v1")
	if err != nil || !strings.Contains(out, "seeded "+host+"/app/big:v1 "+pushed.Index.Digest.String()) {
		t.Fatalf("seed through the carrier: %v\n%s", err, out)
	}
	if st := path.Stats(); st.Cut == 0 {
		t.Errorf("the carrier cut no session: the seed did not cross a broken path")
	}

	// Into a running server, through its admin endpoint.
	running := startProxy(t, "--data-dir", t.TempDir(), "--upstream", host+"="+reg.URL())
	if running.AdminURL == "" {
		t.Fatal("no admin endpoint")
	}
	out, err = runPullproxy(ctx, t, "seed", "--server", running.AdminURL, host+"/app/small:v1", host+"/app/none:v1")
	if err == nil || !strings.Contains(out, "seeded "+host+"/app/small:v1") || !strings.Contains(out, "error "+host+"/app/none:v1") {
		t.Errorf("seed through the admin endpoint: want app/small seeded and app/none refused, got %v\n%s", err, out)
	}
	resp, err := http.Get(running.URL + "/v2/app/small/blobs/" + other.Layers[0].Digest.String() + "?ns=" + host)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Pullproxy-Source") != "cache" {
		t.Errorf("a seeded layer: %s from %q, want 200 from the cache", resp.Status, resp.Header.Get("Pullproxy-Source"))
	}
	// The admin endpoint is not on the registry listener.
	resp, err = http.Post(running.URL+"/seed", "application/json", strings.NewReader(`{"refs":["`+host+`/app/small:v1"]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		t.Error("the registry listener took a seed")
	}

	// Offline, the upstream gone: containerd pulls the seeded image.
	path.Close()
	reg.Close()
	offline := startProxy(t, "--data-dir", data, "--config", config, "--offline")
	hostsDir := t.TempDir()
	if out, err := runPullproxy(ctx, t, "node-config", "--mirror", offline.URL, "--registry", host, "--no-fallback", "--dir", hostsDir); err != nil {
		t.Fatalf("node-config: %v\n%s", err, out)
	}
	d, err := containerdtest.Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })
	if out, err := d.ContentFetch(ctx, hostsDir, host+"/app/big:v1"); err != nil {
		t.Fatalf("containerd from the offline mirror: %v\n%s", err, out)
	}
	have, err := d.ContentDigests(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range pushed.Layers {
		if !slices.Contains(have, l.Digest.String()) {
			t.Errorf("containerd lacks layer %s", l.Digest)
		}
	}
	if out, err := d.ContentFetch(ctx, hostsDir, host+"/app/small:v1"); err == nil {
		t.Errorf("an image never seeded into this data dir was pulled offline:\n%s", out)
	}
}
