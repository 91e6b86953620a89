package upstream

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"
)

func TestClassifyAddr(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		addr string
		want addrClass
	}{
		{"8.8.8.8", classPublic},
		{"52.94.0.1", classPublic},
		{"2600:1f18::1", classPublic},
		{"10.1.2.3", classPrivate},
		{"172.16.0.1", classPrivate},
		{"172.31.255.254", classPrivate},
		{"172.32.0.1", classPublic},
		{"192.168.1.1", classPrivate},
		{"100.64.0.1", classPrivate},
		{"fd00::1", classPrivate},
		{"127.0.0.1", classLoopback},
		{"127.8.9.10", classLoopback},
		{"::1", classLoopback},
		{"::ffff:127.0.0.1", classLoopback},
		{"169.254.169.254", classLinkLocal},
		{"::ffff:169.254.169.254", classLinkLocal},
		{"fe80::1", classLinkLocal},
		{"0.0.0.0", classNever},
		{"::", classNever},
		{"224.0.0.1", classNever},
		{"255.255.255.255", classNever},
	} {
		if got := classifyAddr(netip.MustParseAddr(tt.addr)); got != tt.want {
			t.Errorf("classifyAddr(%s) = %s, want %s", tt.addr, classNames[got], classNames[tt.want])
		}
	}
}

