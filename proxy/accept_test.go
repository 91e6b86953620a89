package proxy

import (
	"bytes"
	"net/http"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
)

// schema1Converter answers a manifest request whose Accept does not list
// Docker's schema 2 with a schema 1 manifest, as distribution 2.x converts
// a Docker image for such a client; always, when only is set, as a
// registry does that holds nothing else.
type schema1Converter struct {
	next http.Handler
	only bool
}

const schema1Body = `{"schemaVersion":1,"name":"test/app","tag":"v1","architecture":"amd64","fsLayers":[],"history":[]}`

func (c schema1Converter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead || !strings.Contains(r.URL.Path, "/manifests/") ||
		!c.only && strings.Contains(strings.Join(r.Header.Values("Accept"), ","), mediaTypeDockerManifest) {
		c.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/vnd.docker.distribution.manifest.v1+prettyjws")
	w.Header().Set("Docker-Content-Digest", digest.FromString(schema1Body).String())
	if r.Method != http.MethodHead {
		w.Write([]byte(schema1Body))
	}
}

// TestClientAcceptingOnlyOCITypes: a client that lists only the OCI types
// (the OCI conformance suite) gets the manifest pullproxy stores, as from a
// registry, not an upstream's conversion to schema 1; schema 1 is refused
// only when the upstream has nothing else, with the cause in the status line.
func TestClientAcceptingOnlyOCITypes(t *testing.T) {
	t.Parallel()
	ociOnly := http.Header{"Accept": {"application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json"}}
	path := "/v2/test/app/manifests/v1?ns=" + upstreamName

	t.Run("upstream converts", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.counter.next = schema1Converter{next: e.counter.next}
		img := e.push("test/app", "v1", 1000, 1)
		want, _ := img.RawManifest()
		mt, _ := img.MediaType()
		for _, method := range []string{"HEAD", "GET", "GET"} {
			resp, body := e.get(method, path, ociOnly)
			if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != string(mt) ||
				method == "GET" && !bytes.Equal(body, want) {
				t.Fatalf("%s: %s, %s, %s", method, resp.Status, resp.Header.Get("Content-Type"), body)
			}
		}
	})
	t.Run("upstream has only schema 1", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		e.counter.next = schema1Converter{next: e.counter.next, only: true}
		resp, body := e.get("GET", path, nil)
		if resp.StatusCode != http.StatusBadGateway || !strings.Contains(resp.Status, "schemaVersion 1") ||
			!strings.Contains(string(body), "re-push the image") {
			t.Errorf("got %q %s, want 502 naming schema 1", resp.Status, body)
		}
	})
}
