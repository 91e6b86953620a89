package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// debianRegistryUpstream starts Debian's docker-registry (distribution
// 2.8) on a loopback port and returns its URL. Unlike distribution 3, it
// still answers a tag asked for without Docker's schema 2 in Accept (a
// client listing only OCI types) with the image's manifest converted to
// schema 1, as many private registries in use do.
func debianRegistryUpstream(t *testing.T) string {
	t.Helper()
	requireTools(t, "docker-registry")
	dir := t.TempDir()
	addr := closedAddr(t)
	config := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(config, []byte(fmt.Sprintf(
		"version: 0.1\nlog: {level: warn}\nstorage: {filesystem: {rootdirectory: %q}}\nhttp: {addr: %q}\n",
		filepath.Join(dir, "data"), addr)), 0o644); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	cmd := exec.Command("docker-registry", "serve", config)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting docker-registry: %v", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})
	url := "http://" + addr
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+"/v2/", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return url
			}
		}
		select {
		case <-exited:
			t.Fatalf("docker-registry exited: %s", out.String())
		case <-ctx.Done():
			cmd.Process.Kill()
			<-exited
			t.Fatalf("docker-registry did not answer on %s within 20 s: %s", addr, out.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
