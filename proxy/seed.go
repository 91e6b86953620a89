package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
)

// Seeding fills the store before it is needed: an image is fetched as a
// client pulling it through the mirror would fetch it, through the same
// requests, downloads and checks, so that what a seed stores is exactly
// what a pull would have.

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
}

// seedBlobs is how many blobs of an image are fetched at once, as
// containerd does by default.
const seedBlobs = 3

// trustedKey marks a request made by pullproxy itself (a seed): the
// per-upstream allow_clients lists are for remote clients.
type trustedKey struct{}

// Seed fetches upstream/repo:ref (a tag or digest) into the store: its
// manifest or index, the chosen platforms' manifests, their configs and
// layers, and with opts.Referrers what refers to them. It returns the
// digest ref resolved to.
func (s *Server) Seed(ctx context.Context, upstreamName, repo, ref string, opts SeedOptions) (digest.Digest, error) {
	ctx = context.WithValue(ctx, trustedKey{}, true)
	body, d, err := s.seedGet(ctx, upstreamName, repo, "manifests/"+ref, nil)
	if err != nil {
		return "", err
	}
	manifests := []seedManifest{{d, body}}
	var index struct {
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if json.Unmarshal(body, &index) == nil && len(index.Manifests) > 0 {
		for _, m := range index.Manifests {
			if !platformWanted(m.Platform, opts.Platforms) {
				continue
			}
			b, md, err := s.seedGet(ctx, upstreamName, repo, "manifests/"+m.Digest.String(), nil)
			if err != nil {
				return d, err
			}
			manifests = append(manifests, seedManifest{md, b})
		}
	}
	if opts.Referrers {
		for _, m := range manifests {
			refs, err := s.seedReferrers(ctx, upstreamName, repo, m.digest)
			if err != nil {
				return d, err
			}
			manifests = append(manifests, refs...)
		}
	}
	var blobs []ocispec.Descriptor
	for _, m := range manifests {
		blobs = append(blobs, blobsOf(m.body)...)
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
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(seedBlobs)
	for _, b := range blobs {
		g.Go(func() error {
			_, _, err := s.seedGet(gctx, upstreamName, repo, "blobs/"+b.Digest.String(), &progress.BytesDone)
			if err == nil {
				progress.BlobsDone.Add(1)
			}
			return err
		})
	}
	return d, g.Wait()
}

type seedManifest struct {
	digest digest.Digest
	body   []byte
}

// seedReferrers seeds the manifests that refer to subject, and returns them.
func (s *Server) seedReferrers(ctx context.Context, upstreamName, repo string, subject digest.Digest) ([]seedManifest, error) {
	body, _, err := s.seedGet(ctx, upstreamName, repo, "referrers/"+subject.String(), nil)
	if err != nil {
		return nil, err
	}
	var index struct {
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if err := json.Unmarshal(body, &index); err != nil {
		return nil, fmt.Errorf("the referrers of %s: %w", subject, err)
	}
	var out []seedManifest
	for _, m := range index.Manifests {
		b, d, err := s.seedGet(ctx, upstreamName, repo, "manifests/"+m.Digest.String(), nil)
		if err != nil {
			return nil, err
		}
		out = append(out, seedManifest{d, b})
	}
	return out, nil
}

// seedGet answers GET /v2/<repo>/<what> as the mirror answers a client,
// and returns the body (kept for manifests and indexes; blobs are counted
// into bytes and dropped) and the answer's digest.
func (s *Server) seedGet(ctx context.Context, upstreamName, repo, what string, bytes *atomic.Int64) ([]byte, digest.Digest, error) {
	u := &url.URL{Path: "/v2/" + repo + "/" + what, RawQuery: url.Values{"ns": {upstreamName}}.Encode()}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, "", err
	}
	req.RemoteAddr = "pullproxy-seed"
	req.Header["Accept"] = append(slices.Clone(allManifestTypes), ocispec.MediaTypeImageIndex)
	w := &seedWriter{header: http.Header{}, keep: bytes == nil, count: bytes}
	s.handleRegistry(w, req)
	if w.status != http.StatusOK {
		var oe struct {
			Errors []struct{ Code, Message string } `json:"errors"`
		}
		msg := strings.TrimSpace(string(w.body))
		if json.Unmarshal(w.body, &oe) == nil && len(oe.Errors) > 0 {
			msg = oe.Errors[0].Code + ": " + oe.Errors[0].Message
		}
		return nil, "", fmt.Errorf("seeding %s/%s %s: %d %s", upstreamName, repo, what, w.status, msg)
	}
	d, _ := digest.Parse(w.header.Get("Docker-Content-Digest"))
	return w.body, d, nil
}

// seedWriter is the response writer of a seed's request.
type seedWriter struct {
	header http.Header
	status int
	keep   bool // keep the body (manifests), else count it
	body   []byte
	count  *atomic.Int64
	mu     sync.Mutex
}

func (w *seedWriter) Header() http.Header { return w.header }
func (w *seedWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}

func (w *seedWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if w.keep || w.status != http.StatusOK {
		w.mu.Lock()
		w.body = append(w.body, b...)
		w.mu.Unlock()
	} else if w.count != nil {
		w.count.Add(int64(len(b)))
	}
	return len(b), nil
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
