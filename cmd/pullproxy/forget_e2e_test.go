package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// corruptingUpstream wraps a registry: while broken, the bytes of the
// blob it names are served with each response's first byte flipped, as a
// registry whose stored copy went bad would serve them.
type corruptingUpstream struct {
	next   http.Handler
	blob   digest.Digest
	broken atomic.Bool
}

func (c *corruptingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet && c.broken.Load() && strings.HasSuffix(r.URL.Path, "/blobs/"+c.blob.String()) {
		w = &flippingWriter{ResponseWriter: w}
	}
	c.next.ServeHTTP(w, r)
}

type flippingWriter struct {
	http.ResponseWriter
	flipped bool
}

func (f *flippingWriter) Write(p []byte) (int, error) {
	if !f.flipped && len(p) > 0 {
		f.flipped = true
		q := append([]byte(nil), p...)
		q[0] ^= 0xff
		return f.ResponseWriter.Write(q)
	}
	return f.ResponseWriter.Write(p)
}

// getStatus GETs url and returns the status and the body.
func getStatus(t *testing.T, url string) (int, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return -1, body // cut short: the bytes failed verification mid-answer
	}
	return resp.StatusCode, body
}

// TestForgetCorruptBlob: an upstream serves a layer corrupt; pullproxy
// answers 502 naming the fix, and status lists the blob with it. The
// operator pushes the blob again: pulls still get 502 (the endpoint's
// wait), until `pullproxy forget DIGEST`, after which the next pull gets
// the layer at once.
func TestForgetCorruptBlob(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	corrupting := &corruptingUpstream{}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { corrupting.next = h; return corrupting }))
	img, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v1", LayerSizes: []int64{1 << 20}, Seed: 36})
	if err != nil {
		t.Fatal(err)
	}
	layer := img.Layers[0].Digest
	corrupting.blob = layer
	corrupting.broken.Store(true)
	p := startProxy(t, "--data-dir", t.TempDir(), "--upstream", "reg.test="+reg.URL())
	url := p.URL + "/v2/team/app/blobs/" + layer.String() + "?ns=reg.test"

	// The first client may get a short read (the answer began before the
	// bytes were found bad); those after it get the 502 at once.
	status, body := getStatus(t, url)
	for i := 0; status != http.StatusBadGateway && i < 5; i++ {
		if status == http.StatusOK && digest.FromBytes(body) != layer {
			t.Fatal("a complete 200 answer with the corrupt bytes")
		}
		status, body = getStatus(t, url)
	}
	if status != http.StatusBadGateway {
		t.Fatalf("pull of the corrupt layer: got %d %s; want 502", status, body)
	}
	if !strings.Contains(string(body), "pullproxy forget "+layer.String()) {
		t.Errorf("the 502: got %s; want it to say to run pullproxy forget %s", body, layer)
	}
	if !p.loggedWithin("pullproxy forget "+layer.String(), 5*time.Second) {
		t.Error("the log does not give the fix, pullproxy forget with the digest")
	}
	out, err := runPullproxy(ctx, t, "status", "--server", p.AdminURL)
	if err != nil || !strings.Contains(out, "corrupt blob "+layer.String()) || !strings.Contains(out, "pullproxy forget "+layer.String()) {
		t.Errorf("pullproxy status: %v\n%s\nwant the corrupt blob listed with the fix", err, out)
	}

	corrupting.broken.Store(false) // deleted upstream and pushed again
	if status, _ := getStatus(t, url); status != http.StatusBadGateway {
		t.Logf("pull once the blob is intact upstream, before forget: got %d (the endpoint's wait is over already)", status)
	}
	out, err = runPullproxy(ctx, t, "forget", "--server", p.AdminURL, layer.String())
	if err != nil || !strings.Contains(out, reg.URL()) {
		t.Errorf("pullproxy forget: %v\n%s\nwant it to name the endpoint it asks again", err, out)
	}
	if status, body := getStatus(t, url); status != http.StatusOK || digest.FromBytes(body) != layer {
		t.Errorf("pull after pullproxy forget: got %d, %d bytes; want 200 and the layer at once", status, len(body))
	}
	out, err = runPullproxy(ctx, t, "status", "--server", p.AdminURL)
	if err != nil || strings.Contains(out, "corrupt blob") {
		t.Errorf("pullproxy status after the layer verified: %v\n%s\nwant no corrupt blob listed", err, out)
	}
}
