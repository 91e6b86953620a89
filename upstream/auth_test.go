package upstream

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/opencontainers/go-digest"
)

func TestParseChallenge(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		header string
		ok     bool
		scheme string
		params map[string]string
	}{
		{"Docker Hub",
			`Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/alpine:pull"`,
			true, "bearer", map[string]string{"realm": "https://auth.docker.io/token", "service": "registry.docker.io", "scope": "repository:library/alpine:pull"}},
		{"GHCR",
			`Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:user/image:pull"`,
			true, "bearer", map[string]string{"realm": "https://ghcr.io/token", "service": "ghcr.io", "scope": "repository:user/image:pull"}},
		{"ECR basic",
			`Basic realm="https://123.dkr.ecr.us-east-1.amazonaws.com/",service="ecr.amazonaws.com"`,
			true, "basic", map[string]string{"realm": "https://123.dkr.ecr.us-east-1.amazonaws.com/", "service": "ecr.amazonaws.com"}},
		{"quay, no scope",
			`Bearer realm="https://quay.io/v2/auth",service="quay.io"`,
			true, "bearer", map[string]string{"realm": "https://quay.io/v2/auth", "service": "quay.io"}},
		{"unquoted values",
			`Bearer realm=https://auth.example/token,service=registry.example`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token", "service": "registry.example"}},
		{"unquoted value with = in it",
			`Bearer realm=https://auth.example/token?a=b,service=registry.example`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token?a=b", "service": "registry.example"}},
		{"mixed quoting",
			`Bearer realm="https://auth.example/token",service=registry.example,scope="repository:a:pull"`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token", "service": "registry.example", "scope": "repository:a:pull"}},
		{"escaped quotes",
			`Bearer realm="https://auth.example/token",error="insufficient_scope",error_description="say \"please\""`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token", "error": "insufficient_scope", "error_description": `say "please"`}},
		{"escaped backslash",
			`Basic realm="a\\b"`,
			true, "basic", map[string]string{"realm": `a\b`}},
		{"commas inside quotes",
			`Bearer realm="https://auth.example/token",scope="repository:a/b:pull,push",service="x"`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token", "scope": "repository:a/b:pull,push", "service": "x"}},
		{"spaces after commas",
			`Bearer realm="https://auth.example/token", service="registry.example",  scope="repository:a:pull"`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token", "service": "registry.example", "scope": "repository:a:pull"}},
		{"case folded scheme and keys",
			`BEARER Realm="https://auth.example/token",SERVICE="Registry.Example"`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token", "service": "Registry.Example"}},
		{"surrounding whitespace",
			"  Bearer realm=\"https://auth.example/token\"  ",
			true, "bearer", map[string]string{"realm": "https://auth.example/token"}},
		{"unterminated quote",
			`Bearer realm="https://auth.example/token`,
			true, "bearer", map[string]string{"realm": "https://auth.example/token"}},
		{"scheme only", `Bearer`, true, "bearer", map[string]string{}},
		{"empty", ``, false, "", nil},
		{"whitespace", "   ", false, "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, ok := parseChallenge(tt.header)
			if ok != tt.ok {
				t.Fatalf("ok: got %v, want %v", ok, tt.ok)
			}
			if !ok {
				return
			}
			if got.scheme != tt.scheme {
				t.Errorf("scheme: got %v, want %v", got.scheme, tt.scheme)
			}
			if !maps.Equal(got.params, tt.params) {
				t.Errorf("params: got %v, want %v", got.params, tt.params)
			}
		})
	}
}

// Token auth test servers. Both work over httptest and, for tests in
// synctest bubbles, over memNet.

const testService = "registry.test"

var scopePattern = regexp.MustCompile(`^repository:[a-z0-9]+(?:[/._-][a-z0-9]+)*:pull$`)

// tokenServer issues bearer tokens the way auth.docker.io does. Tokens are
// distinct and easy to search for in error strings.
type tokenServer struct {
	expiresIn int           // seconds; 0: omitted from the answer
	status    int           // when not 0, every request fails with it
	body      string        // when not "", the answer instead of a token
	block     chan struct{} // when not nil, each request waits for it to close

	mu       sync.Mutex
	issued   []string             // every token, in order
	scopes   map[string]string    // token → scope
	issuedAt map[string]time.Time // token → when
	fetches  map[string]int       // scope → tokens issued
	requests int
	problems []string // protocol violations seen
}

func newTokenServer() *tokenServer {
	return &tokenServer{scopes: map[string]string{}, issuedAt: map[string]time.Time{}, fetches: map[string]int{}}
}

func (s *tokenServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.requests++
	s.mu.Unlock()
	if s.block != nil {
		<-s.block
	}
	if s.status != 0 {
		w.WriteHeader(s.status)
		return
	}
	if s.body != "" {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, s.body)
		return
	}
	q := r.URL.Query()
	service, scope := q.Get("service"), q.Get("scope")
	s.mu.Lock()
	defer s.mu.Unlock()
	if r.Method != http.MethodGet || service != testService || !scopePattern.MatchString(scope) {
		s.problems = append(s.problems, fmt.Sprintf("%s %s", r.Method, r.URL))
		http.Error(w, "bad token request", http.StatusBadRequest)
		return
	}
	tok := fmt.Sprintf("secret-token-%d", len(s.issued)+1)
	s.issued = append(s.issued, tok)
	s.scopes[tok] = scope
	s.issuedAt[tok] = time.Now()
	s.fetches[scope]++
	answer := map[string]any{"token": tok, "issued_at": time.Now().Format(time.RFC3339)}
	if s.expiresIn != 0 {
		answer["expires_in"] = s.expiresIn
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(answer)
}

// valid reports whether tok was issued for scope and has not expired.
func (s *tokenServer) valid(tok, scope string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	life := time.Duration(s.expiresIn) * time.Second
	if s.expiresIn == 0 {
		life = 60 * time.Second
	}
	at, ok := s.issuedAt[tok]
	return ok && s.scopes[tok] == scope && time.Since(at) < life
}

func (s *tokenServer) fetchCount(scope string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fetches[scope]
}

func (s *tokenServer) totalFetches() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.issued)
}

func (s *tokenServer) requestCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requests
}

func (s *tokenServer) tokens() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.issued...)
}

