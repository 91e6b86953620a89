package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/internal/miniotest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// frozenBucketReplica runs MinIO and a replica sharing its bucket, in
// front of a registry holding two images: held, pulled through the replica
// before the test goes on, and lacked, never pulled.
func frozenBucketReplica(t *testing.T, ctx context.Context) (srv *miniotest.Server, p *proxyProcess, held, lacked registrytest.Pushed) {
	t.Helper()
	const bucket = "pullproxy"
	srv = miniotest.ForTest(t, bucket)
	reg := startRegistry(t)
	var err error
	if held, err = reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v1", Seed: 31, LayerSizes: []int64{3 << 20, 200 << 10}}); err != nil {
		t.Fatal(err)
	}
	if lacked, err = reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v2", Seed: 32, LayerSizes: []int64{6 << 20, 300 << 10}}); err != nil {
		t.Fatal(err)
	}
	config := writeConfig(t, frozenBucketConfig(bucket, srv.Endpoint, reg.URL()))
	p = startReplica(t, srv, config)
	if err := pullWithin(ctx, p.URL, "team/app", held, "v1"); err != nil {
		t.Fatalf("pulling the image to hold, with the bucket up: %v", err)
	}
	return srv, p, held, lacked
}

// freeze stops MinIO's process (SIGSTOP) until the test ends.
func freeze(t *testing.T, srv *miniotest.Server) {
	t.Helper()
	if err := srv.Freeze(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Thaw() })
}

// pullWithin pulls repo:tag through proxyURL as a client does, the
// manifest by tag then each blob, checking every digest, all bound by ctx.
func pullWithin(ctx context.Context, proxyURL, repo string, img registrytest.Pushed, tag string) error {
	base := proxyURL + "/v2/" + repo
	get := func(url, accept string) ([]byte, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"?ns=reg.test", nil)
		if err != nil {
			return nil, err
		}
		if accept != "" {
			req.Header.Set("Accept", accept)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		return body, err
	}
	body, err := get(base+"/manifests/"+tag, img.Manifest.MediaType)
	if err != nil {
		return err
	}
	if got := digest.FromBytes(body); got != img.Manifest.Digest {
		return fmt.Errorf("%s:%s manifest: got %s, want %s", repo, tag, got, img.Manifest.Digest)
	}
	for _, d := range append([]registrytest.Descriptor{img.Config}, img.Layers...) {
		body, err := get(base+"/blobs/"+d.Digest.String(), "")
		if err != nil {
			return err
		}
		if got := digest.FromBytes(body); got != d.Digest {
			return fmt.Errorf("%s:%s blob %s: got %s", repo, tag, d.Digest, got)
		}
	}
	return nil
}

// TestReplicasFrozenBucket: the object store's process is stopped
// (SIGSTOP: connections accepted, never answered). The replica serves an
// image it holds from its local store, and one it lacks from the
// upstream, each well within a minute; /readyz stays 200.
func TestReplicasFrozenBucket(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	srv, p, held, lacked := frozenBucketReplica(t, ctx)
	freeze(t, srv)

	for _, c := range []struct {
		what string
		img  registrytest.Pushed
		tag  string
	}{{"an image it holds", held, "v1"}, {"an image it lacks", lacked, "v2"}} {
		pctx, cancel := context.WithTimeout(ctx, time.Minute)
		began := time.Now()
		err := pullWithin(pctx, p.URL, "team/app", c.img, c.tag)
		cancel()
		if err != nil {
			t.Fatalf("with the bucket frozen, pulling %s: %v (after %.1f s)", c.what, err, time.Since(began).Seconds())
		}
		t.Logf("with the bucket frozen, pulled %s in %.2f s", c.what, time.Since(began).Seconds())
	}
	resp, err := http.Get(p.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz with the bucket frozen: %s, want 200", resp.Status)
	}
}

// TestBucketHangingDegrades: with the object store frozen, the replica
// marks the bucket degraded (metric, /debug/bucket, status) while /readyz
// stays 200; once the store is thawed, the background probe clears it.
func TestBucketHangingDegrades(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	srv, p, held, _ := frozenBucketReplica(t, ctx)
	if got := metric(t, p.URL, "pullproxy_bucket_degraded"); got != 0 {
		t.Fatalf("pullproxy_bucket_degraded with the bucket up: %v, want 0", got)
	}
	freeze(t, srv)
	pctx, pcancel := context.WithTimeout(ctx, time.Minute)
	err := pullWithin(pctx, p.URL, "team/app", held, "v1")
	pcancel()
	if err != nil {
		t.Fatalf("pulling a held image with the bucket frozen: %v", err)
	}
	if got := metric(t, p.URL, "pullproxy_bucket_degraded"); got != 1 {
		t.Errorf("pullproxy_bucket_degraded with the bucket frozen: %v, want 1", got)
	}
	if got := metric(t, p.URL, "pullproxy_bucket_degraded_total"); got != 1 {
		t.Errorf("pullproxy_bucket_degraded_total: %v, want 1", got)
	}
	if st := debugBucket(t, p); !st.Shared || !st.Degraded || st.LastError == "" {
		t.Errorf("/debug/bucket with the bucket frozen: %+v, want shared, degraded, with the error", st)
	}
	out, err := runPullproxy(ctx, t, "status", "--server", p.AdminURL)
	if err != nil || !strings.Contains(out, "shared bucket: degraded since") {
		t.Errorf("status with the bucket frozen: %v\n%s\nwant the bucket shown degraded", err, out)
	}
	resp, err := http.Get(p.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz with the bucket degraded: %s, want 200", resp.Status)
	}

	if err := srv.Thaw(); err != nil {
		t.Fatal(err)
	}
	// The probe's waits grow to 30 s at most.
	for deadline := time.Now().Add(90 * time.Second); metric(t, p.URL, "pullproxy_bucket_degraded") != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("the bucket is still degraded 90 s after MinIO was thawed: %+v", debugBucket(t, p))
		}
		time.Sleep(200 * time.Millisecond)
	}
	if st := debugBucket(t, p); st.Degraded || st.Transitions != 1 {
		t.Errorf("/debug/bucket once the probe found MinIO answering: %+v, want not degraded, degraded once", st)
	}
	out, err = runPullproxy(ctx, t, "status", "--server", p.AdminURL)
	if err != nil || !strings.Contains(out, "shared bucket: answering") {
		t.Errorf("status once thawed: %v\n%s\nwant the bucket shown answering", err, out)
	}
}

