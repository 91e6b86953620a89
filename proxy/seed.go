package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
)

// Seeding fills the store before it is needed: an image is fetched
// through the mirror core, as a client pulling it would have it fetched,
// through the same downloads and checks, so that what a seed stores is
// exactly what a pull would have.

// SeedOptions says what of an image to seed.
type SeedOptions struct {
	// Platforms are the os/arch[/variant] of an index's manifests to seed;
	// empty: every platform.
	Platforms []string
	// Referrers seeds the manifests that refer to the image (signatures,
	// SBOMs) too, with their blobs.
	Referrers bool
	// Progress, when set, is told of each blob as it starts and ends.
	Progress *SeedProgress
}

// SeedProgress counts a seed's blobs and bytes as they go, for a caller
// that shows progress. Its fields may be read at any time.
type SeedProgress struct {
	BlobsTotal, BlobsDone atomic.Int64
	BytesTotal, BytesDone atomic.Int64 // BytesTotal as the manifests declare them
	// BytesFetched are the bytes of BytesDone that came from a download
	// (the upstream, or the shared bucket), not from the store.
	BytesFetched atomic.Int64
}

// seedBlobs is how many blobs of an image are fetched at once, as
// containerd does by default.
const seedBlobs = 3

// Seed fetches upstream/repo:ref (a tag or digest) into the store: its
// manifest or index, the chosen platforms' manifests, their configs and
// layers, and with opts.Referrers what refers to them. It returns the
// digest ref resolved to.
func (s *Server) Seed(ctx context.Context, upstreamName, repo, ref string, opts SeedOptions) (digest.Digest, error) {
	top, err := s.Manifest(ctx, upstreamName, repo, ref)
	if err != nil {
		return "", fmt.Errorf("seeding %s/%s:%s: %w", upstreamName, repo, ref, err)
	}
	manifests := []Manifest{top}
	var index struct {
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if json.Unmarshal(top.Body, &index) == nil && len(index.Manifests) > 0 {
		for _, m := range index.Manifests {
			if !platformWanted(m.Platform, opts.Platforms) {
				continue
			}
			child, err := s.Manifest(ctx, upstreamName, repo, m.Digest.String())
			if err != nil {
				return top.Digest, fmt.Errorf("seeding %s/%s@%s: %w", upstreamName, repo, m.Digest, err)
			}
			manifests = append(manifests, child)
		}
	}
	if opts.Referrers {
		for _, m := range manifests {
			refs, err := s.seedReferrers(ctx, upstreamName, repo, m.Digest)
			if err != nil {
				return top.Digest, err
			}
			manifests = append(manifests, refs...)
		}
	}
	var blobs []ocispec.Descriptor
	for _, m := range manifests {
		blobs = append(blobs, blobsOf(m.Body)...)
	}
	slices.SortFunc(blobs, func(a, b ocispec.Descriptor) int { return strings.Compare(string(a.Digest), string(b.Digest)) })
	blobs = slices.CompactFunc(blobs, func(a, b ocispec.Descriptor) bool { return a.Digest == b.Digest })
	progress := opts.Progress
	if progress == nil {
		progress = &SeedProgress{}
	}
	for _, b := range blobs {
		progress.BlobsTotal.Add(1)
		progress.BytesTotal.Add(b.Size)
	}
	landed := func(n int64) { progress.BytesDone.Add(n) }
	fetched := func(n int64) { progress.BytesFetched.Add(n); landed(n) }
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(seedBlobs)
	for _, b := range blobs {
		g.Go(func() error {
			// A blob stored already lands all at once.
			var got int64
			size, err := s.EnsureBlob(gctx, upstreamName, repo, b.Digest, func(n int64) { got += n; fetched(n) })
			if err != nil {
				return fmt.Errorf("seeding %s/%s blob %s: %w", upstreamName, repo, b.Digest, err)
			}
			landed(size - got)
			progress.BlobsDone.Add(1)
			return nil
		})
	}
	return top.Digest, g.Wait()
}

// seedReferrers seeds the manifests that refer to subject, and returns them.
func (s *Server) seedReferrers(ctx context.Context, upstreamName, repo string, subject digest.Digest) ([]Manifest, error) {
	refs, err := s.Referrers(ctx, upstreamName, repo, subject)
	if err != nil {
		return nil, fmt.Errorf("seeding the referrers of %s/%s@%s: %w", upstreamName, repo, subject, err)
	}
	var out []Manifest
	for _, r := range refs {
		m, err := s.Manifest(ctx, upstreamName, repo, r.Digest.String())
		if err != nil {
			return nil, fmt.Errorf("seeding %s/%s@%s, a referrer of %s: %w", upstreamName, repo, r.Digest, subject, err)
		}
		out = append(out, m)
	}
	return out, nil
}

// blobsOf lists the blobs a manifest names: its config and layers. An
// index names none.
func blobsOf(body []byte) []ocispec.Descriptor {
	var m struct {
		Config *ocispec.Descriptor  `json:"config"`
		Layers []ocispec.Descriptor `json:"layers"`
	}
	if json.Unmarshal(body, &m) != nil {
		return nil
	}
	var out []ocispec.Descriptor
	if m.Config != nil && m.Config.Digest != "" {
		out = append(out, *m.Config)
	}
	for _, l := range m.Layers {
		if l.Digest != "" && !nonDistributable(l.MediaType) {
			out = append(out, l)
		}
	}
	return out
}

// nonDistributable reports whether a layer is one registries do not serve
// (Windows base layers of old): a client fetches it elsewhere.
func nonDistributable(mediaType string) bool {
	return strings.Contains(mediaType, "nondistributable") || strings.Contains(mediaType, "foreign")
}

// platformWanted reports whether an index entry's platform is among want
// (os/arch or os/arch/variant); empty want: all.
func platformWanted(p *ocispec.Platform, want []string) bool {
	if len(want) == 0 {
		return true
	}
	if p == nil {
		return false
	}
	for _, w := range want {
		parts := strings.Split(w, "/")
		if len(parts) < 2 || parts[0] != p.OS || parts[1] != p.Architecture {
			continue
		}
		if len(parts) == 2 || parts[2] == p.Variant {
			return true
		}
	}
	return false
}
