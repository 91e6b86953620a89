package bucket

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/opencontainers/go-digest"

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
type Store struct {
	*storage.Store
	b *Bucket
}

// NewStore puts b behind local.
func NewStore(local *storage.Store, b *Bucket) *Store {
	return &Store{Store: local, b: b}
}

// Bucket returns the bucket behind the store.
func (s *Store) Bucket() *Bucket { return s.b }

// ReadBlob reads a manifest (or another small blob) from the local store,
// or else from the bucket, verified against d and then kept locally.
func (s *Store) ReadBlob(ctx context.Context, d digest.Digest, limit int64) ([]byte, error) {
	body, err := s.Store.ReadBlob(ctx, d, limit)
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
		s.b.log.Warn("a manifest in the shared bucket does not match its digest: fetching it again from the upstream",
			"digest", d, "key", s.b.manifestKey(d))
		return nil, err
	}
	if err := s.Store.PutBlob(ctx, d, body); err != nil {
		return nil, err
	}
	if mt := o.metadata[mediaTypeKey]; mt != "" {
		if err := s.Store.SetMediaType(ctx, d, mt); err != nil {
			return nil, err
		}
	}
	return body, nil
}

// SetMediaType records a manifest's media type, and shares the manifest
// (stored with PutBlob just before) with the other replicas.
func (s *Store) SetMediaType(ctx context.Context, d digest.Digest, mediaType string) error {
	if err := s.Store.SetMediaType(ctx, d, mediaType); err != nil {
		return err
	}
	body, err := s.Store.ReadBlob(ctx, d, maxManifestSize)
	if err != nil {
		return nil // not a manifest: nothing to share
	}
	meta := map[string]string{mediaTypeKey: mediaType}
	if _, err := s.b.putBytes(ctx, "put_manifest", s.b.manifestKey(d), body, "*", "", meta); err != nil && !errors.Is(err, errPrecondition) {
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
	} else if !errors.Is(err, storage.ErrNotFound) {
		s.b.log.Warn("reading a tag from the shared bucket: answering from the local store", "err", err)
	}
	return s.Store.Tag(ctx, upstream, repo, tag)
}

// PutTag records a tag locally and in the bucket.
func (s *Store) PutTag(ctx context.Context, upstream, repo, tag string, rec storage.TagRecord) error {
	if err := s.Store.PutTag(ctx, upstream, repo, tag, rec); err != nil {
		return err
	}
	body, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if _, err := s.b.putBytes(ctx, "put_tag", s.b.tagKey(upstream, repo, tag), body, "", "", nil); err != nil {
		s.b.log.Warn("sharing a tag in the bucket: other replicas may answer it differently until it is revalidated",
			"upstream", upstream, "repo", repo, "tag", tag, "err", err)
	}
	return nil
}

// IsMember reports whether d is known to be in the repository: locally,
// or else as the bucket records (then kept locally).
func (s *Store) IsMember(ctx context.Context, upstream, repo string, d digest.Digest) (bool, error) {
	if known, err := s.Store.IsMember(ctx, upstream, repo, d); known || err != nil {
		return known, err
	}
	_, err := s.b.head(ctx, "head_member", s.b.memberKey(upstream, repo, d))
	switch {
	case errors.Is(err, storage.ErrNotFound):
		return false, nil
	case err != nil:
		return false, err
	}
	if err := s.Store.AddMembers(ctx, upstream, repo, d); err != nil {
		s.b.log.Warn("recording a digest as a repository's", "digest", d, "err", err)
	}
	return true, nil
}

// AddMembers records digests as the repository's, locally and in the bucket.
func (s *Store) AddMembers(ctx context.Context, upstream, repo string, ds ...digest.Digest) error {
	if err := s.Store.AddMembers(ctx, upstream, repo, ds...); err != nil {
		return err
	}
	for _, d := range ds {
		if _, err := s.b.putBytes(ctx, "put_member", s.b.memberKey(upstream, repo, d), nil, "", "", nil); err != nil {
			s.b.log.Warn("sharing what a repository holds in the bucket: other replicas ask the upstream", "digest", d, "err", err)
			break
		}
	}
	return nil
}