// debugBucket reads the replica's /debug/bucket.
func debugBucket(t *testing.T, p *proxyProcess) admin.BucketStatus {
	t.Helper()
	client, base := http.DefaultClient, p.AdminURL
	if socket, ok := strings.CutPrefix(p.AdminURL, "unix:"); ok {
		client, base = socketClient(socket), "http://pullproxy-admin"
	}
	resp, err := client.Get(base + "/debug/bucket")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st admin.BucketStatus
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatalf("/debug/bucket: %s: %v", resp.Status, err)
	}
	return st
}

// TestFetchAloneWhileBucketHangs: replica A is fetching a large layer
// from a slow upstream, holding its lease, with parts uploaded, when the
// object store is frozen (SIGSTOP). A's client still gets the whole layer
// (A's part uploads and lease renewals hang, its download does not), and
// replica B, asked for the same image, fetches it alone from the upstream
// rather than waiting on the bucket or A's lease: each within a minute.
func TestFetchAloneWhileBucketHangs(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	const bucket = "pullproxy"
	srv := miniotest.ForTest(t, bucket)
	reg := startRegistry(t)
	// Slow enough that A is mid-layer, parts uploaded, when MinIO stops.
	path, err := carrier.Start(carrier.Config{Target: reg.Host(), Bandwidth: 8e6, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { path.Close() })
	img, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v1", Seed: 51, LayerSizes: []int64{40 << 20, 100 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	config := writeConfig(t, frozenBucketConfig(bucket, srv.Endpoint, path.URL()))
	a, b := startReplica(t, srv, config), startReplica(t, srv, config)
	pullThrough(t, a.URL, "team/app", registrytest.Pushed{Manifest: img.Manifest, Config: img.Config}, "v1")

	layer := img.Layers[0]
	aDone := make(chan error, 1)
	aCtx, aCancel := context.WithCancel(ctx)
	defer aCancel()
	go func() {
		aDone <- getBlobWithin(aCtx, a.URL+"/v2/team/app/blobs/"+layer.Digest.String()+"?ns=reg.test", layer.Digest)
	}()
	for deadline := time.Now().Add(time.Minute); ; {
		if l, ok := leaseOf(t, srv, bucket, layer.Digest); ok && l.Holder != "" && l.parts() >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("replica A uploaded no part of the layer within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	freeze(t, srv)
	frozen := time.Now()

	bCtx, bCancel := context.WithTimeout(ctx, time.Minute)
	err = pullWithin(bCtx, b.URL, "team/app", img, "v1")
	bCancel()
	if err != nil {
		t.Fatalf("replica B, with the bucket frozen while A holds the layer's lease: %v (after %.1f s)", err, time.Since(frozen).Seconds())
	}
	t.Logf("with the bucket frozen, replica B pulled the image in %.2f s", time.Since(frozen).Seconds())
	select {
	case err := <-aDone:
		if err != nil {
			t.Fatalf("replica A's client, with the bucket frozen mid-layer: %v", err)
		}
	case <-time.After(time.Minute - time.Since(frozen)):
		t.Fatal("replica A's client did not get the layer within a minute of the bucket freezing")
	}
	t.Logf("with the bucket frozen mid-layer, replica A's client had the layer %.2f s after the freeze", time.Since(frozen).Seconds())
}

// getBlobWithin GETs a blob, bound by ctx, and checks its digest.
func getBlobWithin(ctx context.Context, url string, d digest.Digest) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", d, resp.Status)
	}
	h := sha256.New()
	if _, err := io.Copy(h, resp.Body); err != nil {
		return fmt.Errorf("GET %s: %w", d, err)
	}
	if got := digest.NewDigest(digest.SHA256, h); got != d {
		return fmt.Errorf("GET %s: got %s", d, got)
	}
	return nil
}

// frozenBucketConfig is the config of a replica sharing bucket at endpoint,
// its upstream reg.test at upstreamURL.
func frozenBucketConfig(bucket, endpoint, upstreamURL string) string {
	return fmt.Sprintf(`
storage:
  type: s3
  bucket: %s
  endpoint: %s
  path_style: true
  prefix: site1
  part_size: 5MiB
upstreams:
  - name: reg.test
    endpoints:
      - url: %s
`, bucket, endpoint, upstreamURL)
}
