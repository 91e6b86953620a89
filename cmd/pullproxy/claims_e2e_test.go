package main

import (
	"cmp"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// hostileUpstream wraps a registry: it claims a blob of claimedSize for
// every digest in lies, and once down is set, drops every connection as an
// unreachable upstream would.
type hostileUpstream struct {
	next        http.Handler
	lies        map[digest.Digest]bool
	claimedSize int64
	down        atomic.Bool
}

func (h *hostileUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if h.down.Load() {
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
		return
	}
	_, ref, ok := strings.Cut(r.URL.Path, "/blobs/")
	if !ok || !h.lies[digest.Digest(ref)] {
		h.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set("Docker-Content-Digest", ref)
	w.Header().Set("Content-Type", "application/octet-stream")
	if r.Header.Get("Range") != "" {
		w.Header().Set("Content-Range", fmt.Sprintf("bytes 0-%d/%d", 1<<20-1, h.claimedSize))
		w.Header().Set("Content-Length", fmt.Sprint(1<<20))
		w.WriteHeader(http.StatusPartialContent)
		w.Write(make([]byte, 1<<20))
		return
	}
	w.Header().Set("Content-Length", fmt.Sprint(h.claimedSize))
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodGet {
		w.Write(make([]byte, 1<<20)) // then the connection ends short
	}
}

// blobFiles counts the files under the data dir's blobs/.
func blobFiles(t *testing.T, dataDir string) int {
	t.Helper()
	n := 0
	filepath.WalkDir(filepath.Join(dataDir, "blobs"), func(_ string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			n++
		}
		return nil
	})
	return n
}

// TestSizeClaimEvictsNothing: an upstream that claims a 10 TB blob, with
// the default bound (85% of the data dir's file system), is answered 507
// naming the size and the bound, and nothing cached is evicted for it: with
// the upstream then unreachable, every layer cached before is still served.
func TestSizeClaimEvictsNothing(t *testing.T) {
	hostile := &hostileUpstream{claimedSize: 10_000_000_000_000}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { hostile.next = h; return hostile }))
	img, err := reg.Push(t.Context(), registrytest.Image{Repo: "team/app", Tag: "v1", LayerSizes: []int64{1 << 20, 2 << 20, 3 << 20}, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	evil := digest.FromString("a layer no disk could hold")
	hostile.lies = map[digest.Digest]bool{evil: true}
	data := t.TempDir()
	p := startProxy(t, "--data-dir", data, "--upstream", "reg.test="+reg.URL())
	pullThrough(t, p.URL, "team/app", img, "v1")
	before := blobFiles(t, data)

	resp, err := http.Get(p.URL + "/v2/team/evil/blobs/" + evil.String() + "?ns=reg.test")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusInsufficientStorage || !strings.Contains(string(body), "10000000000000") {
		t.Errorf("the 10 TB claim: %s %s; want 507 naming the size", resp.Status, body)
	}
	if after := blobFiles(t, data); after != before {
		t.Errorf("blob files: %d before the claim, %d after; want none evicted", before, after)
	}

	hostile.down.Store(true)
	served := 0
	for _, l := range append([]registrytest.Descriptor{img.Config}, img.Layers...) {
		resp, err := http.Get(p.URL + "/v2/team/app/blobs/" + l.Digest.String() + "?ns=reg.test")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && digest.FromBytes(b) == l.Digest {
			served++
		}
	}
	if want := 1 + len(img.Layers); served != want {
		t.Errorf("with the upstream unreachable: %d of %d cached blobs served", served, want)
	}
}

// TestEvictionPassesBlobsBeingRead: with the data dir named relatively (as
// the default ./data is), a layer a client is still reading is not evicted
// while other images push the store past --max-size: it is fetched from
// the upstream once.
func TestEvictionPassesBlobsBeingRead(t *testing.T) {
	up := &upstreamLog{n: map[string]int{}}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { up.next = h; return up }))
	// The first layer larger than what loopback's socket buffers take, so
	// that pullproxy still holds it open while the client reads slowly.
	var images []registrytest.Pushed
	for i := range 4 {
		size := int64(8 << 20)
		if i == 0 {
			size = 16 << 20
		}
		img, err := reg.Push(t.Context(), registrytest.Image{Repo: "team/app", Tag: fmt.Sprintf("v%d", i),
			LayerSizes: []int64{size}, Seed: uint64(300 + i)})
		if err != nil {
			t.Fatal(err)
		}
		images = append(images, img)
	}
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	data, err := filepath.Rel(wd, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, "--data-dir", data, "--max-size", "30MiB", "--upstream", "reg.test="+reg.URL())
	pullThrough(t, p.URL, "team/app", images[0], "v0")
	held := images[0].Layers[0].Digest

	// A client reads the first image's layer, slowly: it has taken a
	// little and holds the rest back while the others are pulled. Its
	// receive buffer is held small: loopback's may grow to tens of MiB
	// (net.ipv4.tcp_rmem), and take the whole layer at once.
	resp, err := smallWindowClient().Get(p.URL + "/v2/team/app/blobs/" + held.String() + "?ns=reg.test")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadFull(resp.Body, make([]byte, 64<<10)); err != nil {
		t.Fatal(err)
	}
	for i := 1; i < len(images); i++ {
		pullThrough(t, p.URL, "team/app", images[i], fmt.Sprintf("v%d", i))
	}
	if n := metric(t, p.URL, "pullproxy_evicted_blobs_total"); n == 0 {
		t.Fatal("nothing was evicted: the bound was not reached")
	}
	hex := held.Encoded()
	if _, err := os.Stat(filepath.Join(data, "blobs", "sha256", hex[:2], hex)); err != nil {
		t.Errorf("the layer being read was evicted: %v", err)
	}
	rest, err := io.ReadAll(resp.Body)
	if err != nil || int64(64<<10+len(rest)) != images[0].Layers[0].Size {
		t.Fatalf("the slow read: %d more bytes, %v", len(rest), err)
	}
}

// smallWindowClient is an HTTP client whose connections receive into 64 KiB
// at most: a sender cannot hand it more than that and its own send buffer
// before it reads.
func smallWindowClient() *http.Client {
	d := &net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 64<<10)
		})
		return cmp.Or(err, serr)
	}}
	return &http.Client{Transport: &http.Transport{DialContext: d.DialContext, Proxy: nil}}
}
