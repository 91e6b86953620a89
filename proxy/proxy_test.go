package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// TestRegistryAPI walks the read side of the distribution API through the
// proxy against a real registry: routing, headers, ranges and errors.
func TestRegistryAPI(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 300_000, 2)
	manifest, err := img.RawManifest()
	if err != nil {
		t.Fatal(err)
	}
	mdig, _ := img.Digest()
	mt, _ := img.MediaType()
	layer, layerBytes := layerDigest(t, img, 0)
	size := len(layerBytes)
	ns := "?ns=" + upstreamName
	accept := http.Header{"Accept": {string(mt), "application/vnd.oci.image.index.v1+json"}}

	for _, tc := range []struct {
		name, method, path string
		header             http.Header
		status             int
		code               string // OCI error code, for errors
		body               []byte // exact body, when set
		headers            map[string]string
	}{
		{name: "ping", method: "GET", path: "/v2/", status: 200},
		{name: "head manifest by tag", method: "HEAD", path: "/v2/test/app/manifests/v1" + ns, header: accept, status: 200,
			headers: map[string]string{"Docker-Content-Digest": mdig.String(), "Content-Length": strconv.Itoa(len(manifest)), "Content-Type": string(mt)}},
		{name: "get manifest by tag", method: "GET", path: "/v2/test/app/manifests/v1" + ns, header: accept, status: 200, body: manifest,
			headers: map[string]string{"Docker-Content-Digest": mdig.String()}},
		{name: "get manifest by digest", method: "GET", path: "/v2/test/app/manifests/" + mdig.String() + ns, status: 200, body: manifest},
		{name: "ns url-encoded with port style name", method: "HEAD", path: "/v2/test/app/manifests/v1?ns=registry.test", status: 200},
		{name: "path prefix (CRI-O)", method: "GET", path: "/v2/" + upstreamName + "/test/app/manifests/v1", status: 200, body: manifest},
		{name: "cold blob range", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns,
			header: http.Header{"Range": {"bytes=10-19"}}, status: 206, body: layerBytes[10:20],
			headers: map[string]string{"Content-Range": fmt.Sprintf("bytes 10-19/%d", size), "Content-Length": "10"}},
		{name: "blob", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns, status: 200, body: layerBytes,
			headers: map[string]string{"Content-Length": strconv.Itoa(size), "Docker-Content-Digest": layer.String()}},
		{name: "stored blob", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns, status: 200, body: layerBytes,
			headers: map[string]string{"Content-Length": strconv.Itoa(size), "Docker-Content-Digest": layer.String(),
				"Etag": `"` + layer.String() + `"`, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
				"Cache-Control": "max-age=31536000", "Docker-Distribution-API-Version": "registry/2.0"}},
		{name: "head blob", method: "HEAD", path: "/v2/test/app/blobs/" + layer.String() + ns, status: 200,
			headers: map[string]string{"Content-Length": strconv.Itoa(size), "Etag": `"` + layer.String() + `"`}},
		{name: "stored blob if-none-match", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns,
			header: http.Header{"If-None-Match": {`"` + layer.String() + `"`}}, status: 304, body: []byte{}},
		{name: "stored blob if-none-match other", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns,
			header: http.Header{"If-None-Match": {`"sha256:` + strings.Repeat("0", 64) + `"`}}, status: 200, body: layerBytes},
		{name: "stored blob range", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns,
			header: http.Header{"Range": {"bytes=10-19"}}, status: 206, body: layerBytes[10:20],
			headers: map[string]string{"Content-Range": fmt.Sprintf("bytes 10-19/%d", size), "Content-Length": "10"}},
		{name: "blob open range", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns,
			header: http.Header{"Range": {"bytes=1000-"}}, status: 206, body: layerBytes[1000:],
			headers: map[string]string{"Content-Range": fmt.Sprintf("bytes 1000-%d/%d", size-1, size)}},
		{name: "blob suffix range", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns,
			header: http.Header{"Range": {"bytes=-5"}}, status: 206, body: layerBytes[size-5:]},
		{name: "blob unsatisfiable range", method: "GET", path: "/v2/test/app/blobs/" + layer.String() + ns,
			header: http.Header{"Range": {fmt.Sprintf("bytes=%d-", size)}}, status: 416},
		{name: "unconfigured ns refused", method: "GET", path: "/v2/test/app/manifests/v1?ns=evil.example", status: 404, code: "NAME_UNKNOWN"},
		{name: "no default upstream", method: "GET", path: "/v2/test/app/manifests/v1", status: 404, code: "NAME_UNKNOWN"},
		{name: "unknown tag", method: "GET", path: "/v2/test/app/manifests/nope" + ns, status: 404, code: "MANIFEST_UNKNOWN"},
		{name: "unknown blob", method: "GET", path: "/v2/test/app/blobs/sha256:" + strings.Repeat("0", 64) + ns, status: 404, code: "BLOB_UNKNOWN"},
		{name: "invalid digest", method: "GET", path: "/v2/test/app/blobs/sha256:abc" + ns, status: 400, code: "DIGEST_INVALID"},
		{name: "invalid name", method: "GET", path: "/v2/Test/App/manifests/v1" + ns, status: 400, code: "NAME_INVALID"},
		{name: "push refused", method: "PUT", path: "/v2/test/app/manifests/v2" + ns, status: 405, code: "UNSUPPORTED"},
		{name: "upload refused", method: "POST", path: "/v2/test/app/blobs/uploads/" + ns, status: 405, code: "UNSUPPORTED"},
		{name: "delete refused", method: "DELETE", path: "/v2/test/app/blobs/" + layer.String() + ns, status: 405, code: "UNSUPPORTED"},
		{name: "write to the base refused", method: "PUT", path: "/v2/", status: 405, code: "UNSUPPORTED"},
		{name: "write to the base without slash refused", method: "POST", path: "/v2", status: 405, code: "UNSUPPORTED"},
	} {
		// Sequential: later cases rely on what earlier ones cached.
		resp, body := e.get(tc.method, tc.path, tc.header)
		if resp.StatusCode != tc.status {
			t.Errorf("%s: status %d, want %d (body %s)", tc.name, resp.StatusCode, tc.status, body)
			continue
		}
		if resp.Header.Get("Content-Length") == "" && tc.method != "HEAD" && tc.status != http.StatusNotModified {
			t.Errorf("%s: no Content-Length", tc.name)
		}
		if tc.body != nil && !bytes.Equal(body, tc.body) {
			t.Errorf("%s: body of %d bytes differs from the %d expected", tc.name, len(body), len(tc.body))
		}
		for k, v := range tc.headers {
			if got := resp.Header.Get(k); got != v {
				t.Errorf("%s: %s %q, want %q", tc.name, k, got, v)
			}
		}
		if tc.code != "" {
			var oe struct {
				Errors []struct{ Code, Message string }
			}
			if err := json.Unmarshal(body, &oe); err != nil || len(oe.Errors) == 0 {
				t.Errorf("%s: body %q is not OCI error JSON", tc.name, body)
			} else if oe.Errors[0].Code != tc.code {
				t.Errorf("%s: code %s, want %s (%s)", tc.name, oe.Errors[0].Code, tc.code, oe.Errors[0].Message)
			}
		}
	}
	if n := e.counter.count("bytes " + layer.String()); n != size {
		t.Errorf("upstream bytes of the layer: got %d, want %d (fetched once)", n, size)
	}
}

