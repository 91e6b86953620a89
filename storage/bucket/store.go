package bucket

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"

	"github.com/pullproxy/pullproxy/storage"
)

// maxManifestSize bounds a manifest read from the bucket, as the proxy
// bounds one read from an upstream.
const maxManifestSize = 4 << 20

// mediaTypeKey is the metadata entry of a manifest object naming its media type.
const mediaTypeKey = "media-type"

// Store is a replica's store: its local store, a cache and the replica's
// own records, with the bucket behind it for what replicas share:
// manifests, tags and which repositories hold which digests. Blobs are
// shared through Fetch. What the local store does not hold is looked up
// in the bucket and kept locally; what is written goes to both.
//
// The bucket answers tags first, so every replica answers a tag with the
// same digest until it is revalidated. A failure of the bucket is logged
// and the local store answers alone: a replica keeps serving when the
// bucket does not.
//
// Every method of the local store it serves is written out below, each
// saying whether the bucket takes part: a method added to the local store
// is not served past the bucket unseen.
type Store struct {
	local *storage.Store
	b     *Bucket
}

// NewStore puts b behind local.
func NewStore(local *storage.Store, b *Bucket) *Store {
	return &Store{local: local, b: b}
}

// Blobs are shared through Fetch (a download follows the bucket's parts
// or the whole object), not through the store: these are the local
// store's alone.

// OpenBlob opens a blob stored locally.
func (s *Store) OpenBlob(ctx context.Context, d digest.Digest) (*os.File, int64, error) {
	return s.local.OpenBlob(ctx, d)
}

// OpenBlobFD opens a blob stored locally, for the blob loop's sendfile.
func (s *Store) OpenBlobFD(ctx context.Context, d digest.Digest) (storage.BlobFD, error) {
	return s.local.OpenBlobFD(ctx, d)
}

// StatBlob returns the size of a blob stored locally.
func (s *Store) StatBlob(ctx context.Context, d digest.Digest) (int64, error) {
	return s.local.StatBlob(ctx, d)
}

// NewPartial starts or resumes a local download of d.
func (s *Store) NewPartial(ctx context.Context, d digest.Digest, size int64) (*storage.Partial, error) {
	return s.local.NewPartial(ctx, d, size)
}

// Touch records a local blob's use, for eviction.
func (s *Store) Touch(ctx context.Context, d digest.Digest) error { return s.local.Touch(ctx, d) }

// PutBlob stores a manifest locally; SetMediaType, which follows it,
// shares it.
func (s *Store) PutBlob(ctx context.Context, d digest.Digest, b []byte) error {
	return s.local.PutBlob(ctx, d, b)
}

// Blob returns a local blob's record.
func (s *Store) Blob(ctx context.Context, d digest.Digest) (storage.BlobRecord, error) {
	return s.local.Blob(ctx, d)
}

// Tag lists and referrers are kept per replica: each asks its upstream,
// and a stale page costs a client nothing a revalidation does not fix.

// TagList returns a page of a tag list kept locally.
func (s *Store) TagList(ctx context.Context, upstream, repo, query string) (storage.TagListRecord, error) {
	return s.local.TagList(ctx, upstream, repo, query)
}

// PutTagList keeps a page of a tag list locally.
func (s *Store) PutTagList(ctx context.Context, upstream, repo, query string, rec storage.TagListRecord) error {
	return s.local.PutTagList(ctx, upstream, repo, query, rec)
}

// Repositories lists the repositories this replica knows.
func (s *Store) Repositories(ctx context.Context) ([]string, error) {
	return s.local.Repositories(ctx)
}

// Referrers returns the referrers of subject kept locally.
func (s *Store) Referrers(ctx context.Context, upstream, repo string, subject digest.Digest) (storage.ReferrersRecord, error) {
	return s.local.Referrers(ctx, upstream, repo, subject)
}

// PutReferrers keeps the referrers of subject locally.
func (s *Store) PutReferrers(ctx context.Context, upstream, repo string, subject digest.Digest, rec storage.ReferrersRecord) error {
	return s.local.PutReferrers(ctx, upstream, repo, subject, rec)
}

