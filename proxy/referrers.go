package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// serveReferrers answers GET /v2/<name>/referrers/<digest>: the manifests
// that name the digest as their subject (signatures, SBOMs, attestations),
// as an image index. The upstream's answer is kept per upstream,
// repository and subject, like a tag: served from the store while younger
// than the tag TTL, served stale (and counted) when the upstream cannot
// answer. It is kept whole and filtered here, so that every artifactType
// a client asks for is answered from one upstream request.
//
// For an upstream without the referrers API, pullproxy answers from the
// subject's tag-schema index (tag sha256-<hex>), where clients that find
// no referrers API put the referrers they push: what a client would find
// by falling back itself, and pullproxy's clients see one API whatever
// the upstream.
func (s *Server) serveReferrers(w http.ResponseWriter, r *http.Request, rt route) {
	subject := digest.Digest(rt.ref) // validated by resolve
	rec, source, err := s.referrers(r.Context(), rt, subject)
	if err != nil {
		s.fail(w, r, rt, err)
		return
	}
	setSource(w, source)
	manifests := rec.Manifests
	h := w.Header()
	if want := r.URL.Query().Get("artifactType"); want != "" {
		manifests = filterArtifactType(manifests, want)
		h.Set("OCI-Filters-Applied", "artifactType")
	}
	if manifests == nil {
		manifests = []json.RawMessage{}
	}
	body, err := json.Marshal(struct {
		SchemaVersion int               `json:"schemaVersion"`
		MediaType     string            `json:"mediaType"`
		Manifests     []json.RawMessage `json:"manifests"`
	}{2, ocispec.MediaTypeImageIndex, manifests})
	if err != nil {
		s.fail(w, r, rt, err)
		return
	}
	h.Set("Content-Type", ocispec.MediaTypeImageIndex)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		w.Write(body)
	}
}

// referrers returns rt's upstream's referrers of subject, from the store
// while fresh, else from the upstream (one request however many clients
// ask).
func (s *Server) referrers(ctx context.Context, rt route, subject digest.Digest) (storage.ReferrersRecord, string, error) {
	name := rt.up.Name()
	rec, err := s.tags.Referrers(ctx, name, rt.repo, subject)
	cached := err == nil
	if err != nil && !errors.Is(err, storage.ErrNotFound) {
		s.log.Warn("reading the referrers cache", "err", err)
	}
	if cached && (time.Since(rec.CheckedAt) < s.tagTTL || isOffline(rt.up)) {
		return rec, sourceCache, nil
	}
	if o, ok := rt.up.(offlineUpstream); ok {
		// Not "no referrers": the tag schema's fallback below would say so.
		return storage.ReferrersRecord{}, "", o.miss(rt.repo, "the referrers of "+subject.String())
	}
	v, err, _ := s.shared(ctx, "referrers "+name+"/"+rt.repo+"@"+subject.String(), func(ctx context.Context) (any, error) {
		rec := storage.ReferrersRecord{CheckedAt: time.Now()}
		manifests, err := rt.up.Referrers(ctx, rt.repo, subject)
		var ue *upstream.Error
		if errors.Is(err, upstream.ErrNotFound) && !(errors.As(err, &ue) && ue.Code == "NAME_UNKNOWN") {
			// No referrers API there (an unknown repository is its own 404).
			rec.TagSchema = true
			manifests, err = s.tagSchemaReferrers(ctx, rt, subject)
		}
		if err != nil {
			return nil, err
		}
		rec.Manifests = manifests
		// The upstream lists them in this repository: clients fetch them
		// next, by digest, under this name.
		if ds := referrerDigests(manifests); len(ds) > 0 {
			if err := s.members.AddMembers(ctx, name, rt.repo, ds...); err != nil {
				s.log.Warn("recording referrers as the repository's", "upstream", name, "repo", rt.repo, "err", err)
			}
		}
		if err := s.tags.PutReferrers(ctx, name, rt.repo, subject, rec); err != nil {
			s.log.Warn("caching referrers", "upstream", name, "repo", rt.repo, "subject", subject, "err", err)
		}
		return rec, nil
	})
	if err == nil {
		return v.(storage.ReferrersRecord), sourceUpstream, nil
	}
	if cached && !errors.Is(err, upstream.ErrNotFound) && ctx.Err() == nil {
		s.metrics.stale.WithLabelValues(name, "referrers").Inc()
		s.log.Warn("upstream failed to list referrers: serving the cached list", "upstream", name, "repo", rt.repo,
			"subject", subject, "age", time.Since(rec.CheckedAt).Round(time.Second), "err", err)
		return rec, sourceCache, nil
	}
	return storage.ReferrersRecord{}, "", err
}

// tagSchemaReferrers reads subject's referrers from its tag-schema index
// upstream: the image index tagged <alg>-<encoded> (each truncated as the
// distribution spec says). No such tag: no referrers.
func (s *Server) tagSchemaReferrers(ctx context.Context, rt route, subject digest.Digest) ([]json.RawMessage, error) {
	alg, enc := string(subject.Algorithm()), subject.Encoded()
	tag := alg[:min(len(alg), 32)] + "-" + enc[:min(len(enc), 64)]
	_, body, err := rt.up.GetManifest(ctx, rt.repo, tag, []string{ocispec.MediaTypeImageIndex})
	var ue *upstream.Error
	if errors.Is(err, upstream.ErrNotFound) && !(errors.As(err, &ue) && ue.Code == "NAME_UNKNOWN") {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var index struct {
		Manifests []json.RawMessage `json:"manifests"`
	}
	if err := json.Unmarshal(body, &index); err != nil {
		return nil, &upstream.Error{Upstream: rt.up.Name(), Op: "GET /v2/" + rt.repo + "/manifests/" + tag,
			Status: http.StatusOK, Kind: upstream.ErrInvalid, Message: "the tag-schema index of " + subject.String() + " is not an image index: " + err.Error()}
	}
	return index.Manifests, nil
}

// filterArtifactType keeps the descriptors whose artifactType is want.
func filterArtifactType(manifests []json.RawMessage, want string) []json.RawMessage {
	var out []json.RawMessage
	for _, m := range manifests {
		var d struct {
			ArtifactType string `json:"artifactType"`
		}
		if json.Unmarshal(m, &d) == nil && d.ArtifactType == want {
			out = append(out, m)
		}
	}
	return out
}

// referrerDigests returns the digests the descriptors name.
func referrerDigests(manifests []json.RawMessage) []digest.Digest {
	var out []digest.Digest
	for _, m := range manifests {
		var d struct {
			Digest digest.Digest `json:"digest"`
		}
		if json.Unmarshal(m, &d) == nil && d.Digest.Validate() == nil {
			out = append(out, d.Digest)
		}
	}
	return out
}
