package proxy

import (
	"encoding/json"
	"io"
	"log"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// rawManifest is a manifest to push as it is.
type rawManifest struct {
	body      []byte
	mediaType types.MediaType
}

func (m rawManifest) RawManifest() ([]byte, error)        { return m.body, nil }
func (m rawManifest) MediaType() (types.MediaType, error) { return m.mediaType, nil }

// pushArtifact pushes to repo, by digest, an artifact of artifactType
// (a signature, an SBOM) whose subject is subject, and returns it.
func (e *env) pushArtifact(repo string, subject ocispec.Descriptor, artifactType, content string) ocispec.Descriptor {
	e.t.Helper()
	repoRef := e.ref(repo + ":x").Context()
	layer := static.NewLayer([]byte(content), types.MediaType("application/octet-stream"))
	// The config's media type says the artifact's type too, for registries
	// that read it from there (go-containerregistry's does).
	cfg := static.NewLayer([]byte("{}"), types.MediaType(artifactType))
	desc := func(l v1.Layer) ocispec.Descriptor {
		h, _ := l.Digest()
		n, _ := l.Size()
		mt, _ := l.MediaType()
		return ocispec.Descriptor{MediaType: string(mt), Digest: digest.Digest(h.String()), Size: n}
	}
	if err := remote.WriteLayer(repoRef, layer); err != nil {
		e.t.Fatal(err)
	}
	if err := remote.WriteLayer(repoRef, cfg); err != nil {
		e.t.Fatal(err)
	}
	m := ocispec.Manifest{
		MediaType:    ocispec.MediaTypeImageManifest,
		ArtifactType: artifactType,
		Config:       desc(cfg),
		Layers:       []ocispec.Descriptor{desc(layer)},
		Subject:      &subject,
	}
	m.SchemaVersion = 2
	body, err := json.Marshal(m)
	if err != nil {
		e.t.Fatal(err)
	}
	d := digest.FromBytes(body)
	if err := remote.Put(e.ref(repo+"@"+d.String()), rawManifest{body, types.OCIManifestSchema1}); err != nil {
		e.t.Fatal(err)
	}
	return ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: artifactType, Digest: d, Size: int64(len(body))}
}

type referrersIndex struct {
	SchemaVersion int                  `json:"schemaVersion"`
	MediaType     string               `json:"mediaType"`
	Manifests     []ocispec.Descriptor `json:"manifests"`
}

func (e *env) referrers(path string) (*http.Response, referrersIndex) {
	e.t.Helper()
	resp, body := e.get(http.MethodGet, path, nil)
	var idx referrersIndex
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(body, &idx); err != nil {
			e.t.Fatalf("%s: %q is no image index: %v", path, body, err)
		}
	}
	return resp, idx
}

func artifactTypes(idx referrersIndex) string {
	var out []string
	for _, m := range idx.Manifests {
		out = append(out, m.ArtifactType)
	}
	return strings.Join(out, ",")
}

