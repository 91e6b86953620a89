package upstream

import (
	"bytes"
	"context"
	"crypto/sha512"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Shared test helpers.

const testUpstream = "example.io"

var discardLogger = slog.New(slog.DiscardHandler)

// newTestRegistry returns a Registry named testUpstream over the endpoints,
// with a transport of its own whose idle connections close with the test.
func newTestRegistry(t *testing.T, endpoints ...string) *Registry {
	t.Helper()
	tr := NewTransport()
	t.Cleanup(tr.CloseIdleConnections)
	r, err := New(testUpstream, endpoints, WithTransport(tr), WithLogger(discardLogger))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return r
}

// memNet is an in-memory network for tests in synctest bubbles, which must
// not do real network I/O: a request goes to the RoundTripper registered for
// its host, and a host not in the map refuses the connection.
type memNet map[string]http.RoundTripper

func (n memNet) RoundTrip(req *http.Request) (*http.Response, error) {
	rt, ok := n[req.URL.Host]
	if !ok {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	resp, err := rt.RoundTrip(req)
	if resp != nil {
		resp.Request = req // as http.Transport does
	}
	return resp, err
}

// handlerRT serves requests in memory with a handler.
type handlerRT struct{ http.Handler }

func (h handlerRT) RoundTrip(req *http.Request) (*http.Response, error) {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Result(), nil
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// newMemRegistry returns a Registry named testUpstream whose requests go to n.
func newMemRegistry(t *testing.T, n memNet, endpoints ...string) *Registry {
	t.Helper()
	r, err := New(testUpstream, endpoints, WithTransport(n), WithLogger(discardLogger))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return r
}

// asError returns err as an *Error, failing the test when it is not one.
func asError(t *testing.T, err error) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("got error %v (%T), want an *Error", err, err)
	}
	return e
}

// host returns the host:port of an httptest server.
func host(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }

// pushRandomImage pushes a random image of the given layers to the registry
// at srv as repoTag ("repo:tag").
func pushRandomImage(t *testing.T, srv *httptest.Server, repoTag string, layerSize, layers int64) v1.Image {
	t.Helper()
	img, err := random.Image(layerSize, layers)
	if err != nil {
		t.Fatalf("random.Image: %v", err)
	}
	ref, err := name.ParseReference(host(srv)+"/"+repoTag, name.Insecure)
	if err != nil {
		t.Fatalf("ParseReference: %v", err)
	}
	if err := remote.Write(ref, img, remote.WithContext(t.Context())); err != nil {
		t.Fatalf("remote.Write: %v", err)
	}
	return img
}

// allKinds are the error kinds an *Error can have.
var allKinds = []error{ErrNotFound, ErrUnauthorized, ErrDenied, ErrTooManyRequests, ErrUnavailable, ErrInvalid}

// checkKind checks that err is of kind want and of no other kind.
func checkKind(t *testing.T, err, want error) {
	t.Helper()
	for _, k := range allKinds {
		if got := errors.Is(err, k); got != (k == want) {
			t.Errorf("errors.Is(%v, %v): got %v, want %v", err, k, got, k == want)
		}
	}
}

func TestNew(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		upstream  string
		endpoints []string
		want      []string // nil: New must fail
	}{
		{"one endpoint", "docker.io", []string{"https://registry-1.docker.io"}, []string{"https://registry-1.docker.io"}},
		{"order kept, trailing slash trimmed", "m", []string{"https://a.example/", "http://b.example:5000"},
			[]string{"https://a.example", "http://b.example:5000"}},
		{"path prefix kept", "m", []string{"https://a.example/mirror/"}, []string{"https://a.example/mirror"}},
		{"no name", "", []string{"https://a.example"}, nil},
		{"no endpoints", "m", nil, nil},
		{"no scheme", "m", []string{"registry.example"}, nil},
		{"host:port without scheme", "m", []string{"registry.example:5000"}, nil},
		{"ftp", "m", []string{"ftp://registry.example"}, nil},
		{"no host", "m", []string{"https://"}, nil},
		{"unparsable", "m", []string{"https://a b.example:port"}, nil},
		{"one bad among good", "m", []string{"https://a.example", "b.example"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r, err := New(tt.upstream, tt.endpoints, WithLogger(discardLogger))
			if tt.want == nil {
				if err == nil {
					t.Fatalf("got endpoints %v, want an error", r.Endpoints())
				}
				return
			}
			if err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			if got := r.Name(); got != tt.upstream {
				t.Errorf("Name: got %v, want %v", got, tt.upstream)
			}
			if got := r.Endpoints(); !slices.Equal(got, tt.want) {
				t.Errorf("Endpoints: got %v, want %v", got, tt.want)
			}
		})
	}
}

