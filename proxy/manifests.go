package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// Manifest media types pullproxy asks upstreams for when resolving a tag on
// behalf of clients that accept them all, as containerd does. The answer is
// then cached for every such client.
const (
	mediaTypeDockerManifest = "application/vnd.docker.distribution.manifest.v2+json"
	mediaTypeDockerList     = "application/vnd.docker.distribution.manifest.list.v2+json"
)

var allManifestTypes = []string{
	ocispec.MediaTypeImageIndex,
	ocispec.MediaTypeImageManifest,
	mediaTypeDockerList,
	mediaTypeDockerManifest,
}

// upstreamTimeout bounds a manifest or tag lookup shared by several clients.
const upstreamTimeout = 2 * time.Minute

// serveManifest answers HEAD and GET of a manifest by tag or digest.
func (s *Server) serveManifest(w http.ResponseWriter, r *http.Request, rt route) {
	m, source, err := s.manifest(r.Context(), rt)
	if err != nil {
		s.fail(w, r, rt, err)
		return
	}
	setSource(w, source)
	h := w.Header()
	etag := `"` + m.Digest.String() + `"`
	h.Set("Docker-Content-Digest", m.Digest.String())
	h.Set("Etag", etag)
	if preconditions(w, r, etag) {
		return
	}
	h.Set("Content-Type", m.MediaType)
	h.Set("Content-Length", strconv.Itoa(len(m.Body)))
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		w.Write(m.Body)
	}
}

// resolveTag returns the manifest a tag points to: from the cache while it is
// younger than the tag TTL, else revalidated upstream with a HEAD. When the
// upstream cannot answer, the cached answer is served stale: during an outage
// an old digest beats a failed pull.
//
// The upstream is always asked with every manifest type pullproxy serves,
// whatever the client's Accept lists, and the manifest stored is what every
// client gets, as a registry hands out what it stores. Asked on behalf of a
// client that accepts only OCI types, some registries (distribution 2.x)
// convert a Docker image's manifest to schema 1, which no client should get.
func (s *Server) resolveTag(ctx context.Context, rt route) (upstream.Descriptor, error) {
	name := rt.up.Name()
	rec, err := s.tags.Tag(ctx, name, rt.repo, rt.ref)
	cached := err == nil
	if err != nil && !errors.Is(err, storage.ErrNotFound) {
		s.log.Warn("reading tag cache", "err", err)
	}
	if cached && (time.Since(rec.CheckedAt) < s.tagTTL || isOffline(rt.up)) {
		return recDescriptor(rec), nil
	}
	key := tagKey(rt)
	if err, ok := s.notFound.get(key); ok {
		return upstream.Descriptor{}, err
	}
	desc, err := s.refreshTag(ctx, rt)
	if err == nil {
		return desc, nil
	}
	if errors.Is(err, upstream.ErrNotFound) {
		s.notFound.put(key, err)
	}
	if cached && !errors.Is(err, upstream.ErrNotFound) && ctx.Err() == nil {
		s.metrics.stale.WithLabelValues(name, "tag").Inc()
		s.log.Warn("upstream failed to revalidate tag: serving the cached digest",
			"upstream", name, "repo", rt.repo, "tag", rt.ref, "digest", rec.Digest,
			"age", time.Since(rec.CheckedAt).Round(time.Second), "err", err)
		return recDescriptor(rec), nil
	}
	return upstream.Descriptor{}, err
}

// refreshTag asks the upstream what rt's tag points to now and records
// the answer, once for every caller asking at the same time.
func (s *Server) refreshTag(ctx context.Context, rt route) (upstream.Descriptor, error) {
	name := rt.up.Name()
	v, err, _ := s.shared(ctx, tagKey(rt), func(ctx context.Context) (any, error) {
		desc, err := s.lookupTag(ctx, rt, allManifestTypes)
		if err != nil {
			return nil, err
		}
		rec := storage.TagRecord{Digest: desc.Digest, MediaType: desc.MediaType, Size: desc.Size, CheckedAt: time.Now()}
		if err := s.tags.PutTag(ctx, name, rt.repo, rt.ref, rec); err != nil {
			s.log.Warn("caching tag", "upstream", name, "repo", rt.repo, "tag", rt.ref, "err", err)
		}
		return desc, nil
	})
	if err != nil {
		return upstream.Descriptor{}, err
	}
	return v.(upstream.Descriptor), nil
}

