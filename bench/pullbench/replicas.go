package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/miniotest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

const (
	bucketName   = "pullbench"
	bucketPrefix = "bench/"
	// uploadWait bounds the wait for replica A's uploads to the bucket
	// after its client has the image.
	uploadWait = 5 * time.Minute
)

// sharedBucket is a MinIO server on loopback, its data under the work dir
// (on this machine's disk), holding one empty bucket: one run's.
type sharedBucket struct {
	srv *miniotest.Server
	dir string
}

func (b *bench) startBucket(ctx context.Context) (*sharedBucket, error) {
	dir, err := os.MkdirTemp(b.dir, "minio")
	if err != nil {
		return nil, fmt.Errorf("creating MinIO's dir: %w", err)
	}
	srv, err := miniotest.Start(ctx, dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting MinIO: %w", err)
	}
	s := &sharedBucket{srv: srv, dir: dir}
	if err := s.create(ctx); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// create creates the bucket (miniotest retries while MinIO starts).
func (s *sharedBucket) create(ctx context.Context) error {
	return s.srv.CreateBucket(ctx, bucketName)
}

func (s *sharedBucket) close() {
	s.srv.Stop()
	os.RemoveAll(s.dir)
}

// storageYAML is the storage section of a replica sharing the bucket.
func (s *sharedBucket) storageYAML() string {
	return fmt.Sprintf("storage:\n  type: s3\n  bucket: %s\n  endpoint: %s\n  path_style: true\n  prefix: %s\n",
		bucketName, s.srv.Endpoint, bucketPrefix)
}

// replicaEnv is what a replica needs to reach MinIO: its credentials, and
// none of the machine's own AWS configuration.
func replicaEnv() []string {
	return []string{"AWS_ACCESS_KEY_ID=" + miniotest.AccessKey, "AWS_SECRET_ACCESS_KEY=" + miniotest.SecretKey,
		"AWS_EC2_METADATA_DISABLED=true", "AWS_CONFIG_FILE=/dev/null", "AWS_SHARED_CREDENTIALS_FILE=/dev/null"}
}

// waitUploaded waits until the bucket holds every blob of blobs whole,
// under <prefix>blobs/sha256/<hex>.
func (s *sharedBucket) waitUploaded(ctx context.Context, blobs []registrytest.Descriptor) error {
	ctx, cancel := context.WithTimeout(ctx, uploadWait)
	defer cancel()
	client := s.srv.Client()
	missing := blobs
	for {
		var still []registrytest.Descriptor
		for _, d := range missing {
			out, err := client.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(bucketName),
				Key: aws.String(bucketPrefix + "blobs/" + d.Digest.Algorithm().String() + "/" + d.Digest.Encoded())})
			if err != nil || aws.ToInt64(out.ContentLength) != d.Size {
				still = append(still, d)
			}
		}
		if missing = still; len(missing) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			names := make([]string, len(missing))
			for i, d := range missing {
				names[i] = d.Digest.String()
			}
			return fmt.Errorf("the bucket lacks %d of the image's %d blobs (%s): %w", len(missing), len(blobs),
				strings.Join(names, ", "), ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// replicas is two pullproxy replicas, each with an empty data dir of its
// own, sharing a fresh bucket, their upstream across one carrier (the
// site's one path to the registry).
type replicas struct {
	path   *carrier.Relay
	bucket *sharedBucket
	a, b   *proxyProcess
}

// startReplicas starts the carrier (see bench.carrier), MinIO with an
// empty bucket and two replicas sharing it.
func (b *bench) startReplicas(ctx context.Context, mode carrier.Mode, prob float64, rtt time.Duration) (*replicas, error) {
	r := &replicas{}
	var err error
	if r.bucket, err = b.startBucket(ctx); err != nil {
		return nil, err
	}
	if r.path, err = b.carrier(mode, prob, rtt); err != nil {
		r.close()
		return nil, err
	}
	for _, p := range []**proxyProcess{&r.a, &r.b} {
		dataDir, err := os.MkdirTemp(b.dir, "replica")
		if err != nil {
			r.close()
			return nil, fmt.Errorf("creating a replica's data dir: %w", err)
		}
		if *p, err = startProxyWith(ctx, b, []string{"https://" + r.path.Addr()}, dataDir, r.bucket.storageYAML(), replicaEnv()); err != nil {
			os.RemoveAll(dataDir)
			r.close()
			return nil, fmt.Errorf("starting a replica: %w", err)
		}
	}
	return r, nil
}

// close stops the replicas, the carrier and MinIO, and removes the
// replicas' data dirs and the bucket's.
func (r *replicas) close() {
	for _, p := range []*proxyProcess{r.a, r.b} {
		if p != nil {
			p.stop()
			os.RemoveAll(p.dataDir)
			os.Remove(p.dataDir + ".yaml")
		}
	}
	if r.path != nil {
		r.path.Close()
	}
	r.bucket.close()
}

// imageBlobs are the blobs containerd fetches besides manifests: the
// config and the layers.
func (b *bench) imageBlobs() []registrytest.Descriptor {
	return append([]registrytest.Descriptor{b.pushed.Config}, b.pushed.Layers...)
}

// replicaAfter: containerd pulls the image through replica A across the
// carrier (cold, not timed); once A's uploads have put every blob in the
// bucket, a new containerd pulls it through replica B, whose data dir is
// still empty. The sample is B's pull, and what crossed the carrier during
// it.
func (b *bench) replicaAfter(ctx context.Context, rtt time.Duration) (sample, error) {
	r, err := b.startReplicas(ctx, carrier.Reset, b.cfg.CutProb, rtt)
	if err != nil {
		return sample{}, err
	}
	defer r.close()
	f, err := b.pull(ctx, r.a.Addr, mirrorHosts)
	if err != nil {
		return sample{}, err
	}
	if f.failure != "" {
		return sample{}, fmt.Errorf("cold pull through replica A failed after %.2fs: %s", f.took.Seconds(), f.failure)
	}
	if err := r.bucket.waitUploaded(ctx, b.imageBlobs()); err != nil {
		return sample{}, fmt.Errorf("after the pull through replica A: %w", err)
	}
	log.Printf("replica B after A: A's pull took %.2fs; every blob was in the bucket %.2fs after it ended (at most)",
		f.took.Seconds(), time.Since(f.end).Seconds())
	before := r.path.Stats().BytesEgress
	if f, err = b.pull(ctx, r.b.Addr, mirrorHosts); err != nil {
		return sample{}, err
	}
	if f.failure != "" {
		return sample{}, fmt.Errorf("pull through replica B failed after %.2fs: %s", f.took.Seconds(), f.failure)
	}
	return sample{seconds: f.took.Seconds(), upstream: ratio(r.path.Stats().BytesEgress-before, b.bytes)}, nil
}

// replicasAtOnce: two new containerds pull the cold image at the same time,
// one through replica A and one through replica B. The time runs from the
// earlier of the two pulls' first connections to the later one's exit.
func (b *bench) replicasAtOnce(ctx context.Context, rtt time.Duration) (sample, error) {
	r, err := b.startReplicas(ctx, carrier.Reset, b.cfg.CutProb, rtt)
	if err != nil {
		return sample{}, err
	}
	defer r.close()
	proxies := []*proxyProcess{r.a, r.b}
	daemons := make([]*containerdtest.Daemon, len(proxies))
	for i := range proxies {
		d, remove, err := b.newContainerd(ctx)
		if err != nil {
			return sample{}, err
		}
		defer remove()
		daemons[i] = d
	}
	fetches := make([]fetch, len(proxies))
	errs := make([]error, len(proxies))
	var wg sync.WaitGroup
	for i, p := range proxies {
		wg.Go(func() { fetches[i], errs[i] = b.pullOn(ctx, daemons[i], p.Addr, mirrorHosts) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return sample{}, err
	}
	first, end := fetches[0].first, fetches[0].end
	for i, f := range fetches {
		if f.failure != "" {
			return sample{}, fmt.Errorf("pull through replica %c failed after %.2fs: %s", 'A'+i, f.took.Seconds(), f.failure)
		}
		if f.first.Before(first) {
			first = f.first
		}
		if f.end.After(end) {
			end = f.end
		}
	}
	r.path.Close() // its counts final: bytes still in flight are counted
	st := r.path.Stats()
	return sample{seconds: end.Sub(first).Seconds(), upstream: ratio(st.BytesEgress, b.bytes),
		rssMiB: max(r.a.PeakRSSMiB(), r.b.PeakRSSMiB()), peakConns: float64(st.PeakOpen)}, nil
}
