package main

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// runVerify runs the binary's verify and returns its exit code and output.
func runVerify(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(pullproxyBin, append([]string{"verify", "--quiet"}, args...)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
		return ee.ExitCode(), out.String()
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, out.String()
}

// TestVerifyCommand: verify refuses a data dir a server uses, finds a layer
// damaged on disk (exit 2), repairs it (exit 1), and finds nothing after
// (exit 0); the server, started again, serves the layer fetched anew.
func TestVerifyCommand(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	reg, err := registrytest.Start(t.Context(), filepath.Join(dir, "registry"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	pushed, err := reg.Push(t.Context(), registrytest.Image{Repo: "org/app", Tag: "v1", LayerSizes: []int64{300_000}, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	layer := pushed.Layers[0]
	data := filepath.Join(dir, "data")
	args := []string{"--data-dir", data, "--upstream", "reg.test=" + reg.URL()}
	blobURL := func(p *proxyProcess) string {
		return p.URL + "/v2/org/app/blobs/" + layer.Digest.String() + "?ns=reg.test"
	}
	p := startProxy(t, args...)
	if body := getBody(t, blobURL(p)); digest.FromBytes(body) != layer.Digest {
		t.Fatal("the layer through pullproxy does not verify")
	}
	if code, out := runVerify(t, "--data-dir", data); code != verifyFailed || !strings.Contains(out, "stop the server first") {
		t.Errorf("while served: exit %d, %q; want 3 and the reason", code, out)
	}
	p.stop()

	if code, out := runVerify(t, "--data-dir", data); code != 0 {
		t.Fatalf("intact: exit %d, %q; want 0", code, out)
	}
	file := filepath.Join(data, "blobs", "sha256", layer.Digest.Encoded()[:2], layer.Digest.Encoded())
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	b[1000] ^= 1
	if err := os.WriteFile(file, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if code, out := runVerify(t, "--data-dir", data); code != verifyFound || !strings.Contains(out, "damaged "+layer.Digest.String()) {
		t.Errorf("damaged: exit %d, %q; want 2 naming the layer", code, out)
	}
	if code, out := runVerify(t, "--data-dir", data, "--repair"); code != verifyRepaired || !strings.Contains(out, "quarantined") {
		t.Errorf("repair: exit %d, %q; want 1, quarantined", code, out)
	}
	if code, out := runVerify(t, "--data-dir", data); code != 0 {
		t.Errorf("after the repair: exit %d, %q; want 0", code, out)
	}
	p = startProxy(t, args...)
	if body := getBody(t, blobURL(p)); digest.FromBytes(body) != layer.Digest {
		t.Error("after the repair, the layer through pullproxy does not verify")
	}
}

// getBody GETs url and returns the body of a 200.
func getBody(t *testing.T, url string) []byte {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s, %v", url, resp.Status, err)
	}
	return b
}