func (s *tokenServer) checkProtocol(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.problems) > 0 {
		t.Errorf("bad token requests: got %v, want none", s.problems)
	}
}

// bearerRegistry serves one manifest and one blob in every repository to
// requests bearing a token the token server issued for the repository.
type bearerRegistry struct {
	realm    string
	tokens   *tokenServer
	manifest []byte
	blob     []byte
	// accept, when set, must also accept a token: a registry rotating keys.
	accept func(tok string) bool
	// blobLocation, when set, is where blob GETs are redirected.
	blobLocation string

	mu              sync.Mutex
	unauthenticated int      // requests without an Authorization header
	rejected        []string // tokens refused
}

func (g *bearerRegistry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rest, ok := strings.CutPrefix(r.URL.Path, "/v2/")
	if !ok {
		http.NotFound(w, r)
		return
	}
	var repo, kind, ref string
	for _, k := range []string{"/manifests/", "/blobs/"} {
		if i := strings.LastIndex(rest, k); i > 0 {
			repo, kind, ref = rest[:i], strings.Trim(k, "/"), rest[i+len(k):]
			break
		}
	}
	if repo == "" {
		http.NotFound(w, r)
		return
	}
	scope := "repository:" + repo + ":pull"
	auth := r.Header.Get("Authorization")
	tok, bearer := strings.CutPrefix(auth, "Bearer ")
	if !bearer || !g.tokens.valid(tok, scope) || (g.accept != nil && !g.accept(tok)) {
		g.mu.Lock()
		if auth == "" {
			g.unauthenticated++
		} else {
			g.rejected = append(g.rejected, tok)
		}
		g.mu.Unlock()
		w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm=%q,service=%q,scope=%q`, g.realm, testService, scope))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprint(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`)
		return
	}
	switch kind {
	case "manifests":
		w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
		w.Header().Set("Docker-Content-Digest", digest.FromBytes(g.manifest).String())
		w.Header().Set("Content-Length", fmt.Sprint(len(g.manifest)))
		if r.Method == http.MethodGet {
			w.Write(g.manifest)
		}
	case "blobs":
		if ref != digest.FromBytes(g.blob).String() {
			http.NotFound(w, r)
			return
		}
		if g.blobLocation != "" {
			http.Redirect(w, r, g.blobLocation, http.StatusTemporaryRedirect)
			return
		}
		w.Header().Set("Content-Length", fmt.Sprint(len(g.blob)))
		w.Write(g.blob)
	}
}