// TestReferrers: GET /v2/<name>/referrers/<digest> answers the upstream's
// referrers as an image index, filtered by artifactType with
// OCI-Filters-Applied, from the store while fresh and when the upstream
// fails; the referrers it lists are then served under the repository.
func TestReferrers(t *testing.T) {
	t.Parallel()
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithReferrersSupport(true))
	e := newEnvRegistry(t, reg, WithTagTTL(time.Hour))
	img := e.push("test/app", "v1", 100, 1)
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	n, _ := img.Size()
	subject := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.Digest(d.String()), Size: n}
	sig := e.pushArtifact("test/app", subject, "application/vnd.example.signature", "signed")
	e.pushArtifact("test/app", subject, "application/vnd.example.sbom", "sbom")
	ns := "?ns=" + upstreamName
	path := "/v2/test/app/referrers/" + subject.Digest.String() + ns

	resp, idx := e.referrers(path)
	if resp.StatusCode != http.StatusOK || idx.SchemaVersion != 2 || idx.MediaType != ocispec.MediaTypeImageIndex ||
		len(idx.Manifests) != 2 || resp.Header.Get("Content-Type") != ocispec.MediaTypeImageIndex {
		t.Fatalf("referrers: %d %s %+v", resp.StatusCode, resp.Header.Get("Content-Type"), idx)
	}
	if resp.Header.Get("OCI-Filters-Applied") != "" {
		t.Errorf("unfiltered answer says OCI-Filters-Applied: %q", resp.Header.Get("OCI-Filters-Applied"))
	}
	resp, idx = e.referrers(path + "&artifactType=application/vnd.example.signature")
	if got := artifactTypes(idx); got != sig.ArtifactType || idx.Manifests[0].Digest != sig.Digest ||
		resp.Header.Get("OCI-Filters-Applied") != "artifactType" {
		t.Errorf("filtered: %q (%v), OCI-Filters-Applied %q", got, idx.Manifests, resp.Header.Get("OCI-Filters-Applied"))
	}
	if resp, idx := e.referrers(path + "&artifactType=application/vnd.example.none"); resp.StatusCode != 200 ||
		idx.Manifests == nil || len(idx.Manifests) != 0 {
		t.Errorf("filtered to nothing: %d %+v, want an empty manifests list", resp.StatusCode, idx)
	}
	// The signature, listed in test/app, is served there by digest.
	if resp, body := e.get("GET", "/v2/test/app/manifests/"+sig.Digest.String()+ns, nil); resp.StatusCode != 200 ||
		digest.FromBytes(body) != sig.Digest {
		t.Errorf("the listed signature: %d", resp.StatusCode)
	}
	asked := e.counter.count("GET " + subject.Digest.String())
	e.referrers(path)
	if got := e.counter.count("GET " + subject.Digest.String()); got != asked {
		t.Errorf("a fresh answer asked the upstream again: %d requests, then %d", asked, got)
	}
	if resp, idx := e.referrers("/v2/test/app/referrers/" + digest.FromString("none").String() + ns); resp.StatusCode != 200 || len(idx.Manifests) != 0 {
		t.Errorf("a subject without referrers: %d %+v, want 200 and none", resp.StatusCode, idx)
	}
	if resp, _ := e.get("GET", "/v2/test/app/referrers/sha256:nothex"+ns, nil); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("an invalid digest: %d, want 400", resp.StatusCode)
	}

	// The upstream down, every answer due for revalidation: served stale.
	e.counter.down.Store(true)
	e.stop()
	e.start(e.upstream.URL, WithTagTTL(0))
	resp, idx = e.referrers(path + "&artifactType=application/vnd.example.sbom")
	if resp.StatusCode != 200 || artifactTypes(idx) != "application/vnd.example.sbom" {
		t.Errorf("upstream down: %d %+v, want the cached referrers", resp.StatusCode, idx)
	}
	if got := testutil.ToFloat64(e.srv.metrics.stale.WithLabelValues(upstreamName, "referrers")); got != 1 {
		t.Errorf("stale referrers counted: %v, want 1", got)
	}
}

// TestReferrersFromTagSchema: in front of an upstream without the
// referrers API, pullproxy answers from the subject's tag-schema index
// (sha256-<hex>), where clients put referrers for such registries, online
// and offline; a subject without one has no referrers. The tag itself is
// served as any tag, for clients that fall back on their own.
func TestReferrersFromTagSchema(t *testing.T) {
	t.Parallel()
	e := newEnv(t) // go-containerregistry's registry, referrers API off
	img := e.push("test/app", "v1", 100, 1)
	d, _ := img.Digest()
	n, _ := img.Size()
	subject := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.Digest(d.String()), Size: n}
	sig := e.pushArtifact("test/app", subject, "application/vnd.example.signature", "signed")
	idx, _ := json.Marshal(ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{sig}})
	schemaTag := strings.Replace(subject.Digest.String(), ":", "-", 1)
	if err := remote.Put(e.ref("test/app:"+schemaTag), rawManifest{idx, types.OCIImageIndex}); err != nil {
		t.Fatal(err)
	}
	ns := "?ns=" + upstreamName
	path := "/v2/test/app/referrers/" + subject.Digest.String() + ns
	for _, down := range []bool{false, true} {
		if down { // offline: the upstream's answer is remembered
			e.counter.down.Store(true)
			e.stop()
			e.start(e.upstream.URL, WithTagTTL(0))
		}
		resp, got := e.referrers(path + "&artifactType=" + sig.ArtifactType)
		if resp.StatusCode != 200 || len(got.Manifests) != 1 || got.Manifests[0].Digest != sig.Digest {
			t.Errorf("down=%v: referrers: %d %+v, want the signature", down, resp.StatusCode, got)
		}
		resp, body := e.get("GET", "/v2/test/app/manifests/"+schemaTag+ns, nil)
		if resp.StatusCode != 200 || !strings.Contains(string(body), sig.Digest.String()) {
			t.Errorf("down=%v: the tag-schema index: %d %s", down, resp.StatusCode, body)
		}
	}
	e.counter.down.Store(false)
	if resp, got := e.referrers("/v2/test/app/referrers/" + sig.Digest.String() + ns); resp.StatusCode != 200 || len(got.Manifests) != 0 {
		t.Errorf("a subject without a tag-schema index: %d %+v, want 200 and none", resp.StatusCode, got)
	}
	if resp, body := e.get("GET", "/v2/test/nope/referrers/"+sig.Digest.String()+ns, nil); resp.StatusCode != 404 ||
		!strings.Contains(string(body), "NAME_UNKNOWN") {
		t.Errorf("an unknown repository: %d %s, want 404 NAME_UNKNOWN", resp.StatusCode, body)
	}
}
