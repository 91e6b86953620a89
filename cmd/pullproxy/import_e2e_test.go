package main

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/archivetest"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// blobFileNames returns the names of the blob files under dataDir.
func blobFileNames(t *testing.T, dataDir string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	filepath.WalkDir(filepath.Join(dataDir, "blobs"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			out[d.Name()] = true
		}
		return nil
	})
	return out
}

// importSource returns a data dir holding a small image, imported.
func importSource(ctx context.Context, t *testing.T) string {
	t.Helper()
	a := archivetest.NewLayout()
	a.Image("registry.test/app/held:v1", 1,
		a.Blob(ocispec.MediaTypeImageLayerGzip, archivetest.LayerBytes(1, 300<<10)),
		a.Blob(ocispec.MediaTypeImageLayerGzip, archivetest.LayerBytes(2, 100<<10)))
	file := filepath.Join(t.TempDir(), "held.tar")
	a.Write(t, file)
	data := filepath.Join(t.TempDir(), "data")
	if out, err := runPullproxy(ctx, t, "import", "--data-dir", data, file); err != nil {
		t.Fatalf("import: %v\n%s", err, out)
	}
	return data
}

// TestImportRefusesTooLarge: an archive whose manifest declares a 10 TiB
// layer is refused, naming the size and the bound, before anything is
// written or evicted: the store's blob files are the same before and
// after, the archive's other blobs not among them.
func TestImportRefusesTooLarge(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	data := importSource(ctx, t)
	before := blobFileNames(t, data)
	a := archivetest.NewLayout()
	small := a.Blob(ocispec.MediaTypeImageLayerGzip, archivetest.LayerBytes(3, 64<<10))
	huge := a.Blob(ocispec.MediaTypeImageLayerGzip, archivetest.LayerBytes(4, 1<<10))
	huge.Size = 10 << 40
	a.Image("registry.test/app/huge:v1", 2, small, huge)
	file := filepath.Join(t.TempDir(), "huge.tar")
	a.Write(t, file)
	for _, maxSize := range []string{"", "max_size: 1GiB\n"} {
		out, err := runPullproxy(ctx, t, "import", "--data-dir", data, "--config", writeConfig(t, maxSize+"offline: true\n"), file)
		if err == nil || !strings.Contains(out, "larger than the store can hold") || !strings.Contains(out, "10995116277760") {
			t.Errorf("%q: import of a 10 TiB claim: %v, want refused naming the size and the bound\n%s", maxSize, err, out)
		}
		after := blobFileNames(t, data)
		for f := range before {
			if !after[f] {
				t.Errorf("%q: blob %s was evicted for a claim", maxSize, f)
			}
		}
		if len(after) != len(before) {
			t.Errorf("%q: %d blob files after the refusal, %d before", maxSize, len(after), len(before))
		}
	}
}

