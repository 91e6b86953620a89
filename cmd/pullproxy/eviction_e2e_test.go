package main

import (
	"bufio"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// pullThrough fetches an image through pullproxy as a client does, its
// manifest by tag then its config and layers, and checks every digest.
func pullThrough(t *testing.T, proxyURL, repo string, img registrytest.Pushed, tag string) {
	t.Helper()
	base := proxyURL + "/v2/" + repo
	req, _ := http.NewRequest(http.MethodGet, base+"/manifests/"+tag+"?ns=reg.test", nil)
	req.Header.Set("Accept", img.Manifest.MediaType)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || digest.FromBytes(body) != img.Manifest.Digest {
		t.Fatalf("%s:%s manifest: %s", repo, tag, resp.Status)
	}
	for _, d := range append([]registrytest.Descriptor{img.Config}, img.Layers...) {
		if got := getBody(t, base+"/blobs/"+d.Digest.String()+"?ns=reg.test"); digest.FromBytes(got) != d.Digest {
			t.Fatalf("%s:%s blob %s does not verify", repo, tag, d.Digest)
		}
	}
}

// metric reads one unlabelled sample from pullproxy's /metrics.
func metric(t *testing.T, proxyURL, name string) float64 {
	t.Helper()
	resp, err := http.Get(proxyURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("/metrics has no %s", name)
	return 0
}

// blobsOnDisk sums the sizes of the files under the data dir's blobs/.
func blobsOnDisk(t *testing.T, dataDir string) int64 {
	t.Helper()
	var n int64
	filepath.WalkDir(filepath.Join(dataDir, "blobs"), func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// TestEvictionKeepsTheBound: with --max-size 100MiB and 102 MiB of images
// pulled, the store never holds more than the bound, the newest image is
// served again without an upstream byte, and the oldest, partly evicted,
// is fetched again. Then pullproxy is killed again and again while it
// evicts down to smaller bounds, and verify finds the store clean.
func TestEvictionKeepsTheBound(t *testing.T) {
	up := &upstreamLog{n: map[string]int{}}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { up.next = h; return up }))
	const layer = 8704 << 10 // 8.5 MiB: six images of two layers are 102 MiB
	var images []registrytest.Pushed
	for i := range 6 {
		img, err := reg.Push(t.Context(), registrytest.Image{Repo: "team/app", Tag: fmt.Sprintf("v%d", i),
			LayerSizes: []int64{layer, layer}, Seed: uint64(100 + i)})
		if err != nil {
			t.Fatal(err)
		}
		images = append(images, img)
	}
	const bound = 100 << 20
	data := t.TempDir()
	args := []string{"--data-dir", data, "--upstream", "reg.test=" + reg.URL()}
	p := startProxy(t, append(args, "--max-size", "100MiB")...)
	up.take()
	for i, img := range images {
		pullThrough(t, p.URL, "team/app", img, fmt.Sprintf("v%d", i))
		if held, disk := metric(t, p.URL, "pullproxy_store_bytes"), blobsOnDisk(t, data); held > bound || disk > bound {
			t.Errorf("after image %d: the store holds %v bytes (%d on disk), over the bound of %d", i, held, disk, bound)
		}
	}
	if n := metric(t, p.URL, "pullproxy_evicted_blobs_total"); n == 0 {
		t.Error("nothing was evicted")
	}
	up.take()
	pullThrough(t, p.URL, "team/app", images[5], "v5")
	if got := up.take(); got["GET blobs"] != 0 {
		t.Errorf("the newest image again: %d upstream blob GETs, want 0", got["GET blobs"])
	}
	pullThrough(t, p.URL, "team/app", images[0], "v0")
	if got := up.take(); got["GET blobs"] == 0 {
		t.Error("the oldest image again: no upstream blob GET, yet it was evicted")
	}
	p.stop()

	// Killed while evicting down to ever smaller bounds: each start is
	// over its bound and evicts at once; the kills come at times swept
	// across start-up and the eviction.
	for i := range 15 {
		maxSize := fmt.Sprintf("%dMiB", 96-6*i)
		cmd := exec.Command(pullproxyBin, append([]string{"serve", "--listen", "127.0.0.1:0", "--max-size", maxSize}, args...)...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(10+i*4) * time.Millisecond)
		cmd.Process.Kill()
		cmd.Wait()
		if code, out := runVerify(t, "--data-dir", data); code != 0 {
			t.Fatalf("killed while evicting to %s: verify exits %d:\n%s", maxSize, code, out)
		}
	}
	p = startProxy(t, append(args, "--max-size", "10MiB")...)
	deadline := time.Now().Add(30 * time.Second)
	for metric(t, p.URL, "pullproxy_store_bytes") > 10<<20 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if held := metric(t, p.URL, "pullproxy_store_bytes"); held > 10<<20 {
		t.Errorf("after the kills: %v bytes held, over 10 MiB", held)
	}
	pullThrough(t, p.URL, "team/app", images[3], "v3") // evicted blobs come back
	p.stop()
	if code, out := runVerify(t, "--data-dir", data); code != 0 {
		t.Errorf("at the end: verify exits %d:\n%s", code, out)
	}
}