func (g *bearerRegistry) counts() (unauthenticated int, rejected []string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.unauthenticated, append([]string(nil), g.rejected...)
}

// newBearerSetup starts a token server and a registry using it over
// httptest, after configure (if not nil) has set them up.
func newBearerSetup(t *testing.T, configure func(*tokenServer, *bearerRegistry)) (*tokenServer, *bearerRegistry, *Registry) {
	t.Helper()
	ts := newTokenServer()
	tsrv := httptest.NewServer(ts)
	t.Cleanup(tsrv.Close)
	g := &bearerRegistry{realm: tsrv.URL + "/token", tokens: ts,
		manifest: []byte(`{"schemaVersion":2}`), blob: []byte("layer bytes")}
	if configure != nil {
		configure(ts, g)
	}
	gsrv := httptest.NewServer(g)
	t.Cleanup(gsrv.Close)
	t.Cleanup(func() { ts.checkProtocol(t) })
	return ts, g, newTestRegistry(t, gsrv.URL)
}

// newMemBearerSetup is newBearerSetup over memNet, for synctest bubbles.
func newMemBearerSetup(t *testing.T) (*tokenServer, *bearerRegistry, *Registry) {
	t.Helper()
	ts := newTokenServer()
	g := &bearerRegistry{realm: "https://auth.test/token", tokens: ts,
		manifest: []byte(`{"schemaVersion":2}`), blob: []byte("layer bytes")}
	t.Cleanup(func() { ts.checkProtocol(t) })
	n := memNet{"auth.test": handlerRT{ts}, "registry.test": handlerRT{g}}
	return ts, g, newMemRegistry(t, n, "https://registry.test")
}

// checkNoTokens fails when an error's text holds an issued token.
func checkNoTokens(t *testing.T, ts *tokenServer, errs ...error) {
	t.Helper()
	for _, err := range errs {
		if err == nil {
			continue
		}
		for _, tok := range ts.tokens() {
			if strings.Contains(err.Error(), tok) {
				t.Errorf("got error %q, want no token in it", err)
			}
		}
	}
}

func TestBearerFlow(t *testing.T) {
	t.Parallel()
	ts, g, r := newBearerSetup(t, nil)
	ctx := t.Context()
	const repo = "library/alpine"
	scope := "repository:" + repo + ":pull"

	for i := range 3 {
		desc, err := r.HeadManifest(ctx, repo, "latest", nil)
		if err != nil {
			t.Fatalf("HeadManifest %d: got %v, want no error", i, err)
		}
		if want := digest.FromBytes(g.manifest); desc.Digest != want {
			t.Errorf("HeadManifest %d: got digest %v, want %v", i, desc.Digest, want)
		}
		_, body, err := r.GetManifest(ctx, repo, "latest", nil)
		if err != nil {
			t.Fatalf("GetManifest %d: got %v, want no error", i, err)
		}
		if string(body) != string(g.manifest) {
			t.Errorf("GetManifest %d: got %s, want %s", i, body, g.manifest)
		}
		w := newMemBlobWriter(-1)
		if _, err := r.FetchBlob(ctx, repo, digest.FromBytes(g.blob), w); err != nil {
			t.Fatalf("FetchBlob %d: got %v, want no error", i, err)
		}
		if string(w.Bytes()) != string(g.blob) {
			t.Errorf("FetchBlob %d: got %q, want %q", i, w.Bytes(), g.blob)
		}
	}
	if got := ts.fetchCount(scope); got != 1 {
		t.Errorf("token fetches for %s: got %v, want %v", scope, got, 1)
	}
	// Once the challenge is known, requests carry the token up front.
	if got, _ := g.counts(); got != 1 {
		t.Errorf("requests without a token: got %v, want %v", got, 1)
	}
	// A missing manifest is still a 404 behind auth, without a new token.
	_, _, err := r.GetManifest(ctx, repo, "sha256:"+strings.Repeat("0", 64), nil)
	if err == nil {
		t.Fatalf("GetManifest of another digest: got no error, want one")
	}
	checkNoTokens(t, ts, err)
	if got := ts.totalFetches(); got != 1 {
		t.Errorf("token fetches: got %v, want %v", got, 1)
	}
}

