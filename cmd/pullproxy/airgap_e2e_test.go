package main

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
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
	path := cuttingCarrier(t, reg.Host())
	const host = "registry.test:5000"
	data := filepath.Join(t.TempDir(), "data")
	config := writeConfig(t, fmt.Sprintf("fetch:\n  connection_budget: 4MiB\n  parallel_chunks: 1\n  stall_timeout: 1s\n"+
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
	// The admin endpoint on a unix socket, as a node-local deployment has it.
	socket := filepath.Join(t.TempDir(), "admin.sock")
	running := startProxy(t, "--data-dir", t.TempDir(), "--upstream", host+"="+reg.URL(), "--admin-listen", "unix:"+socket)
	running.AdminURL = "unix:" + socket
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
	// The live state of the upstream's path, from the admin endpoint.
	out, err = runPullproxy(ctx, t, "status", "--server", running.AdminURL)
	if err != nil || !strings.Contains(out, host) || !strings.Contains(out, reg.URL()) || !strings.Contains(out, "chunks lately") {
		t.Errorf("status: %v\n%s", err, out)
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

// TestExportImportOffline is the air-gapped site's path: an image seeded
// through the incident's carrier is exported from the store with its
// upstream gone, the archive read by skopeo, and imported into a fresh
// data dir (a truncated or altered archive is refused and leaves the
// store as it was); an image written by `crane pull` is imported into the
// running offline server through its admin endpoint; then, with no
// upstream reachable, containerd configured by node-config pulls both,
// and crane ls lists the imported tags.
func TestExportImportOffline(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	requireTools(t, "crane", "skopeo")
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	big, err := reg.Push(ctx, registrytest.Image{Repo: "app/big", Tag: "v1", Seed: 81, Index: true,
		LayerSizes: []int64{16 << 20, 200 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	small, err := reg.Push(ctx, registrytest.Image{Repo: "app/small", Tag: "v2", Seed: 82, LayerSizes: []int64{50 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	const host = "registry.test"
	regHost := reg.Host() // crane names what it pulls by where it pulled it from
	dir := t.TempDir()
	cranePulled := filepath.Join(dir, "small.tar")
	if out, err := exec.CommandContext(ctx, "crane", "pull", "--insecure", "--format", "tarball",
		regHost+"/app/small:v2", cranePulled).CombinedOutput(); err != nil {
		t.Fatalf("crane pull: %v\n%s", err, out)
	}

	// Seeded through the carrier, then exported with the upstream gone.
	path := cuttingCarrier(t, reg.Host())
	config := writeConfig(t, fmt.Sprintf("fetch:\n  connection_budget: 4MiB\n  parallel_chunks: 1\n  stall_timeout: 1s\n"+
		"upstreams:\n  - name: %s\n    endpoints: [{url: %q}]\n", host, path.URL()))
	source := filepath.Join(dir, "source")
	if out, err := runPullproxy(ctx, t, "seed", "--data-dir", source, "--config", config, host+"/app/big:v1"); err != nil {
		t.Fatalf("seed through the carrier: %v\n%s", err, out)
	}
	if path.Stats().Cut == 0 {
		t.Error("the carrier cut no session")
	}
	path.Close()
	reg.Close()
	exported := filepath.Join(dir, "big.tar")
	out, err := runPullproxy(ctx, t, "export", "--data-dir", source, "--config", config, "-o", exported, host+"/app/big:v1")
	if err != nil || !strings.Contains(out, "exported "+host+"/app/big:v1 "+big.Index.Digest.String()) {
		t.Fatalf("export: %v\n%s", err, out)
	}
	if out, err := exec.CommandContext(ctx, "skopeo", "inspect", "--raw", "oci-archive:"+exported).CombinedOutput(); err != nil ||
		!strings.Contains(string(out), big.Manifest.Digest.String()) {
		t.Errorf("skopeo reading the export: %v\n%s", err, out)
	}

	// A truncated archive, and a layer altered inside an intact tar:
	// refused, naming the entry, the store as it was.
	data := filepath.Join(dir, "site")
	b, err := os.ReadFile(exported)
	if err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(dir, "truncated.tar")
	if err := os.WriteFile(truncated, b[:len(b)*2/3], 0o644); err != nil {
		t.Fatal(err)
	}
	corrupt := filepath.Join(dir, "corrupt.tar")
	entry := "blobs/sha256/" + big.Layers[0].Digest.Encoded()
	rewriteTar(t, exported, corrupt, entry)
	for _, tc := range []struct{ file, names string }{{truncated, "entry"}, {corrupt, entry}} {
		if out, err := runPullproxy(ctx, t, "import", "--data-dir", data, tc.file); err == nil || !strings.Contains(out, tc.names) {
			t.Errorf("%s: %v, want it refused naming %s\n%s", filepath.Base(tc.file), err, tc.names, out)
		}
		if n := blobsOnDisk(t, data); n != 0 {
			t.Errorf("%s was refused but left %d bytes of blobs in the store", filepath.Base(tc.file), n)
		}
	}

	out, err = runPullproxy(ctx, t, "import", "--data-dir", data, exported)
	if err != nil || !strings.Contains(out, "imported "+host+"/app/big:v1") {
		t.Fatalf("import: %v\n%s", err, out)
	}
	p := startProxy(t, "--data-dir", data, "--offline", "--upstream", host+"=http://127.0.0.1:1", "--upstream", regHost+"=http://127.0.0.1:1")
	out, err = runPullproxy(ctx, t, "import", "--server", p.AdminURL, cranePulled)
	if err != nil || !strings.Contains(out, "imported "+regHost+"/app/small:v2") {
		t.Fatalf("import through the admin endpoint: %v\n%s", err, out)
	}

	hostsDir := t.TempDir()
	if out, err := runPullproxy(ctx, t, "node-config", "--mirror", p.URL, "--registry", host+","+regHost, "--no-fallback", "--dir", hostsDir); err != nil {
		t.Fatalf("node-config: %v\n%s", err, out)
	}
	d, err := containerdtest.Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })
	for _, ref := range []string{host + "/app/big:v1", regHost + "/app/small:v2"} {
		if out, err := d.ContentFetch(ctx, hostsDir, ref); err != nil {
			t.Errorf("containerd pulling %s offline: %v\n%s", ref, err, out)
		}
	}
	have, err := d.ContentDigests(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A docker-save tar keeps configs, not manifests or compressed layers:
	// the image is the same one (its config), its layers compressed anew.
	for _, d := range []registrytest.Descriptor{big.Layers[0], big.Layers[1], big.Config, small.Config} {
		if !slices.Contains(have, d.Digest.String()) {
			t.Errorf("containerd lacks %s", d.Digest)
		}
	}
	// ctr reads the export too, naming the image by its full reference.
	if out, err := d.Ctr(ctx, "image", "import", "--all-platforms", "--no-unpack", exported); err != nil {
		t.Errorf("ctr image import of the export: %v\n%s", err, out)
	} else if out, err := d.Ctr(ctx, "image", "ls", "-q"); err != nil || !strings.Contains(string(out), host+"/app/big:v1") {
		t.Errorf("ctr image ls after importing the export: %v\n%s", err, out)
	}
	if out, err := exec.CommandContext(ctx, "crane", "ls", "--insecure", strings.TrimPrefix(p.URL, "http://")+"/"+host+"/app/big").CombinedOutput(); err != nil ||
		strings.TrimSpace(string(out)) != "v1" {
		t.Errorf("crane ls offline: %v\n%s", err, out)
	}
	// Exported again, from the running offline server.
	again := filepath.Join(dir, "again.tar")
	if out, err := runPullproxy(ctx, t, "export", "--server", p.AdminURL, "-o", again, host+"/app/big:v1"); err != nil {
		t.Errorf("export through the admin endpoint: %v\n%s", err, out)
	} else if out, err := exec.CommandContext(ctx, "skopeo", "inspect", "--raw", "oci-archive:"+again).CombinedOutput(); err != nil ||
		!strings.Contains(string(out), big.Manifest.Digest.String()) {
		t.Errorf("skopeo reading the server's export: %v\n%s", err, out)
	}
	p.stop()
	if code, out := runVerify(t, "--data-dir", data); code != 0 {
		t.Errorf("verify at the end: exit %d\n%s", code, out)
	}
}

// rewriteTar copies the tar src to dst with one byte of entry flipped.
func rewriteTar(t *testing.T, src, dst, entry string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	tr, tw := tar.NewReader(in), tar.NewWriter(out)
	found := false
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if hdr.Name == entry {
			b[len(b)/2] ^= 1
			found = true
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		tw.Write(b)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if !found {
		t.Fatalf("%s has no entry %s", src, entry)
	}
}

// cuttingCarrier is the incident's carrier at its worst: 83% of sessions
// reset after 1.3 to 3.1 MB.
func cuttingCarrier(t *testing.T, target string) *carrier.Relay {
	t.Helper()
	r, err := carrier.Start(carrier.Config{Target: target, CutProb: 0.83, CutMin: 1_300_000, CutMax: 3_100_000,
		Mode: carrier.Reset, Bandwidth: 64e6, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}