// tagKey names rt's tag among the lookups shared and the answers
// remembered as not found.
func tagKey(rt route) string { return "tag " + rt.up.Name() + "/" + rt.repo + ":" + rt.ref }

// lookupTag asks the upstream what a tag points to, with a HEAD when the
// upstream names the digest in it, else with a GET whose content is cached.
func (s *Server) lookupTag(ctx context.Context, rt route, accept []string) (upstream.Descriptor, error) {
	desc, err := rt.up.HeadManifest(ctx, rt.repo, rt.ref, accept)
	if err == nil && desc.Digest != "" && isManifestType(desc.MediaType) {
		s.addMember(ctx, rt, desc.Digest)
		return desc, nil
	}
	if err != nil && !errors.Is(err, upstream.ErrInvalid) {
		return desc, err
	}
	desc, body, err := rt.up.GetManifest(ctx, rt.repo, rt.ref, accept)
	if err != nil {
		return desc, err
	}
	if desc.MediaType == "" || desc.MediaType == "application/json" || desc.MediaType == "text/plain" {
		desc.MediaType = sniffMediaType(body)
	}
	return desc, s.putManifest(ctx, rt, desc, body)
}

// manifestContent returns a manifest by digest, from the store or else from
// upstream (verified against the digest, then stored). check says whether a
// stored manifest is to be checked as being in rt's repository.
func (s *Server) manifestContent(ctx context.Context, rt route, d digest.Digest, check bool) (body []byte, mediaType, source string, err error) {
	if body, err := s.manifests.ReadBlob(ctx, d, upstream.MaxManifestSize); err == nil {
		if check {
			if err := s.inRepository(ctx, rt, kindManifest, d); err != nil {
				return nil, "", "", err
			}
		}
		mediaType := ""
		if rec, err := s.manifests.Blob(ctx, d); err == nil {
			mediaType = rec.MediaType
		}
		if mediaType == "" {
			mediaType = sniffMediaType(body)
		}
		return body, mediaType, sourceCache, nil
	} else if !errors.Is(err, storage.ErrNotFound) {
		return nil, "", "", err
	}
	type result struct {
		body      []byte
		mediaType string
	}
	key := "manifest " + rt.up.Name() + "/" + rt.repo + "@" + d.String()
	if err, ok := s.notFound.get(key); ok {
		return nil, "", "", err
	}
	// Per repository: one repository's answer says nothing of another's.
	v, err, _ := s.shared(ctx, key, func(ctx context.Context) (any, error) {
		// By digest the content is fixed whatever the Accept header says;
		// asking for every type keeps registries from converting it.
		desc, body, err := rt.up.GetManifest(ctx, rt.repo, d.String(), allManifestTypes)
		if err != nil {
			return nil, err
		}
		if desc.MediaType == "" || desc.MediaType == "application/json" || desc.MediaType == "text/plain" {
			desc.MediaType = sniffMediaType(body)
		}
		if err := s.putManifest(ctx, rt, desc, body); err != nil {
			return nil, err
		}
		return result{body, desc.MediaType}, nil
	})
	if err != nil {
		if errors.Is(err, upstream.ErrNotFound) {
			s.notFound.put(key, err)
		}
		return nil, "", "", err
	}
	res := v.(result)
	return res.body, res.mediaType, sourceUpstream, nil
}

func (s *Server) putManifest(ctx context.Context, rt route, desc upstream.Descriptor, body []byte) error {
	if err := validateManifest(desc.MediaType, body); err != nil {
		return &upstream.Error{Upstream: rt.up.Name(), Op: "GET /v2/" + rt.repo + "/manifests/" + rt.ref,
			Status: http.StatusOK, Kind: upstream.ErrInvalid, Message: "not cached nor served: " + err.Error()}
	}
	if err := s.manifests.PutBlob(ctx, desc.Digest, body); err != nil {
		return err
	}
	if err := s.manifests.SetDeclaredSizes(ctx, rt.up.Name(), rt.repo, declaredSizes(body)); err != nil {
		s.log.Warn("recording the sizes a manifest declares", "digest", desc.Digest, "err", err)
	}
	s.addMember(ctx, rt, desc.Digest)
	return s.manifests.SetMediaType(ctx, desc.Digest, desc.MediaType)
}

