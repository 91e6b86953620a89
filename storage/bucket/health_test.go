package bucket

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pullproxy/pullproxy/storage"
)

// hangable is a replica's network to the bucket, which a test can make
// hang: requests are sent nowhere and never answered, as a stopped
// server's accepted connections are not.
type hangable struct {
	hang     atomic.Bool
	requests atomic.Int64 // made while hanging, besides probes (listings)
}

func (h *hangable) RoundTrip(r *http.Request) (*http.Response, error) {
	if h.hang.Load() {
		if !r.URL.Query().Has("list-type") {
			h.requests.Add(1)
		}
		<-r.Context().Done()
		return nil, r.Context().Err()
	}
	return http.DefaultTransport.RoundTrip(r)
}

// A bucket that stops answering: the first call a client waits on ends
// at its short deadline and marks the bucket degraded; calls then fail at
// once as not found (no request made), the local store answers, a blob
// is fetched from the upstream alone; once the bucket answers again, the
// probe clears the state.
func TestHangingBucketDegrades(t *testing.T) {
	srv, bucket := testMinio(t)
	net := &hangable{}
	reg := prometheus.NewRegistry()
	r := newReplica(t, srv, "a", Config{Bucket: bucket}, withHTTPClient(&http.Client{Transport: net}),
		WithMetrics(reg), withProbe(50*time.Millisecond), productionDeadlines())
	s := NewStore(r.store, r.b)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	local := storage.TagRecord{Digest: digest.FromString("local"), MediaType: "application/vnd.oci.image.manifest.v1+json"}
	if err := r.store.PutTag(ctx, "docker.io", "library/app", "v1", local); err != nil {
		t.Fatal(err)
	}

	net.hang.Store(true)
	began := time.Now()
	rec, err := s.Tag(ctx, "docker.io", "library/app", "v1")
	if err != nil || rec.Digest != local.Digest {
		t.Fatalf("tag with the bucket hanging: %+v, %v; want the local store's %s", rec, err, local.Digest)
	}
	t.Logf("first call with the bucket hanging answered in %v", time.Since(began).Round(time.Millisecond))
	h := r.b.Health()
	if !h.Degraded || h.Transitions != 1 || h.LastError == "" {
		t.Fatalf("health after a timeout: %+v; want degraded once, with the error", h)
	}
	if got := testutil.ToFloat64(r.b.metrics.requests.WithLabelValues("get_tag", "timeout")); got != 1 {
		t.Errorf("get_tag timeouts counted: %v, want 1", got)
	}
	if got := testutil.ToFloat64(r.b.metrics.degraded); got != 1 {
		t.Errorf("pullproxy_bucket_degraded: %v, want 1", got)
	}

	// Degraded: nothing is asked of the bucket.
	made := net.requests.Load()
	if _, err := r.b.StatBlob(ctx, digest.FromString("x")); !errors.Is(err, ErrDegraded) || !errors.Is(err, storage.ErrNotFound) {
		t.Errorf("StatBlob while degraded: %v, want ErrDegraded, a not found", err)
	}
	if known, err := s.IsMember(ctx, "docker.io", "library/app", digest.FromString("x")); known || err != nil {
		t.Errorf("IsMember while degraded: %v, %v; want false, nil (the upstream is asked)", known, err)
	}
	if err := s.PutTag(ctx, "docker.io", "library/app", "v2", local); err != nil {
		t.Errorf("PutTag while degraded: %v, want the local store's nil", err)
	}
	blob, d := randomBlob(2*minPartSize, 21)
	up := &testUpstream{blob: blob}
	src, err := fetchAndCommit(ctx, r, d, int64(len(blob)), up)
	if err != nil || src != SourceUpstream || up.sent.Load() != int64(len(blob)) {
		t.Fatalf("fetch while degraded: %s, %v, %d bytes from the upstream; want upstream, nil, %d", src, err, up.sent.Load(), len(blob))
	}
	if !bytes.Equal(storedBlob(t, r, d), blob) {
		t.Fatal("stored other bytes than the blob's")
	}
	if n := net.requests.Load() - made; n != 0 {
		t.Errorf("%d requests sent to the degraded bucket besides probes, want none", n)
	}

	net.hang.Store(false)
	waitFor(t, "the probe to clear the degraded state", func() bool { return !r.b.Degraded() })
	if got := testutil.ToFloat64(r.b.metrics.degraded); got != 0 {
		t.Errorf("pullproxy_bucket_degraded after the probe answered: %v, want 0", got)
	}
	if got := testutil.ToFloat64(r.b.metrics.degradedTotal); got != 1 {
		t.Errorf("pullproxy_bucket_degraded_total: %v, want 1", got)
	}
	if _, err := r.b.StatBlob(ctx, digest.FromString("x")); !errors.Is(err, storage.ErrNotFound) || errors.Is(err, ErrDegraded) {
		t.Errorf("StatBlob once the bucket answers: %v, want its not found", err)
	}
}