// TestUnknownManifestNamesUpstream checks that an upstream's 404 reaches the
// client with a message saying where it came from.
func TestUnknownManifestNamesUpstream(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, body := e.get("GET", "/v2/test/missing/manifests/v1?ns="+upstreamName, nil)
	if !strings.Contains(string(body), "upstream "+upstreamName) || !strings.Contains(string(body), "/v2/test/missing/manifests/v1: 404") {
		t.Errorf("error body %s does not name the upstream and the request", body)
	}
}

// TestDefaultUpstream routes requests that name no upstream (Docker's
// registry-mirrors) to the configured default.
func TestDefaultUpstream(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithDefaultUpstream(upstreamName))
	e.push("test/app", "v1", 1000, 1)
	resp, body := e.get("GET", "/v2/test/app/manifests/v1", nil)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d, want 200: %s", resp.StatusCode, body)
	}
}

// TestBaseWithoutSlash: /v2 answers as /v2/ does, without a redirect.
func TestBaseWithoutSlash(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, m := range []string{http.MethodGet, http.MethodHead} {
		req, err := http.NewRequest(m, e.proxy.URL+"/v2", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultTransport.RoundTrip(req) // follows no redirect
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Docker-Distribution-API-Version") != "registry/2.0" {
			t.Errorf("%s /v2: %d, %v; want 200 as for /v2/", m, resp.StatusCode, resp.Header)
		}
	}
}