func TestRealmCredentials(t *testing.T) {
	t.Parallel()
	tgt, err := newTargets(discardLogger, []*url.URL{mustURL(t, "https://registry-1.docker.io"), mustURL(t, "http://10.0.0.5:5000")},
		nil, []string{"sso.example.com"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		realm, endpoint string
		ok              bool
	}{
		{"https://registry-1.docker.io/token", "https://registry-1.docker.io", true},
		{"https://registry-1.docker.io:443/token", "https://registry-1.docker.io", true},
		{"https://auth.docker.io/token", "https://registry-1.docker.io", true},  // known
		{"https://sso.example.com/token", "https://registry-1.docker.io", true}, // configured
		{"https://evil.example.com/token", "https://registry-1.docker.io", false},
		{"https://registry-1.docker.io:8443/token", "https://registry-1.docker.io", false}, // another port
		{"http://registry-1.docker.io/token", "https://registry-1.docker.io", false},       // down to http
		{"http://auth.docker.io/token", "https://registry-1.docker.io", false},
		{"http://10.0.0.5:5000/token", "http://10.0.0.5:5000", true},
		{"http://sso.example.com/token", "http://10.0.0.5:5000", true}, // the endpoint is http itself
		{"http://10.0.0.6:5000/token", "http://10.0.0.5:5000", false},
	} {
		err := tgt.realmCredentials(mustURL(t, tt.realm), mustURL(t, tt.endpoint))
		if (err == nil) != tt.ok {
			t.Errorf("credentials to realm %s of endpoint %s: got %v, want allowed %v", tt.realm, tt.endpoint, err, tt.ok)
		}
	}
}

func TestCheckRedirect(t *testing.T) {
	t.Parallel()
	tgt, err := newTargets(discardLogger, []*url.URL{mustURL(t, "https://registry.example.com")}, nil, nil, []string{"plain.example.com"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		from, to string
		ok       bool
	}{
		{"https://registry.example.com/v2/a/blobs/x", "https://s3.amazonaws.com/b?sig=1", true},
		{"http://registry.example.com/v2/a/blobs/x", "http://cdn.example.com/b", true},
		{"https://registry.example.com/v2/a/blobs/x", "http://cdn.example.com/b", false},
		{"https://registry.example.com/v2/a/blobs/x", "http://plain.example.com/b", true}, // allowed
		{"https://registry.example.com/v2/a/blobs/x", "ftp://cdn.example.com/b", false},
		{"https://registry.example.com/v2/a/blobs/x", "file:///etc/passwd", false},
		{"https://registry.example.com/v2/a/blobs/x", "gopher://cdn.example.com/b", false},
	} {
		err := tgt.checkRedirect(mustURL(t, tt.from), mustURL(t, tt.to))
		if (err == nil) != tt.ok {
			t.Errorf("redirect %s → %s: got %v, want allowed %v", tt.from, tt.to, err, tt.ok)
		}
		if err != nil && !errors.Is(err, errTargetRefused) {
			t.Errorf("redirect %s → %s: %v does not wrap errTargetRefused", tt.from, tt.to, err)
		}
	}
	if _, err := newTargets(discardLogger, nil, nil, nil, []string{"http://x"}); err == nil {
		t.Error("redirect_allow accepted a URL")
	}
}

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// withAddresses makes 127.0.0.1 a public address and the others given
// what the map says, and resolves the names in names: every address a
// test can listen on is a loopback one.
func withAddresses(classes map[string]addrClass, names map[string]string) Option {
	return func(o *options) error {
		o.policy = func(t *targets) {
			t.classify = func(a netip.Addr) addrClass {
				if c, ok := classes[a.Unmap().String()]; ok {
					return c
				}
				return classPublic
			}
			t.resolve = func(ctx context.Context, host string) ([]netip.Addr, error) {
				if a, ok := names[host]; ok {
					return []netip.Addr{netip.MustParseAddr(a)}, nil
				}
				return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
			}
		}
		return nil
	}
}

// authLog records the Authorization header of every request h serves.
type authLog struct {
	h http.Handler

	mu    sync.Mutex
	auths []string
}

func (l *authLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	l.mu.Lock()
	l.auths = append(l.auths, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
	l.mu.Unlock()
	l.h.ServeHTTP(w, r)
}

func (l *authLog) seen() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.auths...)
}

// listenOn starts h on addr (127.0.0.x:0).
func listenOn(t *testing.T, addr string, h http.Handler) *httptest.Server {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(h)
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// TestTokenRealmCredentials: the password goes to a token realm on the
// endpoint's origin or on a host the upstream allows, and to no other: a
// realm on another port of the same host gets an anonymous token request.
func TestTokenRealmCredentials(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name       string
		sameOrigin bool
		allow      []string
		wantCreds  bool
	}{
		{"realm on the endpoint's origin", true, nil, true},
		{"realm on another port", false, nil, false},
		{"realm on another port, allowed", false, []string{"127.0.0.1"}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ts := newTokenServer()
			realm := &authLog{h: ts}
			g := &bearerRegistry{tokens: ts, manifest: []byte(`{"schemaVersion":2}`), blob: []byte("layer bytes")}
			mux := http.NewServeMux()
			mux.Handle("/token", realm)
			mux.Handle("/v2/", g)
			gsrv := httptest.NewServer(mux)
			t.Cleanup(gsrv.Close)
			g.realm = gsrv.URL + "/token"
			if !tt.sameOrigin {
				tsrv := httptest.NewServer(realm)
				t.Cleanup(tsrv.Close)
				g.realm = tsrv.URL + "/token"
			}
			tr := NewTransport()
			t.Cleanup(tr.CloseIdleConnections)
			r, err := New(testUpstream, []string{gsrv.URL}, WithTransport(tr), WithLogger(discardLogger),
				WithCredentials(StaticCredentials{Username: "user", Password: "hunter2"}), WithTokenRealmHosts(tt.allow...))
			if err != nil {
				t.Fatal(err)
			}
			if _, _, err := r.GetManifest(t.Context(), "org/app", "v1", nil); err != nil {
				t.Fatalf("GetManifest: %v", err)
			}
			seen := realm.seen()
			if len(seen) != 1 {
				t.Fatalf("token requests: got %q, want one", seen)
			}
			if got := strings.HasSuffix(seen[0], " Basic dXNlcjpodW50ZXIy"); got != tt.wantCreds {
				t.Errorf("token request %q: credentials sent %v, want %v", seen[0], got, tt.wantCreds)
			}
		})
	}
}

