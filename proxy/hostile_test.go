package proxy

import (
	"net/http"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
)

// junkManifests serves, for the tag junk and by its digest, a body that is
// not a manifest, and passes everything else to next.
type junkManifests struct {
	next        http.Handler
	body        string
	contentType string
}

func (j *junkManifests) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !strings.HasSuffix(r.URL.Path, "/manifests/junk") && !strings.HasSuffix(r.URL.Path, "/manifests/"+digest.FromString(j.body).String()) {
		j.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set("Content-Type", j.contentType)
	w.Header().Set("Docker-Content-Digest", digest.FromString(j.body).String())
	w.Write([]byte(j.body))
}

// TestInvalidManifestIsNotCached: what an upstream serves under a tag is
// cached and served only if it is a manifest a client can use.
func TestInvalidManifestIsNotCached(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, body, contentType, says string
	}{
		{"not JSON", "<html>hello</html>", "text/plain", "not a JSON object"},
		{"JSON, not a manifest", `{"hello":"world"}`, "application/json", "schemaVersion 0"},
		{"media types disagree", `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}`,
			"application/vnd.oci.image.manifest.v1+json", "says it is"},
		{"schema 1", `{"schemaVersion":1,"name":"a","tag":"junk"}`, "application/vnd.docker.distribution.manifest.v1+prettyjws", "schemaVersion 1"},
		{"manifest without config", `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","layers":[]}`,
			"application/vnd.oci.image.manifest.v1+json", "no config"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			e.counter.next = &junkManifests{next: e.counter.next, body: tt.body, contentType: tt.contentType}
			for i := range 2 {
				resp, body := e.get("GET", "/v2/test/app/manifests/junk?ns="+upstreamName, nil)
				if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), tt.says) {
					t.Fatalf("GET %d: got %d %s, want 502 saying %q", i, resp.StatusCode, body, tt.says)
				}
			}
			if _, err := e.store.StatBlob(t.Context(), digest.FromString(tt.body)); err == nil {
				t.Error("the invalid manifest was stored")
			}
		})
	}
}

// headRefuser answers every HEAD with status (405 or 501), as some
// registries and proxies in front of them do.
type headRefuser struct {
	next   http.Handler
	status int
}

func (h headRefuser) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodHead {
		w.WriteHeader(h.status)
		return
	}
	h.next.ServeHTTP(w, r)
}

// TestUpstreamRefusingHead: HEADs of a tag and of a cold blob are answered,
// through GETs, when the upstream refuses HEAD.
func TestUpstreamRefusingHead(t *testing.T) {
	t.Parallel()
	for _, status := range []int{http.StatusMethodNotAllowed, http.StatusNotImplemented} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			img := e.push("test/app", "v1", 50_000, 1)
			layer, content := layerDigest(t, img, 0)
			e.counter.next = headRefuser{next: e.counter.next, status: status}
			ns := "?ns=" + upstreamName
			resp, _ := e.get("HEAD", "/v2/test/app/manifests/v1"+ns, nil)
			if resp.StatusCode != http.StatusOK || resp.Header.Get("Docker-Content-Digest") == "" {
				t.Errorf("HEAD of the tag: got %d, digest %q", resp.StatusCode, resp.Header.Get("Docker-Content-Digest"))
			}
			resp, _ = e.get("HEAD", "/v2/test/app/blobs/"+layer.String()+ns, nil)
			if resp.StatusCode != http.StatusOK || resp.ContentLength != int64(len(content)) {
				t.Errorf("HEAD of a cold blob: got %d, Content-Length %d; want 200, %d", resp.StatusCode, resp.ContentLength, len(content))
			}
		})
	}
}

// strictManifests refuses the tag strict with 400 MANIFEST_INVALID, as a
// registry refuses a manifest list to a client accepting only OCI types.
type strictManifests struct{ next http.Handler }

func (s strictManifests) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !strings.HasSuffix(r.URL.Path, "/manifests/strict") {
		s.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusBadRequest)
	w.Write([]byte(`{"errors":[{"code":"MANIFEST_INVALID","message":"manifest invalid: OCI index only"}]}`))
}

// TestUpstreamRefusalPassesThrough: an upstream's 4xx for a manifest
// reaches the client as that 4xx with its OCI code, not as a 502.
func TestUpstreamRefusalPassesThrough(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.counter.next = strictManifests{next: e.counter.next}
	resp, body := e.get("GET", "/v2/test/app/manifests/strict?ns="+upstreamName,
		http.Header{"Accept": {"application/vnd.oci.image.manifest.v1+json"}})
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "MANIFEST_INVALID") {
		t.Errorf("got %d %s, want 400 MANIFEST_INVALID", resp.StatusCode, body)
	}
}

// TestManifestNotModified: a manifest asked with its current entity tag
// in If-None-Match is 304.
func TestManifestNotModified(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.push("test/app", "v1", 100, 1)
	path := "/v2/test/app/manifests/v1?ns=" + upstreamName
	resp, _ := e.get("GET", path, nil)
	etag := resp.Header.Get("Etag")
	if resp.StatusCode != http.StatusOK || etag == "" {
		t.Fatalf("got %d, ETag %q", resp.StatusCode, etag)
	}
	if resp, body := e.get("GET", path, http.Header{"If-None-Match": {etag}}); resp.StatusCode != http.StatusNotModified || len(body) != 0 {
		t.Errorf("If-None-Match %s: got %d, %d bytes; want 304, none", etag, resp.StatusCode, len(body))
	}
	if resp, _ := e.get("GET", path, http.Header{"If-None-Match": {`"sha256:0"`}}); resp.StatusCode != http.StatusOK {
		t.Errorf("If-None-Match of another: got %d, want 200", resp.StatusCode)
	}
}