func TestBearerScopePerRepository(t *testing.T) {
	t.Parallel()
	ts, _, r := newBearerSetup(t, nil)
	ctx := t.Context()
	repos := []string{"library/alpine", "library/busybox", "org/team/app"}
	for range 2 {
		for _, repo := range repos {
			if _, err := r.HeadManifest(ctx, repo, "latest", nil); err != nil {
				t.Fatalf("HeadManifest %s: got %v, want no error", repo, err)
			}
		}
	}
	for _, repo := range repos {
		scope := "repository:" + repo + ":pull"
		if got := ts.fetchCount(scope); got != 1 {
			t.Errorf("token fetches for %s: got %v, want %v", scope, got, 1)
		}
	}
	if got := ts.totalFetches(); got != len(repos) {
		t.Errorf("token fetches: got %v, want %v", got, len(repos))
	}
}

// TestBearerSingleflight checks that concurrent first requests wait for one
// token fetch. It runs in a bubble so that every request is known to be
// waiting before the token server answers.
func TestBearerSingleflight(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ts, g, r := newMemBearerSetup(t)
		ts.block = make(chan struct{})
		const n = 8
		errs := make(chan error, n)
		for range n {
			go func() {
				_, err := r.HeadManifest(t.Context(), "library/alpine", "latest", nil)
				errs <- err
			}()
		}
		synctest.Wait() // all n are blocked: n-1 on the fetch, which is blocked in the token server
		if got := ts.requestCount(); got != 1 {
			t.Errorf("token requests while blocked: got %v, want %v", got, 1)
		}
		if got, _ := g.counts(); got != n {
			t.Errorf("requests without a token: got %v, want %v", got, n)
		}
		close(ts.block)
		for range n {
			if err := <-errs; err != nil {
				t.Errorf("HeadManifest: got %v, want no error", err)
			}
		}
		if got := ts.totalFetches(); got != 1 {
			t.Errorf("token fetches: got %v, want %v", got, 1)
		}
	})
}

// TestBearerWaiterCancelled checks that a request waiting on another's token
// fetch gives up when its context ends, and the fetch carries on for the rest.
func TestBearerWaiterCancelled(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ts, _, r := newMemBearerSetup(t)
		ts.block = make(chan struct{})
		first := make(chan error, 1)
		go func() {
			_, err := r.HeadManifest(t.Context(), "library/alpine", "latest", nil)
			first <- err
		}()
		synctest.Wait() // the first request is in the token server
		ctx, cancel := context.WithCancel(t.Context())
		second := make(chan error, 1)
		go func() {
			_, err := r.HeadManifest(ctx, "library/alpine", "latest", nil)
			second <- err
		}()
		synctest.Wait() // the second waits on the first's fetch
		cancel()
		if err := <-second; !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled waiter: got %v, want %v", err, context.Canceled)
		}
		close(ts.block)
		if err := <-first; err != nil {
			t.Errorf("first request: got %v, want no error", err)
		}
		if got := ts.totalFetches(); got != 1 {
			t.Errorf("token fetches: got %v, want %v", got, 1)
		}
	})
}