// TestImportHeldDigestFalseClaims: an archive naming a layer the store
// holds, with a false size (its entry the true bytes padded to it), is
// refused: the held blob is read and checked, not taken on the archive's
// word, and the false size is not recorded: once the layer is evicted,
// the image is still pulled through the upstream.
func TestImportHeldDigestFalseClaims(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	pushed, err := reg.Push(ctx, registrytest.Image{Repo: "app/real", Tag: "v1", Seed: 91, LayerSizes: []int64{256 << 10, 64 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	const host = "registry.test"
	config := writeConfig(t, fmt.Sprintf("upstreams:\n  - name: %s\n    endpoints: [{url: %q}]\n", host, reg.URL()))
	data := filepath.Join(t.TempDir(), "data")
	if out, err := runPullproxy(ctx, t, "seed", "--data-dir", data, "--config", config, host+"/app/real:v1"); err != nil {
		t.Fatalf("seed: %v\n%s", err, out)
	}
	layer := pushed.Layers[0]
	resp, err := http.Get(reg.URL() + "/v2/app/real/blobs/" + layer.Digest.String())
	if err != nil {
		t.Fatal(err)
	}
	trueBytes, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || int64(len(trueBytes)) != layer.Size {
		t.Fatalf("the layer from the registry: %d bytes, %v", len(trueBytes), err)
	}

	// The archive: the true bytes padded to twice their size, declared so.
	a := archivetest.NewLayout()
	a.File(archivetest.BlobEntryName(layer.Digest), append(trueBytes, make([]byte, len(trueBytes))...))
	claimed := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: layer.Digest, Size: 2 * layer.Size}
	a.Image(host+"/app/real:v2", 3, claimed)
	file := filepath.Join(t.TempDir(), "claims.tar")
	a.Write(t, file)
	// No upstream configured for registry.test: the archive may record tags.
	out, err := runPullproxy(ctx, t, "import", "--data-dir", data, file)
	if err == nil || !strings.Contains(out, "size mismatch") {
		t.Errorf("import naming a held layer with a false size: %v, want refused\n%s", err, out)
	}

	// Evicted, as the store would under pressure, then pulled again.
	hex := layer.Digest.Encoded()
	if err := os.Remove(filepath.Join(data, "blobs", "sha256", hex[:2], hex)); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, "--data-dir", data, "--config", config)
	resp, err = http.Get(p.URL + "/v2/app/real/blobs/" + layer.Digest.String() + "?ns=" + host)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || err != nil || string(got) != string(trueBytes) {
		t.Errorf("the real layer after the claim and an eviction: %s, %d bytes, %v; want 200 with its %d bytes",
			resp.Status, len(got), err, layer.Size)
	}
}

// TestImportLeavesOnlineTags: an archive tagging an image for an online
// upstream imports its blobs, but neither moves the upstream's tag nor
// creates a repository the upstream lacks; with --retag (through the
// admin endpoint) it does.
func TestImportLeavesOnlineTags(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	upstreamImg, err := reg.Push(ctx, registrytest.Image{Repo: "app/small1", Tag: "v1", Seed: 92, LayerSizes: []int64{32 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	const host = "registry.test"
	config := writeConfig(t, fmt.Sprintf("upstreams:\n  - name: %s\n    endpoints: [{url: %q}]\n", host, reg.URL()))
	a := archivetest.NewLayout()
	layer := a.Blob(ocispec.MediaTypeImageLayerGzip, archivetest.LayerBytes(5, 48<<10))
	archived := a.Image(host+"/app/small1:v1", 4, layer)
	a.Image(host+"/app/fresh:v1", 5, layer)
	file := filepath.Join(t.TempDir(), "tags.tar")
	a.Write(t, file)
	data := filepath.Join(t.TempDir(), "data")
	out, err := runPullproxy(ctx, t, "import", "--data-dir", data, "--config", config, file)
	if err != nil || !strings.Contains(out, "--retag") {
		t.Fatalf("import for an online upstream: %v, want its blobs imported and its tags left\n%s", err, out)
	}
	if !blobFileNames(t, data)[layer.Digest.Encoded()] {
		t.Error("the archive's layer was not imported")
	}

	p := startProxy(t, "--data-dir", data, "--config", config)
	resolve := func(repo string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodHead, p.URL+"/v2/"+repo+"/manifests/v1?ns="+host, nil)
		req.Header.Set("Accept", ocispec.MediaTypeImageManifest+", "+ocispec.MediaTypeImageIndex+
			", application/vnd.docker.distribution.manifest.v2+json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("Docker-Content-Digest")
	}
	if code, d := resolve("app/small1"); code != http.StatusOK || d != upstreamImg.Manifest.Digest.String() {
		t.Errorf("app/small1:v1 after the import: %d %s, want the upstream's %s", code, d, upstreamImg.Manifest.Digest)
	}
	if code, d := resolve("app/fresh"); code != http.StatusNotFound {
		t.Errorf("app/fresh:v1, which the upstream lacks: %d %s, want 404", code, d)
	}

	out, err = runPullproxy(ctx, t, "import", "--server", p.AdminURL, "--retag", file)
	if err != nil {
		t.Fatalf("import --retag: %v\n%s", err, out)
	}
	if code, d := resolve("app/small1"); code != http.StatusOK || d != archived.Digest.String() {
		t.Errorf("app/small1:v1 after import --retag: %d %s, want the archive's %s", code, d, archived.Digest)
	}
}

// TestImportRefusesSparse: a layer stored as a sparse tar entry (4 KiB
// carried, 64 MiB declared by its header, the digest that of the whole)
// is refused before a byte of it is written.
func TestImportRefusesSparse(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	a := archivetest.NewLayout()
	a.Image("registry.test/app/sparse:v1", 6, a.SparseBlob(ocispec.MediaTypeImageLayer, archivetest.LayerBytes(6, 4<<10), 64<<20))
	file := filepath.Join(t.TempDir(), "sparse.tar")
	a.Write(t, file)
	data := filepath.Join(t.TempDir(), "data")
	out, err := runPullproxy(ctx, t, "import", "--data-dir", data, file)
	if err == nil || !strings.Contains(out, "sparse") {
		t.Errorf("import of a sparse entry: %v, want refused naming it\n%s", err, out)
	}
	var written int64
	filepath.WalkDir(data, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && !strings.Contains(p, string(filepath.Separator)+"meta"+string(filepath.Separator)) {
			if fi, err := d.Info(); err == nil {
				written += fi.Size()
			}
		}
		return nil
	})
	if written > 1<<20 {
		t.Errorf("%d bytes written into the data dir for a refused archive", written)
	}
}

// TestImportSIGTERM: an import stopped by SIGTERM, run locally or in a
// server, keeps nothing: no blob it added is left, and the client is told.
func TestImportSIGTERM(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	a := archivetest.NewLayout()
	var layers []ocispec.Descriptor
	// Enough that the rest of the import outlasts the wait between its
	// first commit and the signal on a busy machine.
	for i := range 16 {
		layers = append(layers, a.Blob(ocispec.MediaTypeImageLayerGzip, archivetest.LayerBytes(uint64(20+i), 16<<20)))
	}
	a.Image("registry.test/app/big:v1", 7, layers...)
	file := filepath.Join(t.TempDir(), "big.tar")
	a.Write(t, file)

	// waitForBlobs waits until the import has committed a blob.
	waitForBlobs := func(data string) bool {
		for range 3000 {
			if len(blobFileNames(t, data)) > 0 {
				return true
			}
			time.Sleep(5 * time.Millisecond)
		}
		return false
	}

	t.Run("local", func(t *testing.T) {
		data := filepath.Join(t.TempDir(), "data")
		var out strings.Builder
		cmd := exec.CommandContext(ctx, pullproxyBin, "import", "--data-dir", data, file)
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if !waitForBlobs(data) {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("no blob committed within 15 s\n%s", out.String())
		}
		cmd.Process.Signal(syscall.SIGTERM)
		err := cmd.Wait()
		if err == nil || !strings.Contains(out.String(), "import cancelled") || !strings.Contains(out.String(), "nothing was kept") {
			t.Errorf("import stopped by SIGTERM: %v, want it to say it was cancelled and kept nothing\n%s", err, out.String())
		}
		if n := blobsOnDisk(t, data); n != 0 {
			t.Errorf("%d bytes of blobs left by the cancelled import", n)
		}
	})

	t.Run("server", func(t *testing.T) {
		data := filepath.Join(t.TempDir(), "data")
		p := startProxy(t, "--data-dir", data, "--offline")
		var out strings.Builder
		cmd := exec.CommandContext(ctx, pullproxyBin, "import", "--server", p.AdminURL, file)
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		if !waitForBlobs(data) {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("no blob committed within 15 s\n%s", out.String())
		}
		p.cmd.Process.Signal(syscall.SIGTERM)
		p.cmd.Wait()
		// A server stopping lets admin requests finish within its grace,
		// then cancels those left: the import either ends whole, and is
		// kept, or is cancelled and takes back what it added. Never half.
		err := cmd.Wait()
		finished := err == nil && strings.Contains(out.String(), "1 images")
		cancelled := err != nil && strings.Contains(out.String(), "import cancelled") && strings.Contains(out.String(), "nothing was kept")
		if !finished && !cancelled {
			t.Errorf("import through a server stopped by SIGTERM: %v, want it done, or cancelled with nothing kept\n%s", err, out.String())
		}
		// What the next start finds.
		again := startProxy(t, "--data-dir", data, "--offline",
			"--config", writeConfig(t, "upstreams:\n  - name: registry.test\n    offline: true\n"))
		status := manifestStatus(t, again.URL+"/v2/app/big/manifests/v1?ns=registry.test")
		again.stop()
		n := blobsOnDisk(t, data)
		switch {
		case finished && status != http.StatusOK:
			t.Errorf("the import was answered done, but the next start answers its tag %d", status)
		case cancelled && n != 0:
			t.Errorf("%d bytes of blobs left by the cancelled import", n)
		}
		t.Logf("SIGTERM mid-import: done %v, cancelled %v; next start: tag %d, %d bytes of blobs", finished, cancelled, status, n)
	})
}

// TestExportFromStoreOnly: an image the store holds is exported with
// --data-dir alone, its upstream not configured.
func TestExportFromStoreOnly(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	data := importSource(ctx, t)
	exported := filepath.Join(t.TempDir(), "out.tar")
	out, err := runPullproxy(ctx, t, "export", "--data-dir", data, "-o", exported, "registry.test/app/held:v1")
	if err != nil || !strings.Contains(out, "exported registry.test/app/held:v1") {
		t.Fatalf("export without the upstream configured: %v\n%s", err, out)
	}
	fresh := filepath.Join(t.TempDir(), "data")
	if out, err := runPullproxy(ctx, t, "import", "--data-dir", fresh, exported); err != nil {
		t.Errorf("import of the export: %v\n%s", err, out)
	}
}

// manifestStatus returns the status of a GET of the manifest at url.
func manifestStatus(t *testing.T, url string) int {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json, "+
		"application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}