// ReadBlob reads a manifest (or another small blob) from the local store,
// or else from the bucket, verified against d and then kept locally.
func (s *Store) ReadBlob(ctx context.Context, d digest.Digest, limit int64) ([]byte, error) {
	body, err := s.local.ReadBlob(ctx, d, limit)
	if !errors.Is(err, storage.ErrNotFound) {
		return body, err
	}
	body, o, berr := s.b.getSmall(ctx, "get_manifest", s.b.manifestKey(d))
	switch {
	case errors.Is(berr, storage.ErrNotFound):
		return nil, err
	case berr != nil:
		s.b.log.Warn("reading a manifest from the shared bucket: asking the upstream", "digest", d, "err", berr)
		return nil, err
	case int64(len(body)) > min(limit, maxManifestSize):
		return nil, fmt.Errorf("manifest %s in the bucket: %d bytes, more than %d", d, len(body), limit)
	case d.Algorithm().FromBytes(body) != d:
		// Removed, so that the copy fetched now takes its place.
		s.b.log.Warn("a manifest in the shared bucket does not match its digest: removed, fetching it again from the upstream",
			"digest", d, "key", s.b.manifestKey(d))
		s.b.delete(ctx, "delete_manifest", s.b.manifestKey(d))
		return nil, err
	}
	if err := s.local.PutBlob(ctx, d, body); err != nil {
		return nil, err
	}
	if mt := o.metadata[mediaTypeKey]; mt != "" {
		if err := s.local.SetMediaType(ctx, d, mt); err != nil {
			return nil, err
		}
	}
	return body, nil
}

// SetMediaType records a manifest's media type, and shares the manifest
// (stored with PutBlob just before) with the other replicas.
func (s *Store) SetMediaType(ctx context.Context, d digest.Digest, mediaType string) error {
	if err := s.local.SetMediaType(ctx, d, mediaType); err != nil {
		return err
	}
	body, err := s.local.ReadBlob(ctx, d, maxManifestSize)
	if err != nil {
		return nil // not a manifest: nothing to share
	}
	meta := map[string]string{mediaTypeKey: mediaType}
	if _, err := s.b.putBytes(ctx, "put_manifest", s.b.manifestKey(d), body, "*", "", meta); err != nil && !errors.Is(err, errPrecondition) && !errors.Is(err, ErrDegraded) {
		s.b.log.Warn("sharing a manifest in the bucket: other replicas fetch it themselves", "digest", d, "err", err)
	}
	return nil
}

// Tag returns a tag's record as the bucket has it, or else as the local
// store does.
func (s *Store) Tag(ctx context.Context, upstream, repo, tag string) (storage.TagRecord, error) {
	body, _, err := s.b.getSmall(ctx, "get_tag", s.b.tagKey(upstream, repo, tag))
	if err == nil {
		var rec storage.TagRecord
		if err := json.Unmarshal(body, &rec); err == nil && rec.Digest.Validate() == nil {
			return rec, nil
		}
		s.b.log.Warn("a tag record in the shared bucket is not readable: ignored", "key", s.b.tagKey(upstream, repo, tag))
	} else if !errors.Is(err, storage.ErrNotFound) && !isTimeout(ctx, err) {
		s.b.log.Warn("reading a tag from the shared bucket: answering from the local store", "err", err)
	}
	return s.local.Tag(ctx, upstream, repo, tag)
}

// PutTag records a tag locally and in the bucket.
func (s *Store) PutTag(ctx context.Context, upstream, repo, tag string, rec storage.TagRecord) error {
	if err := s.local.PutTag(ctx, upstream, repo, tag, rec); err != nil {
		return err
	}
	body, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if _, err := s.b.putBytes(ctx, "put_tag", s.b.tagKey(upstream, repo, tag), body, "", "", nil); err != nil && !errors.Is(err, ErrDegraded) {
		s.b.log.Warn("sharing a tag in the bucket: other replicas may answer it differently until it is revalidated",
			"upstream", upstream, "repo", repo, "tag", tag, "err", err)
	}
	return nil
}

