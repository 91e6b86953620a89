package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/crane"
	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/pullproxy/pullproxy/internal/containerdtest"
)

// blobRefuser refuses one blob with a fixed status, as an upstream does that
// lacks it, or will not give it to pullproxy's credentials.
type blobRefuser struct {
	next   http.Handler
	blob   atomic.Value // digest string
	status int
}

func (b *blobRefuser) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if d, _ := b.blob.Load().(string); d != "" && strings.HasSuffix(r.URL.Path, "/blobs/"+d) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(b.status)
		fmt.Fprintf(w, `{"errors":[{"code":"BLOB_UNKNOWN","message":"refused with %d for the test"}]}`, b.status)
		return
	}
	b.next.ServeHTTP(w, r)
}

// TestContainerdFallsBackWhenUpstreamRefusesBlob: pullproxy's upstream
// serves an image's manifest but refuses one of its layers. pullproxy must
// pass the refusal on as an error, not as a 200 with no body, so that
// containerd asks the `server` of its hosts.toml for that layer and the
// pull succeeds.
func TestContainerdFallsBackWhenUpstreamRefusesBlob(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	// The same image on both: the upstream pullproxy mirrors, and the
	// server containerd falls back to.
	refuser := &blobRefuser{next: registry.New(registry.Logger(log.New(io.Discard, "", 0))), status: http.StatusNotFound}
	upstreamSrv := httptest.NewServer(refuser)
	defer upstreamSrv.Close()
	server := &upstreamLog{next: registry.New(registry.Logger(log.New(io.Discard, "", 0))), n: map[string]int{}}
	serverSrv := httptest.NewServer(server)
	defer serverSrv.Close()
	_, img := pushIndex(t, upstreamSrv.URL, "e2e/app:v1")
	src, dst := strings.TrimPrefix(upstreamSrv.URL, "http://"), strings.TrimPrefix(serverSrv.URL, "http://")
	if err := crane.Copy(src+"/e2e/app:v1", dst+"/e2e/app:v1", crane.Insecure); err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	refused := m.Layers[1].Digest.String()
	refuser.blob.Store(refused)
	server.take()

	const host = "registry.test:5000"
	p := startProxy(t, "--data-dir", filepath.Join(t.TempDir(), "data"), "--upstream", host+"="+upstreamSrv.URL)
	d, err := containerdtest.Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })
	hosts, err := d.WriteHostsDirWithServer(host, p.URL, serverSrv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := d.ContentFetch(ctx, hosts, host+"/e2e/app:v1"); err != nil {
		t.Fatalf("pull: %v\n%s", err, out)
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
	got := server.take()
	t.Logf("requests to the fallback server: %v", got)
	if got["GET blobs"] != 1 {
		t.Errorf("blob GETs from the fallback server: got %d, want 1 (the refused layer only)", got["GET blobs"])
	}
	if !p.loggedWithin("refused with 404", 5*time.Second) {
		t.Errorf("pullproxy's log does not give the upstream's reason for the refusal")
	}
}