// basicRegistry asks for basic credentials and then redirects every
// manifest and blob request to location.
type basicRegistry struct{ location string }

func (b basicRegistry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, _, ok := r.BasicAuth(); !ok {
		w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	http.Redirect(w, r, b.location+r.URL.Path, http.StatusTemporaryRedirect)
}

// TestRedirectDropsAuthorization: a redirect to the endpoint's host on
// another port is another origin, and gets no Authorization (net/http
// would keep it).
func TestRedirectDropsAuthorization(t *testing.T) {
	t.Parallel()
	manifest := []byte(`{"schemaVersion":2}`)
	target := &authLog{h: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
		w.Write(manifest)
	})}
	tsrv := httptest.NewServer(target)
	t.Cleanup(tsrv.Close)
	gsrv := httptest.NewServer(basicRegistry{location: tsrv.URL})
	t.Cleanup(gsrv.Close)
	tr := NewTransport()
	t.Cleanup(tr.CloseIdleConnections)
	r, err := New(testUpstream, []string{gsrv.URL}, WithTransport(tr), WithLogger(discardLogger),
		WithCredentials(StaticCredentials{Username: "user", Password: "hunter2"}))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.GetManifest(t.Context(), "org/app", "v1", nil); err != nil {
		t.Fatalf("GetManifest: %v", err)
	}
	for _, s := range target.seen() {
		if !strings.HasSuffix(s, " ") {
			t.Errorf("at the redirect target: %q, want no Authorization", s)
		}
	}
}

// TestRedirectTargetsRefused: a registry that redirects to a link-local
// (cloud metadata) or private address, by address or by name, to a scheme
// other than http(s), is refused before anything is sent there; the same
// target is reached once redirect_allow names it.
func TestRedirectTargetsRefused(t *testing.T) {
	t.Parallel()
	blob := randomBlob(3000)
	manifest := []byte(`{"schemaVersion":2}`)
	storage := &authLog{h: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/manifests/") {
			w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
			w.Write(manifest)
			return
		}
		(&rangeServer{blob: blob}).ServeHTTP(w, r)
	})}
	metadata := listenOn(t, "127.0.0.2:0", storage) // link-local, says withAddresses
	internal := listenOn(t, "127.0.0.3:0", storage) // private
	_, metadataPort, _ := net.SplitHostPort(metadata.Listener.Addr().String())
	classes := map[string]addrClass{"127.0.0.2": classLinkLocal, "127.0.0.3": classPrivate}
	names := map[string]string{"metadata.test": "127.0.0.2", "rebound.test": "127.0.0.3"}

	for _, tt := range []struct {
		name     string
		location string
		allow    []string
		ok       bool
	}{
		{"link-local address", metadata.URL, nil, false},
		{"private address", internal.URL, nil, false},
		{"name of a link-local address", "http://metadata.test:" + metadataPort, nil, false},
		{"scheme not http", "ftp://127.0.0.2:" + metadataPort, nil, false},
		{"link-local address, allowed", metadata.URL, []string{"127.0.0.2"}, true},
		{"private network, allowed", internal.URL, []string{"127.0.0.0/24"}, true},
		{"name, allowed", "http://metadata.test:" + metadataPort, []string{"metadata.test"}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// Manifests are redirected for the client that follows
			// redirects; blob HEADs answered, so that the chunks' own
			// redirect handling meets the target.
			gsrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method == http.MethodHead && strings.Contains(r.URL.Path, "/blobs/") {
					w.Header().Set("Content-Length", fmt.Sprint(len(blob)))
					return
				}
				http.Redirect(w, r, tt.location+r.URL.Path, http.StatusTemporaryRedirect)
			}))
			t.Cleanup(gsrv.Close)
			tr := NewTransport()
			t.Cleanup(tr.CloseIdleConnections)
			r, err := New(testUpstream, []string{gsrv.URL}, WithTransport(tr), WithLogger(discardLogger),
				WithRedirectAllow(tt.allow...), withAddresses(classes, names))
			if err != nil {
				t.Fatal(err)
			}
			before := len(storage.seen())
			_, _, merr := r.GetManifest(t.Context(), "org/app", "v1", nil)
			w := newMemBlobWriter(int64(len(blob)))
			_, ferr := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w)
			reached := len(storage.seen()) - before
			if tt.ok {
				if merr != nil || ferr != nil {
					t.Fatalf("got %v and %v, want the manifest and the blob", merr, ferr)
				}
				checkBlob(t, w, blob)
				return
			}
			if reached != 0 {
				t.Errorf("requests at the refused target: got %d, want none", reached)
			}
			for _, err := range []error{merr, ferr} {
				if err == nil {
					t.Fatal("got no error, want the redirect refused")
				}
				e := asError(t, err)
				if !errors.Is(e, ErrInvalid) || !errors.Is(e, errTargetRefused) {
					t.Errorf("got %v (kind %v), want ErrInvalid wrapping errTargetRefused", err, e.Kind)
				}
			}
		})
	}
}

