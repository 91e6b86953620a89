package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// namedUpstream is an Upstream of which causeOf reads only the name.
type namedUpstream struct {
	Upstream
	name string
}

func (u namedUpstream) Name() string { return u.name }

func TestCauseOf(t *testing.T) {
	t.Parallel()
	const blob = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	up := namedUpstream{name: "docker.io"}
	manifest := route{up: up, repo: "library/nginx", kind: kindManifest, ref: "1.27"}
	layer := route{up: up, repo: "library/nginx", kind: kindBlob, ref: blob}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	transport := func(err error) error {
		return &upstream.Error{Upstream: "docker.io", Endpoint: "registry-1.docker.io", Op: "HEAD /v2/library/nginx/manifests/1.27",
			Kind: upstream.ErrUnavailable, Err: fmt.Errorf("Head https://registry-1.docker.io/v2/library/nginx/manifests/1.27: %w", err)}
	}
	status := func(code int, kind error, ociCode, msg string) error {
		return &upstream.Error{Upstream: "docker.io", Op: "GET /v2/library/nginx/manifests/1.27", Status: code, Kind: kind, Code: ociCode, Message: msg}
	}
	for _, tc := range []struct {
		name string
		rt   route
		err  error
		want string
	}{
		{"connection refused", manifest, transport(refused),
			"upstream docker.io unreachable: connection refused"},
		{"DNS", manifest, transport(&net.DNSError{Err: "no such host", Name: "registry-1.docker.io", IsNotFound: true}),
			"upstream docker.io unreachable: DNS lookup of registry-1.docker.io failed: no such host"},
		{"i/o timeout", manifest, transport(&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}),
			"upstream docker.io unreachable: timed out"},
		{"token endpoint down", manifest, transport(fmt.Errorf("getting token from auth.docker.io: %w: %w", upstream.ErrUnavailable, refused)),
			"upstream docker.io unreachable: connection refused"},
		{"fetch timeout", manifest, fmt.Errorf("fetching: %w", context.DeadlineExceeded),
			"upstream docker.io did not answer in time"},
		{"manifest not found", manifest, status(404, upstream.ErrNotFound, "MANIFEST_UNKNOWN", "manifest unknown"),
			"library/nginx:1.27 not found at upstream docker.io"},
		{"blob not found", layer, status(404, upstream.ErrNotFound, "BLOB_UNKNOWN", "blob unknown"),
			"blob " + blob + " not found at upstream docker.io"},
		{"by digest", route{up: up, repo: "library/nginx", kind: kindManifest, ref: blob}, status(404, upstream.ErrNotFound, "", ""),
			"library/nginx@" + blob + " not found at upstream docker.io"},
		{"no credentials", manifest, status(401, upstream.ErrUnauthorized, "UNAUTHORIZED", "authentication required"),
			"upstream docker.io wants credentials for library/nginx: none are configured"},
		{"credentials refused", manifest, fmt.Errorf("%w: %w", status(401, upstream.ErrUnauthorized, "", ""), upstream.ErrCredentialsRefused),
			"upstream docker.io refused pullproxy's configured credentials for library/nginx"},
		{"denied", manifest, status(403, upstream.ErrDenied, "DENIED", "requested access to the resource is denied"),
			"upstream docker.io denied pullproxy access to library/nginx"},
		{"rate limited", manifest, status(429, upstream.ErrTooManyRequests, "TOOMANYREQUESTS", "You have reached your pull rate limit"),
			"upstream docker.io is rate limiting pullproxy"},
		{"upstream 503: its own words stay out", manifest, status(503, upstream.ErrUnavailable, "UNAVAILABLE", "backend http://10.0.0.7/ down"),
			"upstream docker.io answered 503 UNAVAILABLE"},
		{"refused answer: pullproxy's words", manifest,
			status(200, upstream.ErrInvalid, "", "not cached nor served: the manifest has schemaVersion 1"),
			"upstream docker.io answered 200: not cached nor served: the manifest has schemaVersion 1"},
		{"verification", layer, fmt.Errorf("committing: %w", storage.ErrDigestMismatch),
			"blob " + blob + " from upstream docker.io failed verification: nothing was cached"},
		{"disk full", layer, fmt.Errorf("writing: %w", syscall.ENOSPC),
			"pullproxy's data dir is full: blob " + blob + " cannot be stored"},
		{"shutting down", layer, errShuttingDown, "pullproxy is shutting down"},
		{"something else", layer, errors.New("who knows"), ""},
	} {
		if got := causeOf(tc.err, tc.rt); got != tc.want {
			t.Errorf("%s:\n got %q\nwant %q", tc.name, got, tc.want)
		}
	}
}