// TestBearerRejectedFreshTokenForgotten checks that a token the registry
// refuses right after it was issued is not used again: the next request
// fetches a new one.
func TestBearerRejectedFreshTokenForgotten(t *testing.T) {
	t.Parallel()
	ts, g, r := newBearerSetup(t, func(_ *tokenServer, g *bearerRegistry) {
		g.accept = func(tok string) bool { return tok != "secret-token-1" }
	})
	ctx := t.Context()

	_, err := r.HeadManifest(ctx, "library/alpine", "latest", nil)
	checkKind(t, err, ErrUnauthorized)
	if e := asError(t, err); e.Status != http.StatusUnauthorized {
		t.Errorf("Status: got %v, want %v", e.Status, http.StatusUnauthorized)
	}
	checkNoTokens(t, ts, err)
	for i := range 3 {
		if _, err := r.HeadManifest(ctx, "library/alpine", "latest", nil); err != nil {
			t.Fatalf("HeadManifest %d after the rejection: got %v, want no error", i, err)
		}
	}
	if got := ts.totalFetches(); got != 2 {
		t.Errorf("token fetches: got %v, want %v", got, 2)
	}
	if _, rejected := g.counts(); len(rejected) != 1 || rejected[0] != "secret-token-1" {
		t.Errorf("tokens rejected: got %v, want %v", rejected, []string{"secret-token-1"})
	}
}

// TestBearerRotatedTokenRefetched: a cached token the registry stops
// accepting before its expiry is dropped and replaced within the same call.
func TestBearerRotatedTokenRefetched(t *testing.T) {
	t.Parallel()
	var rotated atomic.Bool
	ts, g, r := newBearerSetup(t, func(_ *tokenServer, g *bearerRegistry) {
		g.accept = func(tok string) bool { return !rotated.Load() || tok != "secret-token-1" }
	})
	ctx := t.Context()
	if _, err := r.HeadManifest(ctx, "library/alpine", "latest", nil); err != nil {
		t.Fatal(err)
	}
	rotated.Store(true)
	if _, err := r.HeadManifest(ctx, "library/alpine", "latest", nil); err != nil {
		t.Fatalf("HeadManifest after rotation: got %v, want no error", err)
	}
	if got := ts.totalFetches(); got != 2 {
		t.Errorf("token fetches: got %v, want %v", got, 2)
	}
	if _, rejected := g.counts(); len(rejected) != 1 {
		t.Errorf("tokens rejected: got %v, want one", rejected)
	}
}

func TestBearerTokenServerFailure(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		status int
		body   string
		kind   error // a token server that is down is unavailable, not a refusal
	}{
		{"500", http.StatusInternalServerError, "", ErrUnavailable},
		{"403", http.StatusForbidden, "", ErrUnauthorized},
		{"not JSON", 0, "<html>maintenance</html>", ErrUnauthorized},
		{"no token", 0, `{"expires_in":300}`, ErrUnauthorized},
		{"empty token", 0, `{"token":"","access_token":""}`, ErrUnauthorized},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ts, _, r := newBearerSetup(t, func(ts *tokenServer, _ *bearerRegistry) {
				ts.status, ts.body = tt.status, tt.body
			})
			ctx := t.Context()
			var errs []error
			for range 2 {
				_, err := r.HeadManifest(ctx, "library/alpine", "latest", nil)
				checkKind(t, err, tt.kind)
				e := asError(t, err)
				if e.Status != http.StatusUnauthorized {
					t.Errorf("Status: got %v, want %v", e.Status, http.StatusUnauthorized)
				}
				if want := "HEAD /v2/library/alpine/manifests/latest"; e.Op != want {
					t.Errorf("Op: got %v, want %v", e.Op, want)
				}
				errs = append(errs, err)
			}
			want := 2
			if tt.kind == ErrUnauthorized { // not retried, so quick to check on the blob path too
				w := newMemBlobWriter(-1)
				_, err := r.FetchBlob(ctx, "library/alpine", digest.FromString("x"), w)
				checkKind(t, err, tt.kind)
				errs = append(errs, err)
				want++
			}
			checkNoTokens(t, ts, errs...)
			// A failure is not cached: each call asks again.
			if got := ts.requestCount(); got != want {
				t.Errorf("token requests: got %v, want %v", got, want)
			}
		})
	}
}