// Background writes wait in a bounded queue: past it, and while the bucket
// is degraded, they are dropped and counted, and queuing never blocks.
func TestBackgroundWritesBounded(t *testing.T) {
	srv, bucket := testMinio(t)
	r := newReplica(t, srv, "a", Config{Bucket: bucket}, WithMetrics(prometheus.NewRegistry()))
	release := make(chan struct{})
	var ran, dropped atomic.Int64
	const n = 200
	for range n {
		r.b.background("test", func(ctx context.Context) error {
			<-release
			ran.Add(1)
			return nil
		}, func() { dropped.Add(1) })
	}
	// The writers hold at most one each; the queue holds writeQueue.
	if got := dropped.Load(); got < n-writeQueue-writers || got > n-writeQueue {
		t.Errorf("dropped %d of %d writes, want %d to %d", got, n, n-writeQueue-writers, n-writeQueue)
	}
	if got := testutil.ToFloat64(r.b.metrics.dropped.WithLabelValues("queue_full")); got != float64(dropped.Load()) {
		t.Errorf("queue_full drops counted: %v, want %d", got, dropped.Load())
	}
	close(release)
	waitFor(t, "the queued writes to run", func() bool { return ran.Load()+dropped.Load() == n })

	r.b.health.fail(errors.New("test"))
	r.b.background("test", func(context.Context) error { ran.Add(1); return nil }, func() { dropped.Add(1) })
	if got := testutil.ToFloat64(r.b.metrics.dropped.WithLabelValues("degraded")); got != 1 {
		t.Errorf("degraded drops counted: %v, want 1", got)
	}
}

// stalling is a replica's network to the bucket on which, once stall is
// set, every answer's body stops after its first after bytes and brings
// nothing more, as a store stopped mid-answer does.
type stalling struct {
	stall atomic.Bool
	after int64
}

func (s *stalling) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err == nil && s.stall.Load() {
		resp.Body = &stalledBody{ReadCloser: resp.Body, left: s.after, ctx: r.Context()}
	}
	return resp, err
}

type stalledBody struct {
	io.ReadCloser
	left int64
	ctx  context.Context
}

func (b *stalledBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		<-b.ctx.Done()
		return 0, b.ctx.Err()
	}
	n, err := b.ReadCloser.Read(p[:min(int64(len(p)), b.left)])
	b.left -= int64(n)
	return n, err
}

// A blob the bucket holds stops coming mid-body: the read is abandoned
// after readStall, the bucket marked degraded, and the upstream brings
// the rest; the bytes already read are kept.
func TestBlobReadStallFetchesAlone(t *testing.T) {
	srv, bucket := testMinio(t)
	a := newReplica(t, srv, "a", Config{Bucket: bucket})
	blob, d := randomBlob(3*minPartSize, 41)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if src, err := fetchAndCommit(ctx, a, d, int64(len(blob)), &testUpstream{blob: blob}); err != nil || src != SourceUpstream {
		t.Fatalf("sharing the blob: %s, %v", src, err)
	}
	if !bytes.Equal(bucketBlob(t, a, d), blob) {
		t.Fatal("the bucket holds other bytes than the blob's")
	}

	net := &stalling{after: 2 << 20}
	net.stall.Store(true)
	reg := prometheus.NewRegistry()
	b := newReplica(t, srv, "b", Config{Bucket: bucket}, withHTTPClient(&http.Client{Transport: net}),
		WithMetrics(reg), withProbe(time.Minute), productionDeadlines())
	up := &testUpstream{blob: blob}
	began := time.Now()
	src, err := fetchAndCommit(ctx, b, d, int64(len(blob)), up)
	if err != nil || src != SourceUpstream {
		t.Fatalf("fetch with the bucket's answer stalled: %s, %v; want upstream, nil", src, err)
	}
	t.Logf("fetched with the bucket's answer stalled after %d bytes in %v, %d bytes from the upstream",
		net.after, time.Since(began).Round(time.Millisecond), up.sent.Load())
	if !bytes.Equal(storedBlob(t, b, d), blob) {
		t.Fatal("stored other bytes than the blob's")
	}
	if got, most := up.sent.Load(), int64(len(blob))-net.after; got > most {
		t.Errorf("%d bytes from the upstream, want at most %d: the bytes read from the bucket are kept", got, most)
	}
	if h := b.b.Health(); !h.Degraded || h.Transitions != 1 {
		t.Errorf("health after a stalled read: %+v; want degraded once", h)
	}
	if got := testutil.ToFloat64(b.b.metrics.requests.WithLabelValues("get_blob", "timeout")); got != 1 {
		t.Errorf("get_blob timeouts counted: %v, want 1", got)
	}
}