// TestRedirectTargetBodyStaysHome: what a redirect target answers with an
// error never reaches the error a client reads; the registry's own does.
func TestRedirectTargetBodyStaysHome(t *testing.T) {
	t.Parallel()
	const secret = "SignatureDoesNotMatch: StringToSign echoed SECRET-ECHO"
	storage := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, secret, http.StatusForbidden)
	}))
	t.Cleanup(storage.Close)
	location := strings.Replace(storage.URL, "127.0.0.1", "localhost", 1)
	gsrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/manifests/own") {
			http.Error(w, "the registry's own words", http.StatusForbidden)
			return
		}
		http.Redirect(w, r, location+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(gsrv.Close)
	r := newTestRegistry(t, gsrv.URL)
	_, _, merr := r.GetManifest(t.Context(), "org/app", "v1", nil)
	_, ferr := r.FetchBlob(t.Context(), "org/app", digest.FromBytes([]byte("x")), newMemBlobWriter(1))
	for _, err := range []error{merr, ferr} {
		if err == nil {
			t.Fatal("got no error, want 403")
		}
		if strings.Contains(err.Error(), "SECRET-ECHO") {
			t.Errorf("error %q holds the redirect target's body", err)
		}
		if !strings.Contains(err.Error(), "403") {
			t.Errorf("error %q does not say 403", err)
		}
	}
	_, _, err := r.GetManifest(t.Context(), "org/app", "own", nil)
	if err == nil || !strings.Contains(err.Error(), "the registry's own words") {
		t.Errorf("got %v, want the registry's own message", err)
	}
}

// TestGuardDialsIPv4First: a redirect target's addresses are dialled
// IPv4 first, so that a host without an IPv6 route does not wait out a
// connect timeout before the address that works.
func TestGuardDialsIPv4First(t *testing.T) {
	t.Parallel()
	tgt, err := newTargets(discardLogger, []*url.URL{mustURL(t, "https://registry.example.com")}, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	tgt.resolve = func(context.Context, string) ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("2600:1f18::1"), netip.MustParseAddr("52.94.0.1"),
			netip.MustParseAddr("2600:1f18::2"), netip.MustParseAddr("52.94.0.2")}, nil
	}
	var tried []string
	dial := tgt.guard(func(_ context.Context, _, addr string) (net.Conn, error) {
		tried = append(tried, addr)
		return nil, errors.New("unreachable")
	})
	if _, err := dial(t.Context(), "tcp", "storage.example.com:443"); err == nil {
		t.Fatal("dialled nothing, got a connection")
	}
	want := []string{"52.94.0.1:443", "52.94.0.2:443", "[2600:1f18::1]:443", "[2600:1f18::2]:443"}
	if strings.Join(tried, " ") != strings.Join(want, " ") {
		t.Errorf("dialled %v, want %v", tried, want)
	}
}