// TestBearerBadChallenge checks bearer challenges that name no usable realm.
func TestBearerBadChallenge(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		challenge string
	}{
		{"no realm", `Bearer service="registry.test"`},
		{"realm not http", `Bearer realm="ftp://auth.test/token",service="registry.test"`},
		{"realm not a URL", `Bearer realm="::",service="registry.test"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("WWW-Authenticate", tt.challenge)
				w.WriteHeader(http.StatusUnauthorized)
			}))
			t.Cleanup(srv.Close)
			r := newTestRegistry(t, srv.URL)
			_, _, err := r.GetManifest(t.Context(), "library/alpine", "latest", nil)
			checkKind(t, err, ErrUnauthorized)
			if e := asError(t, err); e.Status != http.StatusUnauthorized {
				t.Errorf("Status: got %v, want %v", e.Status, http.StatusUnauthorized)
			}
		})
	}
}

// TestTokenAnswerFields checks the token answer's two spellings.
func TestTokenAnswerFields(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		body string
		want string
	}{
		{"token", `{"token":"t1"}`, "t1"},
		{"access_token", `{"access_token":"t2","expires_in":300}`, "t2"},
		{"token preferred", `{"token":"t3","access_token":"t4"}`, "t3"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			query := make(chan string, 1)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				query <- r.URL.RawQuery
				fmt.Fprint(w, tt.body)
			}))
			t.Cleanup(srv.Close)
			c := newTokenCache(srv.Client())
			ch := challenge{scheme: "bearer", params: map[string]string{"realm": srv.URL + "/token?client_id=pullproxy", "service": "svc"}}
			got, key, err := c.get(t.Context(), ch, "repository:a/b:pull", nil)
			if err != nil {
				t.Fatalf("got %v, want no error", err)
			}
			if got != tt.want {
				t.Errorf("token: got %v, want %v", got, tt.want)
			}
			if want := tokenKey(srv.URL+"/token?client_id=pullproxy", "svc", "repository:a/b:pull"); key != want {
				t.Errorf("key: got %v, want %v", key, want)
			}
			want := "client_id=pullproxy&scope=repository%3Aa%2Fb%3Apull&service=svc"
			if got := <-query; got != want {
				t.Errorf("token request query: got %v, want %v", got, want)
			}
		})
	}
}

// TestTokenExpiry checks when a cached token is replaced, on the bubble's
// fake clock; the registry refuses tokens past their stated lifetime.
func TestTokenExpiry(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		expiresIn int           // 0: not stated
		refresh   time.Duration // when the token is replaced
	}{
		{"five minutes", 300, 270 * time.Second},
		{"unstated: 60 s", 0, 30 * time.Second},
		{"40 s: half its life", 40, 20 * time.Second},
		{"10 s: half its life", 10, 5 * time.Second},
		{"one hour", 3600, 3570 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				ts, _, r := newMemBearerSetup(t)
				ts.expiresIn = tt.expiresIn
				head := func(when string) {
					t.Helper()
					if _, err := r.HeadManifest(t.Context(), "library/alpine", "latest", nil); err != nil {
						t.Fatalf("HeadManifest %s: got %v, want no error", when, err)
					}
				}
				head("at first")
				time.Sleep(tt.refresh - time.Second)
				head("just before the refresh")
				if got := ts.totalFetches(); got != 1 {
					t.Errorf("token fetches just before the refresh: got %v, want %v", got, 1)
				}
				time.Sleep(2 * time.Second)
				head("just after the refresh")
				if got := ts.totalFetches(); got != 2 {
					t.Errorf("token fetches just after the refresh: got %v, want %v", got, 2)
				}
			})
		})
	}
}