// IsMember reports whether d is known to be in the repository: locally,
// or else as the bucket records (then kept locally).
func (s *Store) IsMember(ctx context.Context, upstream, repo string, d digest.Digest) (bool, error) {
	if known, err := s.local.IsMember(ctx, upstream, repo, d); known || err != nil {
		return known, err
	}
	_, err := s.sharedMember(ctx, upstream, repo, d)
	switch {
	case errors.Is(err, storage.ErrNotFound):
		return false, nil
	case err != nil:
		return false, err
	}
	return true, nil
}

// sharedMember looks d up among the repository's members in the bucket,
// and records what it finds locally: the membership, and the size a
// manifest declared (-1 for none).
func (s *Store) sharedMember(ctx context.Context, upstream, repo string, d digest.Digest) (int64, error) {
	_, meta, err := s.b.headMeta(ctx, "head_member", s.b.memberKey(upstream, repo, d))
	if err != nil {
		return -1, err
	}
	declared := int64(-1)
	if v, ok := meta[declaredSizeKey]; ok {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
			declared = n
		}
	}
	if declared >= 0 {
		err = s.local.SetDeclaredSizes(ctx, upstream, repo, map[digest.Digest]int64{d: declared})
	} else {
		err = s.local.AddMembers(ctx, upstream, repo, d)
	}
	if err != nil {
		s.b.log.Warn("recording a digest as a repository's", "digest", d, "err", err)
	}
	return declared, nil
}

// declaredSizeKey is the metadata entry of a member object holding the
// size a manifest declared for the digest.
const declaredSizeKey = "declared-size"

// AddMembers records digests as the repository's, locally and in the bucket.
func (s *Store) AddMembers(ctx context.Context, upstream, repo string, ds ...digest.Digest) error {
	if err := s.local.AddMembers(ctx, upstream, repo, ds...); err != nil {
		return err
	}
	s.shareMembers(ctx, upstream, repo, ds, nil)
	return nil
}

// SetDeclaredSizes records the sizes a manifest of the repository declares
// (and so that the repository holds those digests), locally and in the bucket.
func (s *Store) SetDeclaredSizes(ctx context.Context, upstream, repo string, sizes map[digest.Digest]int64) error {
	if err := s.local.SetDeclaredSizes(ctx, upstream, repo, sizes); err != nil {
		return err
	}
	s.shareMembers(ctx, upstream, repo, slices.Collect(maps.Keys(sizes)), sizes)
	return nil
}

// DeclaredSize returns the size a manifest of the repository declared for
// d, as recorded locally or else in the bucket.
func (s *Store) DeclaredSize(ctx context.Context, upstream, repo string, d digest.Digest) (int64, error) {
	n, err := s.local.DeclaredSize(ctx, upstream, repo, d)
	if !errors.Is(err, storage.ErrNotFound) {
		return n, err
	}
	if shared, berr := s.sharedMember(ctx, upstream, repo, d); berr == nil && shared >= 0 {
		return shared, nil
	}
	return n, err
}

// shareMembers writes the repository's member objects for ds, a few at
// once, with their declared sizes where known.
func (s *Store) shareMembers(ctx context.Context, upstream, repo string, ds []digest.Digest, sizes map[digest.Digest]int64) {
	var g errgroup.Group
	g.SetLimit(8)
	for _, d := range ds {
		g.Go(func() error {
			var meta map[string]string
			if n, ok := sizes[d]; ok {
				meta = map[string]string{declaredSizeKey: strconv.FormatInt(n, 10)}
			}
			_, err := s.b.putBytes(ctx, "put_member", s.b.memberKey(upstream, repo, d), nil, "", "", meta)
			return err
		})
	}
	if err := g.Wait(); err != nil && !errors.Is(err, ErrDegraded) {
		s.b.log.Warn("sharing what a repository holds in the bucket: other replicas ask the upstream",
			"upstream", upstream, "repo", repo, "err", err)
	}
}
