package proxy

import (
	"encoding/json"
	"log/slog"
	"net/url"
	"path"
	"regexp"
	"testing"

	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// Fuzz tests of what the proxy reads from clients. Their corpora are under
// testdata/fuzz; `make fuzz` runs each briefly, and CI runs it.

// fuzzServer is a Server with one upstream, registry.test (the default
// too), whose endpoint nothing listens at: resolve never reaches it.
func fuzzServer(f *testing.F) *Server {
	f.Helper()
	st, err := storage.Open(f.Context(), f.TempDir(), storage.WithLogger(discard))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { st.Close() })
	up, err := upstream.New(upstreamName, []string{"http://127.0.0.1:9"}, upstream.WithLogger(discard))
	if err != nil {
		f.Fatal(err)
	}
	s, err := New(WithStore(st), WithUpstream(up), WithDefaultUpstream(upstreamName), WithLogger(discard))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { s.Close() })
	return s
}

var discard = slog.New(slog.DiscardHandler)

var anchoredName = regexp.MustCompile(`^` + reference.NameRegexp.String() + `$`)

// FuzzResolve: a request path and ns either resolve to a valid repository
// name, kind and reference, or are refused: never anything in between.
func FuzzResolve(f *testing.F) {
	s := fuzzServer(f)
	for _, seed := range [][2]string{
		{"/v2/library/alpine/manifests/3.20", "docker.io"},
		{"/v2/test/app/blobs/sha256:" + digest.FromString("x").Encoded(), upstreamName},
		{"/v2/registry.test/org/app/manifests/latest", ""},
		{"/v2/a/manifests/blobs/manifests/v1", ""},
		{"/v2/../../etc/passwd/blobs/sha256:0", ""},
		{"/v2/A/manifests/%2e%2e", ""},
		{"/v2/x/blobs/sha512:" + digest.SHA512.FromString("x").Encoded(), ""},
	} {
		f.Add(seed[0], seed[1])
	}
	f.Fuzz(func(t *testing.T, p, ns string) {
		rt, err := s.resolve("GET", p, ns)
		if err != nil {
			return
		}
		switch {
		case rt.up == nil:
			t.Fatal("resolved without an upstream")
		case rt.kind != kindManifest && rt.kind != kindBlob:
			t.Fatalf("kind %q", rt.kind)
		case !anchoredName.MatchString(rt.repo):
			t.Fatalf("repository %q is not a valid name", rt.repo)
		case path.Clean("/"+rt.repo) != "/"+rt.repo:
			t.Fatalf("repository %q is not a clean path", rt.repo)
		}
		if _, err := digest.Parse(rt.ref); err != nil && (rt.kind == kindBlob || !tagPattern.MatchString(rt.ref)) {
			t.Fatalf("%s reference %q is neither a tag nor a digest: %v", rt.kind, rt.ref, err)
		}
	})
}

// FuzzQueryValue: the ns parameter is read as net/http reads it.
func FuzzQueryValue(f *testing.F) {
	for _, q := range []string{"ns=docker.io", "ns=myregistry.io%3A5000", "a=1&ns=x&ns=y", "ns", "ns=a=b", "ns=%zz", "n%73=x", "ns=a+b;c"} {
		f.Add(q)
	}
	f.Fuzz(func(t *testing.T, q string) {
		v, _ := url.ParseQuery(q)
		if got, want := queryValue(q, "ns"), v.Get("ns"); got != want {
			t.Fatalf("queryValue(%q) = %q, net/url reads %q", q, got, want)
		}
	})
}

// FuzzParseByteRange: a range, when taken, lies inside the blob.
func FuzzParseByteRange(f *testing.F) {
	for _, h := range []string{"bytes=0-", "bytes=5-1", "bytes=-0", "bytes=-500", "bytes=0-9,20-29", "Bytes=1-2", "bytes=+1-2", "bytes=99999999999999999999-"} {
		f.Add(h, int64(1000))
	}
	f.Fuzz(func(t *testing.T, h string, size int64) {
		if size < 0 {
			size = -size
		}
		start, end, kind := parseByteRange(h, size)
		switch kind {
		case rangeWhole:
			if start != 0 || end != size {
				t.Fatalf("whole: %d-%d of %d", start, end, size)
			}
		case rangePart:
			if start < 0 || start >= end || end > size {
				t.Fatalf("part %d-%d of %d", start, end, size)
			}
		case rangeUnsatisfiable:
		default:
			t.Fatalf("kind %d", kind)
		}
	})
}

// FuzzManifest: validating, sniffing and reading the declared sizes of a
// manifest never fail on what an upstream sends, and what validates is
// JSON.
func FuzzManifest(f *testing.F) {
	f.Add("application/vnd.oci.image.manifest.v1+json", []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"digest":"sha256:`+digest.FromString("c").Encoded()+`","size":2},"layers":[{"digest":"sha256:`+digest.FromString("l").Encoded()+`","size":-1}]}`))
	f.Add("application/vnd.oci.image.index.v1+json", []byte(`{"schemaVersion":2,"manifests":[{"digest":"x","size":1e99}]}`))
	f.Add("text/plain", []byte("<html>"))
	f.Fuzz(func(t *testing.T, mediaType string, body []byte) {
		sniffMediaType(body)
		for d, size := range declaredSizes(body) {
			if d.Validate() != nil || size < 0 {
				t.Fatalf("declared %q as %d bytes", d, size)
			}
		}
		if validateManifest(mediaType, body) == nil && !json.Valid(body) {
			t.Fatalf("validated, but not JSON: %q", body)
		}
	})
}
