package storage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/opencontainers/go-digest"
)

// maxPinnedManifestDepth bounds how deep indexes of indexes are followed.
const maxPinnedManifestDepth = 4

// ImageDigests adds to into the digests of upstream/repo's image ref (a
// tag or a digest) as the store holds it: its manifest or index, every
// platform's manifest, configs and layers. What the store lacks is left
// out: a tag never pulled names nothing yet.
func (s *Store) ImageDigests(ctx context.Context, upstream, repo, ref string, into map[digest.Digest]bool) error {
	d, err := digest.Parse(ref)
	if err != nil {
		rec, err := s.Tag(ctx, upstream, repo, ref)
		if errors.Is(err, ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		d = rec.Digest
	}
	return s.manifestDigests(ctx, d, into, 0)
}

func (s *Store) manifestDigests(ctx context.Context, d digest.Digest, into map[digest.Digest]bool, depth int) error {
	if into[d] || depth > maxPinnedManifestDepth {
		return nil
	}
	into[d] = true
	body, err := s.ReadBlob(ctx, d, 4<<20)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading manifest %s: %w", d, err)
	}
	var m struct {
		Config *struct {
			Digest digest.Digest `json:"digest"`
		} `json:"config"`
		Layers []struct {
			Digest digest.Digest `json:"digest"`
		} `json:"layers"`
		Manifests []struct {
			Digest digest.Digest `json:"digest"`
		} `json:"manifests"`
	}
	if json.Unmarshal(body, &m) != nil {
		return nil // not a manifest: nothing more it names
	}
	if m.Config != nil {
		into[m.Config.Digest] = true
	}
	for _, l := range m.Layers {
		into[l.Digest] = true
	}
	for _, c := range m.Manifests {
		if err := s.manifestDigests(ctx, c.Digest, into, depth+1); err != nil {
			return err
		}
	}
	return nil
}