// TestEndpointPathPrefix checks that an endpoint's path is kept as a prefix
// of /v2/, as some mirrors are served below a path.
func TestEndpointPathPrefix(t *testing.T) {
	t.Parallel()
	var gotPath atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotPath.Store(r.URL.Path)
		w.Header().Set("Content-Length", "3")
	}))
	t.Cleanup(srv.Close)
	r := newTestRegistry(t, srv.URL+"/mirror/")
	if _, err := r.HeadManifest(t.Context(), "library/alpine", "3.20", nil); err != nil {
		t.Fatalf("HeadManifest: got %v, want no error", err)
	}
	if got, want := gotPath.Load(), "/mirror/v2/library/alpine/manifests/3.20"; got != want {
		t.Errorf("path: got %v, want %v", got, want)
	}
}

func TestHeadManifest(t *testing.T) {
	t.Parallel()
	dgst := digest.FromString("manifest")
	tests := []struct {
		name        string
		contentType string
		digest      string
		want        Descriptor
	}{
		{"all headers", "application/vnd.oci.image.index.v1+json", dgst.String(),
			Descriptor{Digest: dgst, MediaType: "application/vnd.oci.image.index.v1+json", Size: 1234}},
		{"media type parameters dropped", "application/vnd.docker.distribution.manifest.v2+json; charset=utf-8", dgst.String(),
			Descriptor{Digest: dgst, MediaType: "application/vnd.docker.distribution.manifest.v2+json", Size: 1234}},
		{"no digest header", "application/vnd.oci.image.manifest.v1+json", "",
			Descriptor{MediaType: "application/vnd.oci.image.manifest.v1+json", Size: 1234}},
		{"malformed digest header", "application/vnd.oci.image.manifest.v1+json", "sha256:nothex",
			Descriptor{MediaType: "application/vnd.oci.image.manifest.v1+json", Size: 1234}},
		{"malformed content type", "not a media type;;", dgst.String(), Descriptor{Digest: dgst, Size: 1234}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var method, accept atomic.Value
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				method.Store(r.Method)
				accept.Store(strings.Join(r.Header.Values("Accept"), "|"))
				w.Header().Set("Content-Type", tt.contentType)
				if tt.digest != "" {
					w.Header().Set("Docker-Content-Digest", tt.digest)
				}
				w.Header().Set("Content-Length", "1234")
			}))
			t.Cleanup(srv.Close)
			r := newTestRegistry(t, srv.URL)
			got, err := r.HeadManifest(t.Context(), "library/alpine", "latest",
				[]string{"application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json"})
			if err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			if got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
			if got, want := method.Load(), http.MethodHead; got != want {
				t.Errorf("method: got %v, want %v", got, want)
			}
			if got, want := accept.Load(), "application/vnd.oci.image.index.v1+json|application/vnd.oci.image.manifest.v1+json"; got != want {
				t.Errorf("Accept: got %v, want %v", got, want)
			}
		})
	}
}

