package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/miniotest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// startReplica runs a pullproxy replica sharing bucket on srv, with a
// data dir of its own.
func startReplica(t *testing.T, srv *miniotest.Server, config string) *proxyProcess {
	t.Helper()
	env := []string{"AWS_ACCESS_KEY_ID=" + miniotest.AccessKey, "AWS_SECRET_ACCESS_KEY=" + miniotest.SecretKey,
		"AWS_EC2_METADATA_DISABLED=true", "AWS_CONFIG_FILE=/dev/null", "AWS_SHARED_CREDENTIALS_FILE=/dev/null"}
	return startProxyEnv(t, env, "--config", config, "--data-dir", filepath.Join(t.TempDir(), "data"))
}

// leaseOf reads a blob's lease in the bucket, or returns ok false.
func leaseOf(t *testing.T, srv *miniotest.Server, bucket string, d digest.Digest) (l bucketLease, ok bool) {
	out, err := srv.Client().GetObject(t.Context(), &s3.GetObjectInput{Bucket: aws.String(bucket),
		Key: aws.String("site1/uploads/sha256/" + d.Encoded() + "/lease")})
	if err != nil {
		return l, false
	}
	defer out.Body.Close()
	return l, json.NewDecoder(out.Body).Decode(&l) == nil
}

// bucketRequests sums a replica's pullproxy_bucket_requests_total by
// operation, as "op=n ..." with the total first.
func bucketRequests(t *testing.T, proxyURL string) string {
	t.Helper()
	resp, err := http.Get(proxyURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	re := regexp.MustCompile(`(?m)^pullproxy_bucket_requests_total\{op="([a-z_]+)",result="[a-z_]+"\} (\d+)$`)
	byOp, total := map[string]int{}, 0
	for _, m := range re.FindAllStringSubmatch(string(body), -1) {
		n, _ := strconv.Atoi(m[2])
		byOp[m[1]] += n
		total += n
	}
	out := fmt.Sprintf("total=%d", total)
	for _, op := range slices.Sorted(maps.Keys(byOp)) {
		out += fmt.Sprintf(" %s=%d", op, byOp[op])
	}
	return out
}

// waitInBucket waits until the bucket holds blob desc whole.
func waitInBucket(t *testing.T, srv *miniotest.Server, bucket string, desc registrytest.Descriptor) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		out, err := srv.Client().HeadObject(t.Context(), &s3.HeadObjectInput{Bucket: aws.String(bucket),
			Key: aws.String("site1/blobs/sha256/" + desc.Digest.Encoded())})
		if err == nil && aws.ToInt64(out.ContentLength) == desc.Size {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is not in the bucket whole after 30 s: %v", desc.Digest, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// bucketLease is what the tests read of a lease.
type bucketLease struct {
	Holder   string `json:"holder"`
	Uploaded string `json:"uploaded"` // '1' for each part uploaded
}

func (l bucketLease) parts() int { return strings.Count(l.Uploaded, "1") }

// getBlobChecked GETs a blob and checks its digest.
func getBlobChecked(url string, d digest.Digest) error {
	return getBlobWithin(context.Background(), url, d)
}

// TestReplicasShareABucket: two replicas share a MinIO bucket, their
// upstream behind the incident's carrier.
//
//   - containerd pulls an image through replica A, then another
//     containerd through replica B: the image's bytes cross the carrier
//     once, and B asks the upstream for no blob.
//   - Both replicas are asked for the same cold layer at once: at most
//     1.1x its bytes cross.
//   - Replica A is killed (SIGKILL) while it holds a layer's lease with
//     parts uploaded and B waits on it: B takes the lease over once it
//     expires, finishes the layer from the parts uploaded, and serves it.
func TestReplicasShareABucket(t *testing.T) {
	ok, why := containerdtest.Available()
	requireTool(t, ok, why)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	const bucket = "pullproxy"
	srv := miniotest.ForTest(t, bucket)
	up := &upstreamLog{n: map[string]int{}}
	reg := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { up.next = h; return up }))
	path, err := carrier.Start(carrier.Config{Target: reg.Host(), CutProb: 0.6, CutMin: 1_300_000, CutMax: 3_100_000,
		Mode: carrier.Reset, Bandwidth: 16e6, Seed: 42})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { path.Close() })
	const host = "reg.test" // pullThrough names it
	configText := fmt.Sprintf(`
storage:
  type: s3
  bucket: %s
  endpoint: %s
  path_style: true
  prefix: site1
  part_size: 5MiB
  lease_ttl: 2s
fetch:
  # A few connections: with many, on a path this slow, every chunk of the
  # blob is in flight at once, and parts are whole (and uploaded) only near
  # its end, when the kill would come too late to leave work to take over.
  max_connections: 4
upstreams:
  - name: %s
    endpoints:
      - url: %s
`, bucket, srv.Endpoint, host, path.URL())
	config := writeConfig(t, configText)
	a, b := startReplica(t, srv, config), startReplica(t, srv, config)

	// Through A, then through B.
	img, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v1", Seed: 11, LayerSizes: []int64{21 << 20, 9 << 20, 300 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	imageBytes := img.Config.Size
	for _, l := range img.Layers {
		imageBytes += l.Size
	}
	up.take()
	for i, replica := range []*proxyProcess{a, b} {
		d, err := containerdtest.Start(ctx, t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Stop() })
		hosts, err := d.WriteHostsDir(host, replica.URL)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := d.ContentFetch(ctx, hosts, host+"/team/app:v1"); err != nil {
			t.Fatalf("pull through replica %c: %v\n%s", 'A'+i, err, out)
		}
		have, err := d.ContentDigests(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, desc := range append([]registrytest.Descriptor{img.Manifest, img.Config}, img.Layers...) {
			if !slices.Contains(have, desc.Digest.String()) {
				t.Errorf("pull through replica %c: containerd lacks %s", 'A'+i, desc.Digest)
			}
		}
		got := up.take()
		t.Logf("pull through replica %c: upstream %v", 'A'+i, got)
		// A's uploads finish after its clients have the blobs.
		for _, desc := range append([]registrytest.Descriptor{img.Config}, img.Layers...) {
			waitInBucket(t, srv, bucket, desc)
		}
		t.Logf("pull through replica %c: bucket requests %s; bytes read %v, written %v", 'A'+i,
			bucketRequests(t, replica.URL), metric(t, replica.URL, "pullproxy_bucket_read_bytes_total"),
			metric(t, replica.URL, "pullproxy_bucket_written_bytes_total"))
		switch {
		case i == 0 && float64(got["GET blobs bytes"]) > 1.1*float64(imageBytes):
			t.Errorf("pull through A: %d upstream blob bytes, want at most 1.1x the image's %d", got["GET blobs bytes"], imageBytes)
		case i == 1 && (got["GET blobs"] != 0 || got["HEAD blobs"] != 0):
			t.Errorf("pull through B: %d blob GETs and %d HEADs upstream, want none", got["GET blobs"], got["HEAD blobs"])
		}
		d.Stop()
	}

	// The same cold layer through both at once.
	img2, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v2", Seed: 12, LayerSizes: []int64{40 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	layer := img2.Layers[0]
	pullThrough(t, a.URL, "team/app", registrytest.Pushed{Manifest: img2.Manifest, Config: img2.Config}, "v2") // the manifest, shared
	up.take()
	var wg sync.WaitGroup
	for _, replica := range []*proxyProcess{a, b} {
		wg.Go(func() {
			if err := getBlobChecked(replica.URL+"/v2/team/app/blobs/"+layer.Digest.String()+"?ns="+host, layer.Digest); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	got := up.take()
	ratio := float64(got["GET blobs bytes"]) / float64(layer.Size)
	t.Logf("one cold %d-byte layer through both replicas at once: %d bytes upstream (%.3fx)", layer.Size, got["GET blobs bytes"], ratio)
	if ratio > 1.1 {
		t.Errorf("one cold layer through both at once: %.3fx its bytes upstream, want at most 1.1x", ratio)
	}

	// A killed while holding a lease.
	img3, err := reg.Push(ctx, registrytest.Image{Repo: "team/app", Tag: "v3", Seed: 13, LayerSizes: []int64{64 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	layer = img3.Layers[0]
	url := "/v2/team/app/blobs/" + layer.Digest.String() + "?ns=" + host
	pullThrough(t, a.URL, "team/app", registrytest.Pushed{Manifest: img3.Manifest, Config: img3.Config}, "v3")
	up.take()
	phaseStart := path.Stats().BytesDown
	resp, err := http.Get(a.URL + url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	go io.Copy(io.Discard, resp.Body)
	for deadline := time.Now().Add(time.Minute); ; {
		if l, ok := leaseOf(t, srv, bucket, layer.Digest); ok && l.Holder != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("replica A took no lease within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	bDone := make(chan error, 1)
	go func() { bDone <- getBlobChecked(b.URL+url, layer.Digest) }() // B follows A's parts
	var atKill bucketLease
	for deadline := time.Now().Add(time.Minute); ; {
		if l, ok := leaseOf(t, srv, bucket, layer.Digest); ok && l.parts() >= 3 {
			a.kill()
			atKill = l
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("replica A did not upload three parts within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	beforeKill := path.Stats().BytesDown - phaseStart
	select {
	case err := <-bDone:
		if err != nil {
			t.Fatalf("replica B, after A was killed: %v", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("replica B wedged after A was killed holding the lease")
	}
	afterKill := path.Stats().BytesDown - phaseStart - beforeKill
	t.Logf("layer of %d bytes: %d bytes crossed the carrier before A was killed with %d parts uploaded, %d after (%.3fx in all)",
		layer.Size, beforeKill, atKill.parts(), afterKill, float64(beforeKill+afterKill)/float64(layer.Size))
	if rest := layer.Size - int64(atKill.parts())*5<<20; float64(afterKill) > 1.05*float64(rest) {
		t.Errorf("B fetched %d bytes upstream, more than 1.05x the %d not in the %d parts A uploaded", afterKill, rest, atKill.parts())
	}
	if !b.loggedWithin("took over a blob download from another replica", 5*time.Second) {
		t.Error("B did not log taking the download over")
	}
	waitInBucket(t, srv, bucket, layer) // B assembles it once its clients have it
	up.take()
	// A, restarted, serves it from the bucket.
	a2 := startReplica(t, srv, config)
	if err := getBlobChecked(a2.URL+url, layer.Digest); err != nil {
		t.Fatal(err)
	}
	if got := up.take(); got["GET blobs"] != 0 {
		t.Errorf("a new replica asked the upstream for the layer the bucket holds: %v", got)
	}
	if !a2.loggedWithin("source=bucket", 5*time.Second) {
		t.Error("the new replica did not log reading the layer from the bucket")
	}

	// serve: redirect sends clients to the bucket with a presigned URL.
	redirecting := startReplica(t, srv, writeConfig(t, strings.Replace(configText, "  lease_ttl: 2s\n", "  lease_ttl: 2s\n  serve: redirect\n", 1)))
	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err = noFollow.Get(redirecting.URL + url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if loc := resp.Header.Get("Location"); resp.StatusCode != http.StatusTemporaryRedirect || !strings.HasPrefix(loc, srv.Endpoint+"/pullproxy/site1/blobs/") {
		t.Fatalf("serve: redirect: %s to %q, want 307 to the bucket", resp.Status, loc)
	}
	if err := getBlobChecked(redirecting.URL+url, layer.Digest); err != nil { // followed
		t.Fatal(err)
	}
	if got := up.take(); got["GET blobs"] != 0 {
		t.Errorf("redirecting replica asked the upstream: %v", got)
	}
}
