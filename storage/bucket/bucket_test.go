package bucket

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/miniotest"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/content"
)

// testMinio starts MinIO with a fresh bucket.
func testMinio(t *testing.T) (*miniotest.Server, string) {
	return miniotest.ForTest(t, "layers"), "layers"
}

// testReplica is one replica's bucket handle and local store.
type testReplica struct {
	b     *Bucket
	store *storage.Store
}

// productionDeadlines are the deadlines a replica runs with, for the tests
// of what they do.
func productionDeadlines() Option { return withDeadlines(clientTimeout, readStall) }

func newReplica(t *testing.T, srv *miniotest.Server, name string, cfg Config, opts ...Option) testReplica {
	t.Helper()
	cfg.Endpoint, cfg.PathStyle = srv.Endpoint, true
	if cfg.PartSize == 0 {
		cfg.PartSize = minPartSize
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("replica", name)
	}
	// Deadlines for a bucket sharing a loaded test machine with everything
	// else: a test of the production ones passes them (productionDeadlines).
	opts = append([]Option{WithCredentials(srv.Credentials()), WithReplicaID(name), WithLogger(log), withPoll(20 * time.Millisecond),
		withDeadlines(30*time.Second, 30*time.Second)}, opts...)
	b, err := Open(t.Context(), cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	st, err := storage.Open(t.Context(), t.TempDir(), storage.WithLogger(log))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return testReplica{b: b, store: st}
}

// testUpstream serves a blob to a download, counting what it sends.
type testUpstream struct {
	blob  []byte
	sent  atomic.Int64
	delay time.Duration // per MiB
	// stopAt, when set, makes the fetch stop (blocking until its context
	// ends) once the download has this many bytes: a replica dying.
	stopAt int64
}

func (u *testUpstream) fetch(dl content.Download) func(context.Context) error {
	return func(ctx context.Context) error {
		size := int64(len(u.blob))
		if dl.Size() < 0 {
			if err := dl.SetSize(size); err != nil {
				return err
			}
		}
		for off := int64(0); off < size; {
			start, end := dl.Missing(off)
			if start == end {
				break
			}
			end = min(end, start+1<<20)
			if u.stopAt > 0 && start >= u.stopAt {
				<-ctx.Done()
				return ctx.Err()
			}
			if u.delay > 0 {
				select {
				case <-time.After(u.delay):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			if _, err := dl.WriteAt(u.blob[start:end], start); err != nil {
				return err
			}
			u.sent.Add(end - start)
			off = end
		}
		return nil
	}
}

func randomBlob(n int, seed uint64) ([]byte, digest.Digest) {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b, digest.FromBytes(b)
}

func noConfirm(context.Context) error { return nil }

// fetchAndCommit runs a replica's download of d through the bucket, as the
// proxy does: Fetch, Commit, Finish.
func fetchAndCommit(ctx context.Context, r testReplica, d digest.Digest, size int64, up *testUpstream) (Source, error) {
	p, err := r.store.NewPartial(ctx, d, size)
	if err != nil {
		return "", err
	}
	f, err := r.b.Fetch(ctx, p, noConfirm, up.fetch(p))
	if err != nil {
		p.Abandon(err)
		return "", err
	}
	err = p.Commit(ctx)
	f.Finish(ctx, err)
	return f.Source, err
}

func storedBlob(t *testing.T, r testReplica, d digest.Digest) []byte {
	t.Helper()
	f, _, err := r.store.OpenBlob(t.Context(), d)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func bucketObjects(t *testing.T, srv *miniotest.Server, bucket, prefix string) []string {
	t.Helper()
	out, err := srv.Client().ListObjectsV2(t.Context(), &s3.ListObjectsV2Input{Bucket: &bucket, Prefix: &prefix})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, o := range out.Contents {
		keys = append(keys, aws.ToString(o.Key))
	}
	return keys
}

func TestLeaseTakenOnce(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket}
	const replicas = 6
	rs := make([]testReplica, replicas)
	for i := range rs {
		rs[i] = newReplica(t, srv, "r"+string(rune('a'+i)), cfg)
	}
	_, d := randomBlob(10, 1)
	var won atomic.Int32
	var wg sync.WaitGroup
	for _, r := range rs {
		wg.Go(func() {
			h, err := r.b.take(t.Context(), r.b.blobLease(d), lease{Size: 10, PartSize: minPartSize}, "")
			switch {
			case err == nil:
				won.Add(1)
				h.stop()
			case !errors.Is(err, errPrecondition):
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if won.Load() != 1 {
		t.Fatalf("%d replicas took the lease at once, want 1", won.Load())
	}
	// The holder's renewals go through; a write over a stale ETag does not.
	cur, err := rs[0].b.readLease(t.Context(), rs[0].b.blobLease(d))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rs[0].b.writeLease(t.Context(), rs[0].b.blobLease(d), cur.lease, `"stale"`); !errors.Is(err, errPrecondition) {
		t.Fatalf("write over a stale ETag: got %v, want a precondition failure", err)
	}
}

// Two replicas asked for the same cold blob at once: one fetches it from
// the upstream, the other reads its parts as they land; a third, later,
// reads it whole from the bucket. The upstream sends it once.
func TestFetchSharedOnce(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket}
	a, b, c := newReplica(t, srv, "a", cfg), newReplica(t, srv, "b", cfg), newReplica(t, srv, "c", cfg)
	blob, d := randomBlob(23<<20+12345, 2) // 5 parts, the last short
	up := &testUpstream{blob: blob, delay: 10 * time.Millisecond}
	size := int64(len(blob))

	sources := make([]Source, 2)
	var wg sync.WaitGroup
	for i, r := range []testReplica{a, b} {
		wg.Go(func() {
			src, err := fetchAndCommit(t.Context(), r, d, size, up)
			if err != nil {
				t.Error(err)
			}
			sources[i] = src
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	if got := up.sent.Load(); got != size {
		t.Errorf("upstream sent %d bytes for two replicas at once, want %d (%.2fx)", got, size, float64(got)/float64(size))
	}
	slicesSorted := []string{string(sources[0]), string(sources[1])}
	if !(strings.Contains(strings.Join(slicesSorted, ","), "upstream") && strings.Contains(strings.Join(slicesSorted, ","), "followed")) {
		t.Errorf("sources %v: want one upstream and one followed", sources)
	}
	for _, r := range []testReplica{a, b} {
		if !bytes.Equal(storedBlob(t, r, d), blob) {
			t.Fatal("a replica stored other bytes than the blob's")
		}
	}

	src, err := fetchAndCommit(t.Context(), c, d, size, up)
	if err != nil {
		t.Fatal(err)
	}
	if src != SourceBucket || up.sent.Load() != size {
		t.Errorf("third replica: source %s, upstream sent %d in all; want bucket and %d", src, up.sent.Load(), size)
	}
	if left := bucketObjects(t, srv, bucket, "uploads/"); len(left) > 0 {
		t.Errorf("uploads left in the bucket after the blob was assembled: %v", left)
	}
	if n, err := c.b.StatBlob(t.Context(), d); err != nil || n != size {
		t.Errorf("blob in the bucket: %d bytes, %v; want %d", n, err, size)
	}
}

// A replica dies holding the lease with some parts uploaded: another,
// waiting on it, takes the download over once the lease expires, reads the
// parts uploaded, fetches only the rest from the upstream, and completes
// the blob in the bucket.
func TestTakeoverResumesFromParts(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket, LeaseTTL: time.Second}
	b := newReplica(t, srv, "b", cfg)
	blob, d := randomBlob(4*minPartSize+4321, 3)
	size := int64(len(blob))
	// Its download gets 2.5 parts in: it uploads 2.
	holderDies(t, srv, cfg, d, blob, 2*minPartSize+minPartSize/2)

	up := &testUpstream{blob: blob}
	src, err := fetchAndCommit(t.Context(), b, d, size, up)
	if err != nil {
		t.Fatal(err)
	}
	if src != SourceUpstream {
		t.Errorf("source %s, want upstream (taken over)", src)
	}
	if want := size - 2*minPartSize; up.sent.Load() != want {
		t.Errorf("the replica that took over fetched %d bytes from the upstream, want %d (all but the two parts uploaded)", up.sent.Load(), want)
	}
	if !bytes.Equal(storedBlob(t, b, d), blob) {
		t.Fatal("stored other bytes than the blob's")
	}
	if digest.FromBytes(bucketBlob(t, b, d)) != d {
		t.Fatal("the blob assembled in the bucket does not match its digest")
	}
}

// holderDies runs a replica that takes d's lease, fetches blob's bytes up
// to stopAt (then hangs), uploads its whole parts, and, once two are up,
// loses its network to the bucket, as a killed process would: it renews
// nothing and writes nothing more. The cleanup ends it.
func holderDies(t *testing.T, srv *miniotest.Server, cfg Config, d digest.Digest, blob []byte, stopAt int64) {
	t.Helper()
	net := &cuttable{}
	a := newReplica(t, srv, "dying", cfg, withHTTPClient(&http.Client{Transport: net}))
	p, err := a.store.NewPartial(t.Context(), d, int64(len(blob)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, kill := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.b.Fetch(ctx, p, noConfirm, (&testUpstream{blob: blob, stopAt: stopAt}).fetch(p))
	}()
	t.Cleanup(func() { kill(); <-done })
	waitFor(t, "the dying replica to upload two parts", func() bool {
		l, err := a.b.readLease(t.Context(), a.b.blobLease(d))
		return err == nil && l.count() >= 2
	})
	net.cut.Store(true)
}

// bucketBlob reads d whole from the bucket.
func bucketBlob(t *testing.T, r testReplica, d digest.Digest) []byte {
	t.Helper()
	o, err := r.b.get(t.Context(), "test", r.b.blobKey(d), 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer o.body.Close()
	b, err := io.ReadAll(o.body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// cuttable is a replica's network to the bucket, which a test can cut.
type cuttable struct{ cut atomic.Bool }

func (c *cuttable) RoundTrip(r *http.Request) (*http.Response, error) {
	if c.cut.Load() {
		return nil, errors.New("network cut by the test")
	}
	return http.DefaultTransport.RoundTrip(r)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A download that fails with its lease held releases it, keeping its
// parts: the next replica takes it at once and goes on from them.
func TestReleasedLeaseResumes(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket, LeaseTTL: time.Minute}
	a, b := newReplica(t, srv, "a", cfg), newReplica(t, srv, "b", cfg)
	blob, d := randomBlob(3*minPartSize+99, 4)
	size := int64(len(blob))
	pa, err := a.store.NewPartial(t.Context(), d, size)
	if err != nil {
		t.Fatal(err)
	}
	failing := &testUpstream{blob: blob, stopAt: 2 * minPartSize}
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		waitFor(t, "two parts uploaded", func() bool {
			l, err := a.b.readLease(t.Context(), a.b.blobLease(d))
			return err == nil && l.count() >= 2
		})
		cancel() // the download fails: the upstream went away
	}()
	if _, err := a.b.Fetch(ctx, pa, noConfirm, failing.fetch(pa)); err == nil {
		t.Fatal("Fetch succeeded with its upstream gone")
	}
	pa.Abandon(errors.New("gone"))
	l, err := b.b.readLease(t.Context(), b.b.blobLease(d))
	if err != nil || l.Holder != "" || l.count() != 2 {
		t.Fatalf("lease after the failure: %+v, %v; want released with 2 parts", l.lease, err)
	}
	start := time.Now()
	up := &testUpstream{blob: blob}
	if _, err := fetchAndCommit(t.Context(), b, d, size, up); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > cfg.LeaseTTL/2 {
		t.Errorf("took %v: waited for the released lease to expire", took)
	}
	if want := size - 2*minPartSize; up.sent.Load() != want {
		t.Errorf("fetched %d bytes from the upstream, want %d", up.sent.Load(), want)
	}
}

// Bytes that fail verification are not shared: the parts go, and the next
// replica fetches the blob afresh.
func TestCorruptUploadRemoved(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket}
	a, b := newReplica(t, srv, "a", cfg), newReplica(t, srv, "b", cfg)
	blob, d := randomBlob(2*minPartSize+7, 5)
	size := int64(len(blob))
	bad := bytes.Clone(blob)
	bad[100] ^= 1
	if _, err := fetchAndCommit(t.Context(), a, d, size, &testUpstream{blob: bad}); !errors.Is(err, storage.ErrDigestMismatch) {
		t.Fatalf("commit of corrupt bytes: got %v, want a digest mismatch", err)
	}
	if left := bucketObjects(t, srv, bucket, ""); len(left) > 0 {
		t.Fatalf("objects left after a corrupt download: %v", left)
	}
	up := &testUpstream{blob: blob}
	if src, err := fetchAndCommit(t.Context(), b, d, size, up); err != nil || src != SourceUpstream || up.sent.Load() != size {
		t.Fatalf("next replica: %s, %v, %d bytes fetched; want upstream, nil, %d", src, err, up.sent.Load(), size)
	}
}

// What a replica writes of manifests, tags and memberships, another reads.
func TestStoreShares(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket}
	ra, rb := newReplica(t, srv, "a", cfg), newReplica(t, srv, "b", cfg)
	a, b := NewStore(ra.store, ra.b), NewStore(rb.store, rb.b)
	ctx := t.Context()
	manifest := []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}`)
	md := digest.FromBytes(manifest)
	const mt = "application/vnd.oci.image.manifest.v1+json"
	if err := a.PutBlob(ctx, md, manifest); err != nil {
		t.Fatal(err)
	}
	if err := a.SetMediaType(ctx, md, mt); err != nil {
		t.Fatal(err)
	}
	got, err := b.ReadBlob(ctx, md, 1<<20)
	if err != nil || !bytes.Equal(got, manifest) {
		t.Fatalf("manifest read by the other replica: %q, %v", got, err)
	}
	if rec, err := b.Blob(ctx, md); err != nil || rec.MediaType != mt {
		t.Fatalf("its media type: %q, %v; want %s", rec.MediaType, err, mt)
	}
	if _, err := b.ReadBlob(ctx, digest.FromString("none"), 1<<20); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("missing manifest: got %v, want not found", err)
	}
	// A manifest damaged in the bucket is not served, and is removed.
	damaged := digest.FromString(`{"schemaVersion":2}`)
	if _, err := ra.b.putBytes(ctx, "test", ra.b.manifestKey(damaged), []byte(`{"schemaVersion":3}`), "", "", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ReadBlob(ctx, damaged, 1<<20); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("damaged manifest: got %v, want not found", err)
	}
	if _, err := ra.b.head(ctx, "test", ra.b.manifestKey(damaged)); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("damaged manifest still in the bucket: %v", err)
	}

	rec := storage.TagRecord{Digest: md, MediaType: mt, Size: int64(len(manifest)), CheckedAt: time.Now().Truncate(time.Second)}
	if err := a.PutTag(ctx, "docker.io", "library/app", "v1", rec); err != nil {
		t.Fatal(err)
	}
	// b has its own older answer: the bucket's wins.
	if err := rb.store.PutTag(ctx, "docker.io", "library/app", "v1", storage.TagRecord{Digest: digest.FromString("old")}); err != nil {
		t.Fatal(err)
	}
	if got, err := b.Tag(ctx, "docker.io", "library/app", "v1"); err != nil || got.Digest != md || !got.CheckedAt.Equal(rec.CheckedAt) {
		t.Fatalf("tag on the other replica: %+v, %v; want %+v", got, err, rec)
	}

	layer := digest.FromString("layer")
	if err := a.AddMembers(ctx, "docker.io", "library/app", layer); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		repo string
		want bool
	}{{"library/app", true}, {"library/other", false}} {
		if got, err := b.IsMember(ctx, "docker.io", c.repo, layer); err != nil || got != c.want {
			t.Errorf("IsMember(%s) on the other replica: %v, %v; want %v", c.repo, got, err, c.want)
		}
	}
}

// The janitor removes uploads nobody touched for StaleUploads, and
// abandoned multipart assemblies, and leaves live ones.
func TestCleanRemovesStaleUploads(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket, LeaseTTL: 500 * time.Millisecond, StaleUploads: 2 * time.Second}
	r := newReplica(t, srv, "a", cfg)
	ctx := t.Context()
	_, old := randomBlob(1, 6)
	_, live := randomBlob(1, 7)
	for _, key := range []string{r.b.leaseKey(old), r.b.partKey(old, 0), r.b.partKey(old, 1)} {
		if _, err := r.b.putBytes(ctx, "test", key, []byte("x"), "", "", nil); err != nil {
			t.Fatal(err)
		}
	}
	key := r.b.blobKey(old)
	if _, err := r.b.client.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: &r.b.name, Key: &key}); err != nil {
		t.Fatal(err)
	}
	// A turn released long ago is no upload: it stays.
	turn, err := r.b.TakeTurn(ctx, testTurn, wantAny)
	if err != nil {
		t.Fatal(err)
	}
	if err := turn.Done(ctx, []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(cfg.StaleUploads + 500*time.Millisecond)
	h, err := r.b.take(ctx, r.b.blobLease(live), lease{Size: 1, PartSize: minPartSize}, "")
	if err != nil {
		t.Fatal(err)
	}
	defer h.stop()
	removed, err := r.b.Clean(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if removed != 4 {
		t.Errorf("removed %d, want 3 objects and 1 multipart upload", removed)
	}
	left := bucketObjects(t, srv, bucket, "uploads/")
	if len(left) != 1 || left[0] != r.b.leaseKey(live) {
		t.Errorf("left %v, want only the live lease", left)
	}
	if turns := bucketObjects(t, srv, bucket, "turns/"); len(turns) != 1 {
		t.Errorf("turns left: %v, want the one released", turns)
	}
	out, err := r.b.client.ListMultipartUploads(ctx, &s3.ListMultipartUploadsInput{Bucket: &r.b.name})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Uploads) != 0 {
		t.Errorf("%d multipart uploads left", len(out.Uploads))
	}
}

// A small blob takes no lease: the replica that fetched it uploads it
// whole once verified, and the next reads it from the bucket.
func TestSmallBlobUploadedWhole(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket}
	a, b := newReplica(t, srv, "a", cfg), newReplica(t, srv, "b", cfg)
	blob, d := randomBlob(smallBlob-1, 8)
	up := &testUpstream{blob: blob}
	if src, err := fetchAndCommit(t.Context(), a, d, int64(len(blob)), up); err != nil || src != SourceUpstream {
		t.Fatalf("first replica: %s, %v", src, err)
	}
	// Uploaded in the background, after the fetch returns.
	waitFor(t, "the small blob to be uploaded", func() bool { _, err := a.b.StatBlob(t.Context(), d); return err == nil })
	if left := bucketObjects(t, srv, bucket, "uploads/"); len(left) > 0 {
		t.Errorf("a small blob left upload objects: %v", left)
	}
	if src, err := fetchAndCommit(t.Context(), b, d, int64(len(blob)), up); err != nil || src != SourceBucket {
		t.Fatalf("second replica: %s, %v; want it from the bucket", src, err)
	}
	if up.sent.Load() != int64(len(blob)) {
		t.Errorf("upstream sent %d bytes, want %d", up.sent.Load(), len(blob))
	}
}

// A replica takes over from one that uploaded corrupt parts and died. Its
// own bytes for those parts, from an earlier attempt, are what it
// uploads and assembles: the blob in the bucket verifies.
func TestTakeoverAssemblesOnlyVerifiedBytes(t *testing.T) {
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket, LeaseTTL: time.Second}
	b := newReplica(t, srv, "b", cfg)
	blob, d := randomBlob(3*minPartSize+5, 9)
	size := int64(len(blob))
	bad := bytes.Clone(blob)
	bad[10] ^= 1 // in part 0

	// b's earlier attempt left the first two parts' true bytes on its disk.
	pb, err := b.store.NewPartial(t.Context(), d, size)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pb.WriteAt(blob[:2*minPartSize], 0); err != nil {
		t.Fatal(err)
	}
	pb.Abandon(errors.New("earlier attempt"))
	holderDies(t, srv, cfg, d, bad, 2*minPartSize)

	up := &testUpstream{blob: blob}
	if _, err := fetchAndCommit(t.Context(), b, d, -1, up); err != nil { // size unknown, as without a manifest
		t.Fatal(err)
	}
	if digest.FromBytes(bucketBlob(t, b, d)) != d {
		t.Fatal("the blob assembled in the bucket holds the dead replica's corrupt bytes")
	}
}

// A blob in the bucket that does not verify is removed from it, and the
// fetch says bytes from the bucket were in it (so the upstream is not
// blamed, and the next attempt goes to the upstream).
func TestCorruptBlobInBucketRemoved(t *testing.T) {
	srv, bucket := testMinio(t)
	r := newReplica(t, srv, "a", Config{Bucket: bucket})
	blob, d := randomBlob(2<<20, 10)
	bad := bytes.Clone(blob)
	bad[len(bad)/2] ^= 1
	if _, err := r.b.putBytes(t.Context(), "test", r.b.blobKey(d), bad, "", "", nil); err != nil {
		t.Fatal(err)
	}
	p, err := r.store.NewPartial(t.Context(), d, int64(len(blob)))
	if err != nil {
		t.Fatal(err)
	}
	up := &testUpstream{blob: blob}
	f, err := r.b.Fetch(t.Context(), p, noConfirm, up.fetch(p))
	if err != nil {
		t.Fatal(err)
	}
	err = p.Commit(t.Context())
	f.Finish(t.Context(), err)
	if !errors.Is(err, storage.ErrDigestMismatch) || !f.FromBucket() || f.Source != SourceBucket {
		t.Fatalf("commit %v, from bucket %v, source %s: want a mismatch of bytes from the bucket", err, f.FromBucket(), f.Source)
	}
	if _, err := r.b.StatBlob(t.Context(), d); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("the corrupt blob is still in the bucket: %v", err)
	}
	if up.sent.Load() != 0 {
		t.Errorf("the upstream was asked for %d bytes before the bucket's copy failed", up.sent.Load())
	}
}

// A replica whose bucket does not answer starts, and fetches alone: the
// pull is served from the upstream, whole.
func TestBucketUnreachableFetchesAlone(t *testing.T) {
	srv, bucket := testMinio(t)
	net := &cuttable{}
	net.cut.Store(true)
	r := newReplica(t, srv, "a", Config{Bucket: bucket}, withHTTPClient(&http.Client{Transport: net}))
	blob, d := randomBlob(3*minPartSize, 11)
	up := &testUpstream{blob: blob}
	src, err := fetchAndCommit(t.Context(), r, d, int64(len(blob)), up)
	if err != nil || src != SourceUpstream || up.sent.Load() != int64(len(blob)) {
		t.Fatalf("with the bucket unreachable: %s, %v, %d bytes from the upstream; want upstream, nil, %d", src, err, up.sent.Load(), len(blob))
	}
	if !bytes.Equal(storedBlob(t, r, d), blob) {
		t.Fatal("stored other bytes than the blob's")
	}
}
