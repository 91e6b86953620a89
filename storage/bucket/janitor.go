package bucket

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// Clean removes what downloads left in the bucket and nobody touched for
// StaleUploads: the parts and lease of an upload given up (a blob no
// client asked for again), and multipart assemblies begun and never
// completed (a replica killed while assembling). Any replica may run it:
// what it removes is stale by the bucket's own clock, so a live download,
// which writes its lease every LeaseTTL/3, is never touched. It looks
// only under uploads/ (and at assemblies under blobs/): turns, released
// and untouched between rounds, are not uploads.
func (b *Bucket) Clean(ctx context.Context) (removed int, err error) {
	type upload struct {
		newest time.Time
		keys   []string
	}
	if err := b.health.skip(); err != nil {
		return 0, err
	}
	uploads := map[string]*upload{}
	prefix := b.prefix + "uploads/"
	p := s3.NewListObjectsV2Paginator(b.client, &s3.ListObjectsV2Input{Bucket: &b.name, Prefix: &prefix})
	// By the local clock: StaleUploads (hours) dwarfs any skew between
	// it and the bucket's.
	cutoff := time.Now().Add(-b.cfg.StaleUploads)
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		b.settle(ctx, "list_uploads", err)
		if err != nil {
			return removed, b.wrap("listing", prefix, err)
		}
		for _, o := range page.Contents {
			key := aws.ToString(o.Key)
			i := strings.LastIndexByte(key, '/')
			if i < 0 {
				continue
			}
			u := uploads[key[:i]]
			if u == nil {
				u = &upload{}
				uploads[key[:i]] = u
			}
			u.keys = append(u.keys, key)
			if t := aws.ToTime(o.LastModified); t.After(u.newest) {
				u.newest = t
			}
		}
	}
	stale := map[string]bool{}
	for dir, u := range uploads {
		if u.newest.After(cutoff) {
			continue
		}
		stale[dir] = true
		if err := b.delete(ctx, "delete_stale", u.keys...); err != nil {
			return removed, err
		}
		removed += len(u.keys)
		b.log.Info("removed a stale upload from the shared bucket", "upload", dir, "objects", len(u.keys),
			"last_written", u.newest)
	}

	// Assemblies begun by a replica killed while assembling, found by
	// prefix where the server lists that way (AWS S3), by blob where it
	// lists only by key (MinIO).
	n, err := b.abortAssemblies(ctx, b.prefix+"blobs/", cutoff)
	removed += n
	for dir := range stale {
		n, err2 := b.abortAssemblies(ctx, b.prefix+"blobs/"+strings.TrimPrefix(dir, prefix), cutoff)
		removed += n
		err = errors.Join(err, err2)
	}
	return removed, err
}

// abortAssemblies aborts the multipart uploads of keys under prefix begun
// before cutoff (any, for a zero cutoff).
func (b *Bucket) abortAssemblies(ctx context.Context, prefix string, cutoff time.Time) (aborted int, err error) {
	in := &s3.ListMultipartUploadsInput{Bucket: &b.name, Prefix: &prefix}
	for {
		if err := b.health.skip(); err != nil {
			return aborted, err
		}
		out, err := b.client.ListMultipartUploads(ctx, in)
		b.settle(ctx, "list_multipart", err)
		if err != nil {
			return aborted, b.wrap("listing multipart uploads under", prefix, err)
		}
		for _, u := range out.Uploads {
			if !cutoff.IsZero() && aws.ToTime(u.Initiated).After(cutoff) {
				continue
			}
			_, err := b.client.AbortMultipartUpload(ctx, &s3.AbortMultipartUploadInput{Bucket: &b.name, Key: u.Key, UploadId: u.UploadId})
			b.settle(ctx, "abort_multipart", err)
			if err != nil && !isNotFound(err) {
				return aborted, b.wrap("aborting a multipart upload of", aws.ToString(u.Key), err)
			}
			aborted++
			b.log.Info("aborted a multipart assembly left in the shared bucket", "key", aws.ToString(u.Key),
				"initiated", aws.ToTime(u.Initiated))
		}
		if !aws.ToBool(out.IsTruncated) {
			return aborted, nil
		}
		in.KeyMarker, in.UploadIdMarker = out.NextKeyMarker, out.NextUploadIdMarker
	}
}

// RunJanitor runs Clean about every interval (jittered, so replicas
// started together do not clean together) until ctx is done.
func (b *Bucket) RunJanitor(ctx context.Context, interval time.Duration) {
	for {
		wait := interval/2 + rand.N(interval)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if _, err := b.Clean(ctx); err != nil && ctx.Err() == nil && !errors.Is(err, ErrDegraded) {
			b.log.Warn("cleaning stale uploads in the shared bucket", "err", err)
		}
	}
}