func TestGetManifest(t *testing.T) {
	t.Parallel()
	body := []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}`)
	sha256Digest := digest.FromBytes(body)
	sum512 := sha512.Sum512(body)
	sha512Digest := digest.NewDigestFromBytes(digest.SHA512, sum512[:])
	big := bytes.Repeat([]byte{' '}, MaxManifestSize+1)
	atLimit := bytes.Repeat([]byte{' '}, MaxManifestSize)
	tests := []struct {
		name        string
		ref         string
		body        []byte
		chunked     bool // no Content-Length
		contentType string
		want        Descriptor // zero: ErrInvalid wanted
	}{
		{"by tag", "latest", body, false, "application/vnd.oci.image.manifest.v1+json",
			Descriptor{Digest: sha256Digest, MediaType: "application/vnd.oci.image.manifest.v1+json", Size: int64(len(body))}},
		{"by tag, chunked", "latest", body, true, "application/vnd.oci.image.manifest.v1+json",
			Descriptor{Digest: sha256Digest, MediaType: "application/vnd.oci.image.manifest.v1+json", Size: int64(len(body))}},
		{"by matching digest", sha256Digest.String(), body, false, "application/vnd.oci.image.manifest.v1+json",
			Descriptor{Digest: sha256Digest, MediaType: "application/vnd.oci.image.manifest.v1+json", Size: int64(len(body))}},
		{"by matching sha512 digest", sha512Digest.String(), body, false, "application/vnd.oci.image.manifest.v1+json",
			Descriptor{Digest: sha512Digest, MediaType: "application/vnd.oci.image.manifest.v1+json", Size: int64(len(body))}},
		{"content type parameters dropped", "latest", body, false, "application/vnd.oci.image.manifest.v1+json; charset=utf-8",
			Descriptor{Digest: sha256Digest, MediaType: "application/vnd.oci.image.manifest.v1+json", Size: int64(len(body))}},
		{"digest mismatch", digest.FromString("something else").String(), body, false, "application/vnd.oci.image.manifest.v1+json",
			Descriptor{}},
		{"at the size limit", "latest", atLimit, false, "application/json",
			Descriptor{Digest: digest.FromBytes(atLimit), MediaType: "application/json", Size: MaxManifestSize}},
		{"over the size limit", "latest", big, false, "application/json", Descriptor{}},
		{"over the size limit, chunked", "latest", big, true, "application/json", Descriptor{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/v2/library/alpine/manifests/"+tt.ref {
					http.NotFound(w, r)
					return
				}
				w.Header().Set("Content-Type", tt.contentType)
				if !tt.chunked {
					w.Header().Set("Content-Length", fmt.Sprint(len(tt.body)))
				} else {
					w.(http.Flusher).Flush()
				}
				w.Write(tt.body)
			}))
			t.Cleanup(srv.Close)
			r := newTestRegistry(t, srv.URL)
			desc, got, err := r.GetManifest(t.Context(), "library/alpine", tt.ref, nil)
			if tt.want == (Descriptor{}) {
				checkKind(t, err, ErrInvalid)
				e := asError(t, err)
				if e.Status != http.StatusOK {
					t.Errorf("Status: got %v, want %v", e.Status, http.StatusOK)
				}
				if wantOp := "GET /v2/library/alpine/manifests/" + tt.ref; e.Op != wantOp {
					t.Errorf("Op: got %v, want %v", e.Op, wantOp)
				}
				if got != nil {
					t.Errorf("body: got %d bytes, want none", len(got))
				}
				return
			}
			if err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			if desc != tt.want {
				t.Errorf("got %+v, want %+v", desc, tt.want)
			}
			if !bytes.Equal(got, tt.body) {
				t.Errorf("body: got %d bytes, want the %d served", len(got), len(tt.body))
			}
		})
	}
}

func TestHeadBlob(t *testing.T) {
	t.Parallel()
	d := digest.FromString("blob")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodHead || r.URL.Path != "/v2/org/app/blobs/"+d.String() {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Length", "4096")
	}))
	t.Cleanup(srv.Close)
	r := newTestRegistry(t, srv.URL)
	got, err := r.HeadBlob(t.Context(), "org/app", d)
	if err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	if got != 4096 {
		t.Errorf("got %v, want %v", got, 4096)
	}
	_, err = r.HeadBlob(t.Context(), "org/other", d)
	checkKind(t, err, ErrNotFound)
}

// TestStatusErrors checks how non-success answers map to *Error.
func TestStatusErrors(t *testing.T) {
	t.Parallel()
	longBody := strings.Repeat("x", 300)
	tests := []struct {
		name       string
		method     string
		status     int
		header     http.Header
		body       string
		kind       error
		code       string
		message    string
		retryAfter time.Duration
		suffix     string // Error() after "upstream NAME (HOST): OP: "
	}{
		{name: "GET 404 with OCI body", method: http.MethodGet, status: 404,
			body: `{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}`,
			kind: ErrNotFound, code: "MANIFEST_UNKNOWN", message: "manifest unknown",
			suffix: "404 MANIFEST_UNKNOWN: manifest unknown"},
		{name: "GET 404 with the first of several OCI errors", method: http.MethodGet, status: 404,
			body: `{"errors":[{"code":"NAME_UNKNOWN","message":"repository name not known to registry","detail":{"name":"x"}},{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}`,
			kind: ErrNotFound, code: "NAME_UNKNOWN", message: "repository name not known to registry",
			suffix: "404 NAME_UNKNOWN: repository name not known to registry"},
		{name: "HEAD 404", method: http.MethodHead, status: 404,
			body: `{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}`,
			kind: ErrNotFound, message: "not found", suffix: "404 not found"},
		{name: "GET 429 with Retry-After", method: http.MethodGet, status: 429, header: http.Header{"Retry-After": {"7"}},
			body: `{"errors":[{"code":"TOOMANYREQUESTS","message":"You have reached your pull rate limit."}]}`,
			kind: ErrTooManyRequests, code: "TOOMANYREQUESTS", message: "You have reached your pull rate limit.", retryAfter: 7 * time.Second,
			suffix: "429 TOOMANYREQUESTS: You have reached your pull rate limit."},
		{name: "HEAD 429 with Retry-After", method: http.MethodHead, status: 429, header: http.Header{"Retry-After": {"7"}},
			kind: ErrTooManyRequests, message: "too many requests", retryAfter: 7 * time.Second, suffix: "429 too many requests"},
		{name: "GET 429 without Retry-After", method: http.MethodGet, status: 429,
			kind: ErrTooManyRequests, message: "too many requests", suffix: "429 too many requests"},
		{name: "GET 500 plain text", method: http.MethodGet, status: 500, body: "  database on fire\n",
			kind: ErrUnavailable, message: "database on fire", suffix: "500 database on fire"},
		{name: "GET 500 long body truncated", method: http.MethodGet, status: 500, body: longBody,
			kind: ErrUnavailable, message: longBody[:200] + "…", suffix: "500 " + longBody[:200] + "…"},
		{name: "HEAD 500", method: http.MethodHead, status: 500,
			kind: ErrUnavailable, message: "internal server error", suffix: "500 internal server error"},
		{name: "GET 503", method: http.MethodGet, status: 503,
			kind: ErrUnavailable, message: "service unavailable", suffix: "503 service unavailable"},
		{name: "GET 403 DENIED", method: http.MethodGet, status: 403,
			body: `{"errors":[{"code":"DENIED","message":"requested access to the resource is denied"}]}`,
			kind: ErrDenied, code: "DENIED", message: "requested access to the resource is denied",
			suffix: "403 DENIED: requested access to the resource is denied"},
		{name: "GET 401 without challenge", method: http.MethodGet, status: 401,
			kind: ErrUnauthorized, message: "unauthorized", suffix: "401 unauthorized"},
		{name: "GET 400", method: http.MethodGet, status: 400,
			kind: ErrInvalid, message: "bad request", suffix: "400 bad request"},
		{name: "GET 206 where 200 is expected", method: http.MethodGet, status: 206,
			kind: ErrInvalid, message: "partial content", suffix: "206 partial content"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				for k, v := range tt.header {
					w.Header()[k] = v
				}
				w.WriteHeader(tt.status)
				io.WriteString(w, tt.body)
			}))
			t.Cleanup(srv.Close)
			r := newTestRegistry(t, srv.URL)
			var err error
			if tt.method == http.MethodHead {
				_, err = r.HeadManifest(t.Context(), "library/alpine", "latest", nil)
			} else {
				_, _, err = r.GetManifest(t.Context(), "library/alpine", "latest", nil)
			}
			checkKind(t, err, tt.kind)
			e := asError(t, err)
			op := tt.method + " /v2/library/alpine/manifests/latest"
			if e.Upstream != testUpstream {
				t.Errorf("Upstream: got %v, want %v", e.Upstream, testUpstream)
			}
			if e.Endpoint != host(srv) {
				t.Errorf("Endpoint: got %v, want %v", e.Endpoint, host(srv))
			}
			if e.Op != op {
				t.Errorf("Op: got %v, want %v", e.Op, op)
			}
			if e.Status != tt.status {
				t.Errorf("Status: got %v, want %v", e.Status, tt.status)
			}
			if e.Code != tt.code {
				t.Errorf("Code: got %v, want %v", e.Code, tt.code)
			}
			if e.Message != tt.message {
				t.Errorf("Message: got %v, want %v", e.Message, tt.message)
			}
			if e.RetryAfter != tt.retryAfter {
				t.Errorf("RetryAfter: got %v, want %v", e.RetryAfter, tt.retryAfter)
			}
			want := fmt.Sprintf("upstream %s (%s): %s: %s", testUpstream, host(srv), op, tt.suffix)
			if got := err.Error(); got != want {
				t.Errorf("Error(): got %q, want %q", got, want)
			}
		})
	}
}

func TestErrorString(t *testing.T) {
	t.Parallel()
	cause := errors.New("dial tcp: connection refused")
	tests := []struct {
		name string
		err  *Error
		want string
	}{
		{"endpoint named like the upstream is not repeated",
			&Error{Upstream: "ghcr.io", Endpoint: "ghcr.io", Op: "GET /v2/a/manifests/b", Status: 404, Kind: ErrNotFound},
			"upstream ghcr.io: GET /v2/a/manifests/b: 404 not found upstream"},
		{"no status, cause",
			&Error{Upstream: "docker.io", Endpoint: "registry-1.docker.io", Op: "GET /v2/a/blobs/b", Kind: ErrUnavailable, Err: cause},
			"upstream docker.io (registry-1.docker.io): GET /v2/a/blobs/b: dial tcp: connection refused"},
		{"message wins over cause",
			&Error{Upstream: "u", Op: "GET /v2/a/blobs/b", Status: 200, Kind: ErrInvalid, Err: cause, Message: "bad size"},
			"upstream u: GET /v2/a/blobs/b: 200 bad size"},
		{"code and message",
			&Error{Upstream: "u", Endpoint: "h", Op: "HEAD /v2/a/manifests/b", Status: 401, Code: "UNAUTHORIZED", Message: "authentication required", Kind: ErrUnauthorized},
			"upstream u (h): HEAD /v2/a/manifests/b: 401 UNAUTHORIZED: authentication required"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := tt.err.Error(); got != tt.want {
				t.Errorf("got %q, want %q", got, tt.want)
			}
			if !errors.Is(tt.err, tt.err.Kind) {
				t.Errorf("errors.Is(err, %v): got false, want true", tt.err.Kind)
			}
			if tt.err.Err != nil && !errors.Is(tt.err, tt.err.Err) {
				t.Errorf("errors.Is(err, cause): got false, want true")
			}
		})
	}
}

func TestParseRetryAfter(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want time.Duration
	}{
		{"", 0},
		{"7", 7 * time.Second},
		{"0", 0},
		{"3600", time.Hour},
		{"-5", 0},
		{"soon", 0},
		{"Wed, 21 Oct 2015 07:28:00 GMT", 0}, // a date in the past
	}
	for _, tt := range tests {
		if got := parseRetryAfter(tt.in); got != tt.want {
			t.Errorf("parseRetryAfter(%q): got %v, want %v", tt.in, got, tt.want)
		}
	}
	// A date in the future: whole seconds, so allow for the truncation and
	// the time the call takes.
	in := time.Now().Add(time.Hour).UTC().Format(http.TimeFormat)
	if got := parseRetryAfter(in); got < 58*time.Minute || got > time.Hour {
		t.Errorf("parseRetryAfter(%q): got %v, want about 1h", in, got)
	}
}

// closedURL returns the URL of a server that is no longer listening.
func closedURL(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	return srv.URL
}

func TestConnectionRefused(t *testing.T) {
	t.Parallel()
	u := closedURL(t)
	r := newTestRegistry(t, u)
	_, err := r.HeadManifest(t.Context(), "library/alpine", "latest", nil)
	checkKind(t, err, ErrUnavailable)
	e := asError(t, err)
	if e.Status != 0 {
		t.Errorf("Status: got %v, want %v", e.Status, 0)
	}
	if want := strings.TrimPrefix(u, "http://"); e.Endpoint != want {
		t.Errorf("Endpoint: got %v, want %v", e.Endpoint, want)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("errors.Is(err, ECONNREFUSED): got false, want true (err %v)", err)
	}
}

// TestRedirectTransportErrorHidesQuery checks that a transport error after a
// redirect to a presigned URL does not put the URL's query, a credential, in
// the error.
func TestRedirectTransportErrorHidesQuery(t *testing.T) {
	t.Parallel()
	dead := closedURL(t)
	d := digest.FromString("blob")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, dead+"/bucket/blob?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=SECRET", http.StatusTemporaryRedirect)
	}))
	t.Cleanup(srv.Close)
	r := newTestRegistry(t, srv.URL)
	tests := []struct {
		name string
		call func() error
	}{
		{"HeadBlob", func() error { _, err := r.HeadBlob(t.Context(), "org/app", d); return err }},
		{"GetManifest", func() error { _, _, err := r.GetManifest(t.Context(), "org/app", "latest", nil); return err }},
		{"HeadManifest", func() error { _, err := r.HeadManifest(t.Context(), "org/app", "latest", nil); return err }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := tt.call()
			checkKind(t, err, ErrUnavailable)
			msg := err.Error()
			for _, secret := range []string{"SECRET", "AKIAEXAMPLE", "X-Amz"} {
				if strings.Contains(msg, secret) {
					t.Errorf("got %q, want no %q in it", msg, secret)
				}
			}
			if want := strings.TrimPrefix(dead, "http://") + "/bucket/blob"; !strings.Contains(msg, want) {
				t.Errorf("got %q, want it to name %q", msg, want)
			}
		})
	}
}

// countingHandler counts the requests h serves.
type countingHandler struct {
	n atomic.Int64
	h http.Handler
}

func (c *countingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c.n.Add(1)
	c.h.ServeHTTP(w, r)
}

func statusHandler(status int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(status) })
}

func TestFailover(t *testing.T) {
	t.Parallel()
	body := []byte(`{"schemaVersion":2}`)
	serve := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
		w.Write(body)
	})
	tests := []struct {
		name       string
		first      http.Handler // nil: the first endpoint is closed
		second     http.Handler
		kind       error // nil: success wanted
		secondHits int64
	}{
		{"first 503", statusHandler(503), serve, nil, 1},
		{"first 500", statusHandler(500), serve, nil, 1},
		{"first closed", nil, serve, nil, 1},
		{"first 404 is an answer", statusHandler(404), serve, ErrNotFound, 0},
		{"first 403 is an answer", statusHandler(403), serve, ErrDenied, 0},
		{"first 429 is an answer", statusHandler(429), serve, ErrTooManyRequests, 0},
		{"first 401 is an answer", statusHandler(401), serve, ErrUnauthorized, 0},
		{"both fail", statusHandler(503), statusHandler(502), ErrUnavailable, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			first := closedURL(t)
			if tt.first != nil {
				s := httptest.NewServer(tt.first)
				t.Cleanup(s.Close)
				first = s.URL
			}
			second := &countingHandler{h: tt.second}
			s2 := httptest.NewServer(second)
			t.Cleanup(s2.Close)
			r := newTestRegistry(t, first, s2.URL)
			desc, got, err := r.GetManifest(t.Context(), "library/alpine", "latest", nil)
			if tt.kind == nil {
				if err != nil {
					t.Fatalf("got %v, want no error", err)
				}
				if !bytes.Equal(got, body) || desc.Digest != digest.FromBytes(body) {
					t.Errorf("got %s (%v), want %s", got, desc.Digest, body)
				}
			} else {
				checkKind(t, err, tt.kind)
				e := asError(t, err)
				wantEndpoint := strings.TrimPrefix(first, "http://")
				if tt.secondHits > 0 {
					wantEndpoint = host(s2) // the last endpoint's error is returned
				}
				if e.Endpoint != wantEndpoint {
					t.Errorf("Endpoint: got %v, want %v", e.Endpoint, wantEndpoint)
				}
			}
			if got := second.n.Load(); got != tt.secondHits {
				t.Errorf("requests to the second endpoint: got %v, want %v", got, tt.secondHits)
			}
		})
	}
}

// TestFailoverStopsOnCancel checks that a cancelled context does not move on
// to the next endpoint.
func TestFailoverStopsOnCancel(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	first := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cancel()
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(first.Close)
	second := &countingHandler{h: statusHandler(200)}
	s2 := httptest.NewServer(second)
	t.Cleanup(s2.Close)
	r := newTestRegistry(t, first.URL, s2.URL)
	if _, err := r.HeadManifest(ctx, "library/alpine", "latest", nil); err == nil {
		t.Fatalf("got no error, want one")
	}
	if got := second.n.Load(); got != 0 {
		t.Errorf("requests to the second endpoint: got %v, want %v", got, 0)
	}
}

// TestBasicChallenge checks that a Basic challenge, with no credentials
// configured, is a 401 that stands.
func TestBasicChallenge(t *testing.T) {
	t.Parallel()
	h := &countingHandler{h: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("WWW-Authenticate", `Basic realm="https://123.dkr.ecr.us-east-1.amazonaws.com/",service="ecr.amazonaws.com"`)
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, `{"errors":[{"code":"DENIED","message":"Not Authorized"}]}`)
	})}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	r := newTestRegistry(t, srv.URL)
	_, _, err := r.GetManifest(t.Context(), "app", "latest", nil)
	checkKind(t, err, ErrUnauthorized)
	e := asError(t, err)
	if e.Status != http.StatusUnauthorized {
		t.Errorf("Status: got %v, want %v", e.Status, http.StatusUnauthorized)
	}
	if want := "no basic auth credentials for " + host(srv) + " (the registry says: Not Authorized)"; e.Code != "DENIED" || e.Message != want {
		t.Errorf("Code, Message: got %v, %v, want %v, %v", e.Code, e.Message, "DENIED", want)
	}
	_, err = r.HeadManifest(t.Context(), "app", "latest", nil)
	checkKind(t, err, ErrUnauthorized)
	if got := h.n.Load(); got != 2 {
		t.Errorf("requests: got %v, want %v (one per call, no retry)", got, 2)
	}
}

func TestMetrics(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatalf("NewMetrics: %v", err)
	}
	if _, err := NewMetrics(reg); err == nil {
		t.Errorf("second NewMetrics on one registerer: got no error, want one")
	}
	blob := []byte("some blob bytes")
	// Blobs are served whole, Range or not.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/blobs/") {
			w.Write(blob)
			return
		}
		http.NotFound(w, r)
	}))
	t.Cleanup(srv.Close)
	tr := NewTransport()
	t.Cleanup(tr.CloseIdleConnections)
	closed := closedURL(t)
	opts := []Option{WithTransport(tr), WithLogger(discardLogger), WithMetrics(m),
		WithFetchConfig(FetchConfig{ConnectionBudget: 1 << 20, MaxConnectionBudget: 2 << 20})}
	r, err := New("m.example", []string{closed, srv.URL}, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	r.HeadManifest(t.Context(), "a", "latest", nil)
	// Metrics are shared by the registries of a process.
	r2, err := New("m.example", []string{srv.URL}, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	w := newMemBlobWriter(-1)
	if _, err := r2.FetchBlob(t.Context(), "a", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("FetchBlob: %v", err)
	}
	first, second := strings.TrimPrefix(closed, "http://"), host(srv)
	tests := []struct {
		name string
		c    prometheus.Collector
		want float64
	}{
		{"HEAD refused", m.requests.WithLabelValues("m.example", "HEAD", "error"), 1},
		{"manifest HEAD", m.requests.WithLabelValues("m.example", "HEAD", "404"), 1},
		{"blob HEAD", m.requests.WithLabelValues("m.example", "HEAD", "200"), 1},
		{"GETs refused", m.requests.WithLabelValues("m.example", "GET", "error"), 0},
		{"the chunk, Range ignored", m.requests.WithLabelValues("m.example", "GET", "200"), 1},
		{"blob bytes", m.blobBytes.WithLabelValues("m.example"), float64(len(blob))},
		{"chunks complete", m.chunks.WithLabelValues("m.example", second, "complete"), 1},
		{"chunks cut", m.chunks.WithLabelValues("m.example", second, "cut"), 0},
		{"budget of the first endpoint", m.budget.WithLabelValues("m.example", first), 1 << 20},
		{"budget of the second endpoint", m.budget.WithLabelValues("m.example", second), 1 << 20},
	}
	for _, tt := range tests {
		if got := testutil.ToFloat64(tt.c); got != tt.want {
			t.Errorf("%s: got %v, want %v", tt.name, got, tt.want)
		}
	}
	// The metrics registered under their names.
	for _, name := range []string{"pullproxy_upstream_requests_total", "pullproxy_upstream_blob_bytes_total",
		"pullproxy_upstream_connection_budget_bytes", "pullproxy_upstream_chunks_total"} {
		if n, err := testutil.GatherAndCount(reg, name); err != nil || n == 0 {
			t.Errorf("series of %s: got %v, %v, want some", name, n, err)
		}
	}
}

// TestAgainstRegistry pulls an image pushed to go-containerregistry's
// in-process registry.
func TestAgainstRegistry(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	img := pushRandomImage(t, srv, "org/app:v1", 3000, 2)
	wantDigest, _ := img.Digest()
	wantManifest, _ := img.RawManifest()
	wantType, _ := img.MediaType()

	r := newTestRegistry(t, srv.URL)
	ctx := t.Context()
	accept := []string{string(wantType)}
	head, err := r.HeadManifest(ctx, "org/app", "v1", accept)
	if err != nil {
		t.Fatalf("HeadManifest: %v", err)
	}
	want := Descriptor{Digest: digest.Digest(wantDigest.String()), MediaType: string(wantType), Size: int64(len(wantManifest))}
	if head != want {
		t.Errorf("HeadManifest: got %+v, want %+v", head, want)
	}
	for _, ref := range []string{"v1", wantDigest.String()} {
		desc, body, err := r.GetManifest(ctx, "org/app", ref, accept)
		if err != nil {
			t.Fatalf("GetManifest %s: %v", ref, err)
		}
		if desc != want || !bytes.Equal(body, wantManifest) {
			t.Errorf("GetManifest %s: got %+v, want %+v", ref, desc, want)
		}
	}
	if _, _, err := r.GetManifest(ctx, "org/app", "v2", accept); !errors.Is(err, ErrNotFound) {
		t.Errorf("GetManifest of a missing tag: got %v, want %v", err, ErrNotFound)
	}

	layers, _ := img.Layers()
	for _, l := range layers {
		ld, _ := l.Digest()
		size, _ := l.Size()
		d := digest.Digest(ld.String())
		if got, err := r.HeadBlob(ctx, "org/app", d); err != nil || got != size {
			t.Errorf("HeadBlob: got %v, %v, want %v, nil", got, err, size)
		}
		w := newMemBlobWriter(-1)
		if _, err := r.FetchBlob(ctx, "org/app", d, w); err != nil {
			t.Fatalf("FetchBlob: %v", err)
		}
		if got := digest.FromBytes(w.Bytes()); got != d {
			t.Errorf("FetchBlob: got content hashing to %v, want %v", got, d)
		}
	}
}

func TestNextPage(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ link, want string }{
		{`</v2/library/alpine/tags/list?n=100&last=3.19>; rel="next"`, "last=3.19&n=100"},
		{`<https://registry.example.com/v2/a/tags/list?last=b&n=2&other=x>; rel=next, </v2/a/tags/list?last=z>; rel="next"`, "last=b&n=2"},
		{`</v2/a/tags/list?last=b>; rel="prev", </v2/a/tags/list?last=z>; rel="next"`, "last=z"},
		{`</v2/a/tags/list?last=b>; rel="prev"`, ""},
		{"", ""},
		{"garbage", ""},
	} {
		if got := nextPage(tt.link).Encode(); got != tt.want {
			t.Errorf("nextPage(%q) = %q, want %q", tt.link, got, tt.want)
		}
	}
}