func TestReasonPhrase(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 300)
	for _, tc := range []struct{ in, want string }{
		{"upstream docker.io unreachable: connection refused", "upstream docker.io unreachable: connection refused"},
		{"two\r\nlines\n\tand a tab", "two lines and a tab"},
		{"  leading and trailing  ", "leading and trailing"},
		{"bell\x07 and del\x7f", "bell and del"},
		{"caf\u00e9 \u2026", "caf? ?"},
		{long, long[:maxReason-3] + "..."},
		{"", ""},
	} {
		if got := reasonPhrase(tc.in); got != tc.want {
			t.Errorf("reasonPhrase(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestStatusLineNamesTheCause: an error's cause reaches a client that
// reads only the status line (containerd resolving with HEAD), and the
// connection goes on serving, one request at a time and pipelined.
func TestStatusLineNamesTheCause(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.push("test/app", "v1", 1000, 1)
	manifest := "/v2/test/app/manifests/v1?ns=" + upstreamName
	missing := "/v2/test/app/manifests/nope?ns=" + upstreamName

	cc := dialProxy(t, e.proxy)
	cc.send(request("HEAD", missing))
	if resp, _ := cc.response("HEAD"); resp.Status != "404 test/app:nope not found at upstream "+upstreamName {
		t.Errorf("HEAD of a missing tag: status line %q", resp.Status)
	}
	cc.send(request("GET", manifest))
	if resp, _ := cc.response("GET"); resp.StatusCode != http.StatusOK {
		t.Errorf("after an error, on the same connection: %s", resp.Status)
	}
	cc.send(request("GET", "/v2/test/app/manifests/v1?ns=elsewhere.test"))
	if resp, body := cc.response("GET"); resp.Status != "404 pullproxy does not mirror elsewhere.test: no upstream of that name is configured" ||
		!strings.Contains(string(body), "NAME_UNKNOWN") {
		t.Errorf("unconfigured upstream: %q %s", resp.Status, body)
	}

	e.upstream.Close()
	cc.send(request("HEAD", "/v2/test/app/manifests/v2?ns="+upstreamName), request("GET", "/v2/test/app/manifests/nope2?ns="+upstreamName), request("GET", manifest))
	for i, want := range []string{
		"503 upstream " + upstreamName + " unreachable: connection refused",
		"503 upstream " + upstreamName + " unreachable: connection refused",
		"200 OK", // cached: the tag is young
	} {
		method := "GET"
		if i == 0 {
			method = "HEAD"
		}
		resp, body := cc.response(method)
		if resp.Status != want {
			t.Errorf("pipelined request %d: status line %q, want %q", i, resp.Status, want)
		}
		if resp.StatusCode == http.StatusServiceUnavailable && method == "GET" && !strings.Contains(string(body), "connection refused") {
			t.Errorf("pipelined request %d: the body does not name the cause: %s", i, body)
		}
	}
}

// TestStatusLineWithoutTheBlobLoop: with no connection loop to hand the
// connection back to, an error is still sent with its cause, and the
// connection is closed after it.
func TestStatusLineWithoutTheBlobLoop(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithBlobLoop(false))
	cc := dialProxy(t, e.proxy)
	cc.send(request("HEAD", "/v2/test/app/manifests/nope?ns="+upstreamName))
	resp, _ := cc.response("HEAD")
	if resp.Status != "404 test/app:nope not found at upstream "+upstreamName || !resp.Close {
		t.Errorf("status line %q, Connection: close %v", resp.Status, resp.Close)
	}
	cc.c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if !cc.closed() {
		t.Error("the connection stayed open")
	}
}

// TestStatusLineOverTLS: on a TLS listener (net/http alone serves it), an
// error's cause reaches the client too, and the TLS connection goes back
// to net/http for the next request.
func TestStatusLineOverTLS(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.push("test/app", "v1", 1000, 1)
	up, err := upstream.New(upstreamName, []string{e.upstream.URL}, upstream.WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(WithStore(e.store), WithUpstream(up), WithLogger(testLog(t)), WithMetricsRegistry(prometheus.NewRegistry()))
	if err != nil {
		t.Fatal(err)
	}
	certs := httptest.NewUnstartedServer(nil)
	certs.StartTLS()
	certs.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{ReadHeaderTimeout: 10 * time.Second}
	done := make(chan error, 1)
	go func() {
		done <- srv.Serve(tls.NewListener(ln, &tls.Config{Certificates: certs.TLS.Certificates}), hs)
	}()
	t.Cleanup(func() {
		srv.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx, hs)
		<-done
	})

	roots := x509.NewCertPool()
	roots.AddCert(certs.Certificate())
	c, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{RootCAs: roots, ServerName: "example.com"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	cc := &clientConn{t: t, c: c, br: bufio.NewReader(c)}
	for i := range 2 {
		cc.send(request("HEAD", "/v2/test/app/manifests/nope?ns="+upstreamName))
		if resp, _ := cc.response("HEAD"); resp.Status != "404 test/app:nope not found at upstream "+upstreamName || resp.Close {
			t.Errorf("request %d: status line %q, Connection: close %v", i, resp.Status, resp.Close)
		}
		cc.send(request("GET", "/v2/test/app/manifests/v1?ns="+upstreamName))
		if resp, _ := cc.response("GET"); resp.StatusCode != http.StatusOK {
			t.Errorf("request %d, after the error: %s", i, resp.Status)
		}
	}
}
