// Package ecrtest stands in for Amazon ECR in tests: the ECR API's
// GetAuthorizationToken, issuing a token per region with a lifetime of the
// test's choosing, and regional registries that take only their region's
// unexpired tokens, answering as ECR does (401 with a Basic challenge
// without credentials, 403 "Your Authorization Token has expired" with a
// bad or expired one).
package ecrtest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"time"
)

// API is the ECR API's GetAuthorizationToken, speaking the AWS JSON 1.1
// protocol the SDK uses. Point the SDK at it with its base endpoint.
type API struct {
	lifetime time.Duration

	mu      sync.Mutex
	now     func() time.Time
	issued  map[string][]string  // region → tokens, oldest first
	expires map[string]time.Time // token → its expiry
	changed chan struct{}        // closed and replaced on every token issued
}

// NewAPI returns an API issuing tokens that live for lifetime.
func NewAPI(lifetime time.Duration) *API {
	return &API{lifetime: lifetime, now: time.Now, issued: map[string][]string{}, expires: map[string]time.Time{},
		changed: make(chan struct{})}
}

// SetClock replaces the clock tokens are issued and checked by.
func (a *API) SetClock(now func() time.Time) {
	a.mu.Lock()
	a.now = now
	a.mu.Unlock()
}

// The region a request was signed for, from its SigV4 credential scope.
var scopeRegion = regexp.MustCompile(`Credential=[^/]+/\d{8}/([a-z0-9-]+)/ecr/aws4_request`)

// TokenPrefix starts every token issued, so tests can look for leaks.
const TokenPrefix = "secret-ecr-"

func (a *API) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m := scopeRegion.FindStringSubmatch(r.Header.Get("Authorization"))
	if m == nil || !strings.HasSuffix(r.Header.Get("X-Amz-Target"), ".GetAuthorizationToken") {
		w.Header().Set("Content-Type", "application/x-amz-json-1.1")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"__type":"InvalidSignatureException","message":"not a signed GetAuthorizationToken"}`)
		return
	}
	region := m[1]
	a.mu.Lock()
	tok := fmt.Sprintf("%s%s-%d", TokenPrefix, region, len(a.issued[region])+1)
	a.issued[region] = append(a.issued[region], tok)
	expires := a.now().Add(a.lifetime)
	a.expires[tok] = expires
	close(a.changed)
	a.changed = make(chan struct{})
	a.mu.Unlock()
	w.Header().Set("Content-Type", "application/x-amz-json-1.1")
	json.NewEncoder(w).Encode(map[string]any{"authorizationData": []map[string]any{{
		"authorizationToken": base64.StdEncoding.EncodeToString([]byte("AWS:" + tok)),
		"expiresAt":          float64(expires.Unix()),
		"proxyEndpoint":      "https://123456789012.dkr.ecr." + region + ".amazonaws.com",
	}}})
}

// Valid reports whether tok was issued for region and has not expired.
func (a *API) Valid(region, tok string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	exp, ok := a.expires[tok]
	return ok && strings.HasPrefix(tok, TokenPrefix+region+"-") && a.now().Before(exp)
}

// Tokens returns the tokens issued for region, oldest first.
func (a *API) Tokens(region string) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.issued[region]...)
}

// WaitTokens waits until n tokens were issued for region.
func (a *API) WaitTokens(ctx context.Context, region string, n int) error {
	for {
		a.mu.Lock()
		have, changed := len(a.issued[region]), a.changed
		a.mu.Unlock()
		if have >= n {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("%d tokens for %s, want %d: %w", have, region, n, ctx.Err())
		}
	}
}

// Registry puts ECR's authentication for one region in front of a registry.
type Registry struct {
	region string
	api    *API
	next   http.Handler

	mu       sync.Mutex
	expired  map[string]bool
	refusals int
}

// NewRegistry returns region's registry, serving next to requests bearing a
// valid token for region.
func NewRegistry(region string, api *API, next http.Handler) *Registry {
	return &Registry{region: region, api: api, next: next, expired: map[string]bool{}}
}

func (g *Registry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	user, pass, ok := r.BasicAuth()
	if !ok {
		w.Header().Set("WWW-Authenticate", `Basic realm="https://ecr.test/",service="ecr.amazonaws.com"`)
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, `{"errors":[{"code":"DENIED","message":"Not Authorized"}]}`)
		return
	}
	g.mu.Lock()
	valid := user == "AWS" && g.api.Valid(g.region, pass) && !g.expired[pass]
	if !valid {
		g.refusals++
	}
	g.mu.Unlock()
	if !valid {
		w.WriteHeader(http.StatusForbidden)
		io.WriteString(w, `{"errors":[{"code":"DENIED","message":"Your Authorization Token has expired. Please run 'aws ecr get-login-password' to fetch a new one."}]}`)
		return
	}
	g.next.ServeHTTP(w, r)
}

// Expire makes the registry refuse every token issued so far.
func (g *Registry) Expire() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, tok := range g.api.Tokens(g.region) {
		g.expired[tok] = true
	}
}

// Refusals returns how many requests bore a token that was refused.
func (g *Registry) Refusals() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.refusals
}