// isManifestType reports whether mediaType is one of an image's manifest
// or index.
func isManifestType(mediaType string) bool {
	switch mediaType {
	case ocispec.MediaTypeImageManifest, ocispec.MediaTypeImageIndex, mediaTypeDockerManifest, mediaTypeDockerList:
		return true
	}
	return false
}

// validateManifest checks that body is a manifest of mediaType that
// clients can use: JSON, schema version 2, one of the four media types of
// images and indexes (what containerd pulls), the one the body names if it
// names one, with a config (a manifest) or a list of manifests (an index).
// Anything else, cached under a tag, would be served as a manifest for as
// long as the tag lives.
func validateManifest(mediaType string, body []byte) error {
	var m struct {
		SchemaVersion int             `json:"schemaVersion"`
		MediaType     string          `json:"mediaType"`
		Config        json.RawMessage `json:"config"`
		Manifests     json.RawMessage `json:"manifests"`
	}
	if err := json.Unmarshal(body, &m); err != nil {
		return fmt.Errorf("the manifest is not a JSON object: %v", err)
	}
	if m.SchemaVersion != 2 {
		return fmt.Errorf("the manifest has schemaVersion %d; only 2 is supported (schema 1 is long deprecated: re-push the image)", m.SchemaVersion)
	}
	if m.MediaType != "" && m.MediaType != mediaType {
		return fmt.Errorf("the manifest says it is %s, the upstream sent it as %s", m.MediaType, mediaType)
	}
	switch mediaType {
	case ocispec.MediaTypeImageManifest, mediaTypeDockerManifest:
		if len(m.Config) == 0 || string(m.Config) == "null" {
			return fmt.Errorf("the %s has no config", mediaType)
		}
	case ocispec.MediaTypeImageIndex, mediaTypeDockerList:
		if len(m.Manifests) == 0 || string(m.Manifests) == "null" {
			return fmt.Errorf("the %s lists no manifests", mediaType)
		}
	default:
		return fmt.Errorf("media type %q is not a manifest's", mediaType)
	}
	return nil
}

// declaredSizes lists the sizes a manifest or index declares for what it
// references: its config and layers, or its manifests.
func declaredSizes(body []byte) map[digest.Digest]int64 {
	var m struct {
		Config    *ocispec.Descriptor  `json:"config"`
		Layers    []ocispec.Descriptor `json:"layers"`
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if json.Unmarshal(body, &m) != nil {
		return nil
	}
	out := map[digest.Digest]int64{}
	descs := append(m.Layers, m.Manifests...)
	if m.Config != nil {
		descs = append(descs, *m.Config)
	}
	for _, d := range descs {
		if d.Digest.Validate() == nil && d.Size >= 0 {
			out[d.Digest] = d.Size
		}
	}
	return out
}

// shared runs fn once for all concurrent callers with the same key, on a
// context of the server's: one caller hanging up does not fail the others.
func (s *Server) shared(ctx context.Context, key string, fn func(context.Context) (any, error)) (any, error, bool) {
	ch := s.resolving.DoChan(key, func() (any, error) {
		fctx, cancel := context.WithTimeout(s.ctx, upstreamTimeout)
		defer cancel()
		return fn(fctx)
	})
	select {
	case res := <-ch:
		return res.Val, res.Err, res.Shared
	case <-ctx.Done():
		return nil, ctx.Err(), false
	}
}

func recDescriptor(rec storage.TagRecord) upstream.Descriptor {
	return upstream.Descriptor{Digest: rec.Digest, MediaType: rec.MediaType, Size: rec.Size}
}

// sniffMediaType reads a manifest's media type from its content, for
// upstreams that send none.
func sniffMediaType(body []byte) string {
	var m struct {
		MediaType string          `json:"mediaType"`
		Manifests json.RawMessage `json:"manifests"`
	}
	if json.Unmarshal(body, &m) == nil && m.MediaType != "" {
		return m.MediaType
	}
	if m.Manifests != nil {
		return ocispec.MediaTypeImageIndex
	}
	return ocispec.MediaTypeImageManifest
}
