// Package upstream talks to the registries pullproxy mirrors: the
// distribution API's read side, token auth, and fetching blobs into a
// caller-supplied writer.
package upstream

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
)

// MaxManifestSize is the largest manifest accepted from an upstream. containerd
// refuses manifests over 4 MiB, so a larger one is of no use to any client.
const MaxManifestSize = 4 << 20

// Descriptor describes a manifest as an upstream serves it.
type Descriptor struct {
	Digest    digest.Digest
	MediaType string
	Size      int64
}

// Registry is one configured upstream: a name (docker.io, an ECR host, …) and
// the endpoints that serve it, tried in order.
type Registry struct {
	name      string
	creds     Credentials // nil: anonymous
	endpoints []*endpoint
	client    *http.Client    // manifests, tokens, HEADs: pooled connections, redirects followed
	chunks    *http.Transport // blob chunks: each lane clones it (see newChunkTransport); nil with a caller's own RoundTripper
	dialer    *chunkDialer    // chunks' connections; nil with a caller's own RoundTripper
	ownChunks *http.Client    // with a caller's own RoundTripper: every lane's client
	fetch     FetchConfig
	tokens    *tokenCache
	log       *slog.Logger
	metrics   *Metrics
	received  prometheus.Counter // blob bytes from this upstream

	// challenges remembers each host's bearer challenge, so requests after
	// the first carry a token up front instead of collecting a 401 each.
	challenges sync.Map // host → challenge
	limit      rateLimit
	pulls      pullCount        // the rate-limit window last told of (see PullsLeft)
	corrupt    corruptBlobs     // blobs that failed verification, by endpoint
	now        func() time.Time // the clock corrupt blobs' waits are timed by
	targets    *targets         // where requests may go besides the endpoints, and with which credentials

	buffers sync.Pool // *[]byte of fetchBufferSize, one per running fetch
}

// Option configures a Registry. An option given a nil value is as if it
// were not given: the default applies.
type Option func(*options) error

type options struct {
	transport http.RoundTripper
	log       *slog.Logger
	metrics   *Metrics
	fetch     FetchConfig
	creds     Credentials
	regions   map[string]string // endpoint URL → region
	failover  map[string]bool   // endpoint URLs kept for failover only
	tls       *tls.Config
	realms    []string // token realm hosts credentials may go to
	allow     []string // redirect targets allowed whatever their address
	now       func() time.Time
	// policy replaces how addresses are classified and names resolved:
	// tests, whose every address is a loopback one.
	policy func(*targets)
}

// WithTransport sets the HTTP transport. Default: a transport with sane
// dial, TLS-handshake and response-header timeouts.
func WithTransport(rt http.RoundTripper) Option {
	return func(o *options) error { o.transport = rt; return nil }
}

// WithLogger sets the logger. Default: slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l != nil {
			o.log = l
		}
		return nil
	}
}

// WithMetrics sets where metrics are counted. Default: metrics registered nowhere.
func WithMetrics(m *Metrics) Option {
	return func(o *options) error { o.metrics = m; return nil }
}

// WithCredentials sets the credentials the upstream's endpoints take.
// Default: none (anonymous, with anonymous bearer tokens).
func WithCredentials(c Credentials) Option {
	return func(o *options) error { o.creds = c; return nil }
}

// WithEndpointRegion names the region of the endpoint with the given URL,
// overriding the one read from its host (ECR). Repeatable.
func WithEndpointRegion(endpointURL, region string) Option {
	return func(o *options) error {
		if o.regions == nil {
			o.regions = map[string]string{}
		}
		o.regions[strings.TrimSuffix(endpointURL, "/")] = region
		return nil
	}
}

// WithFailoverOnly keeps the endpoint with the given URL for failover only:
// it is asked for a blob only once the endpoints that share the upstream's
// content have all failed to bring it, one endpoint at a time, rather than
// fetching chunks alongside them (an endpoint that costs money per byte, or
// one whose content may lag). Repeatable.
func WithFailoverOnly(endpointURL string) Option {
	return func(o *options) error {
		if o.failover == nil {
			o.failover = map[string]bool{}
		}
		o.failover[strings.TrimSuffix(endpointURL, "/")] = true
		return nil
	}
}

// WithTLSConfig sets the TLS settings of the upstream's connections: a CA
// bundle of its own (RootCAs), or, where a caller insists, no verification.
// It applies to a copy of the transport, which must be an *http.Transport.
// Default: the transport's settings (the system's roots).
func WithTLSConfig(c *tls.Config) Option {
	return func(o *options) error { o.tls = c; return nil }
}

// WithTokenRealmHosts lists hosts, besides the endpoints' own, that a
// token realm may be on and still be sent the upstream's credentials
// (https only). Docker Hub's auth.docker.io and GitLab's gitlab.com are
// known. A realm on any other host is asked for an anonymous token.
func WithTokenRealmHosts(hosts ...string) Option {
	return func(o *options) error { o.realms = append(o.realms, hosts...); return nil }
}

// WithRedirectAllow lists hosts, addresses and networks (CIDR) that the
// upstream's redirects may go to although they are loopback, link-local or
// private (and, for hosts, over plain http from an https endpoint). Default:
// none beyond the kinds of address the endpoints themselves were reached
// at.
func WithRedirectAllow(entries ...string) Option {
	return func(o *options) error { o.allow = append(o.allow, entries...); return nil }
}

// WithClock sets the clock that times how long an endpoint that served a
// blob corrupt is kept from it: tests move it instead of waiting. Default:
// time.Now.
func WithClock(now func() time.Time) Option {
	return func(o *options) error {
		if now != nil {
			o.now = now
		}
		return nil
	}
}

// WithFetchConfig tunes blob fetching; see FetchConfig for the defaults.
func WithFetchConfig(c FetchConfig) Option {
	return func(o *options) error { o.fetch = c; return nil }
}

// NewTransport returns the default upstream transport. Its TLS sessions are
// resumed from a cache: metadata connections are retired at half their byte
// budget, so across a cutting path they are opened often.
func NewTransport() *http.Transport {
	return &http.Transport{
		TLSClientConfig:       &tls.Config{ClientSessionCache: tls.NewLRUClientSessionCache(sessionCacheSize)},
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		ForceAttemptHTTP2:     true,
		MaxIdleConnsPerHost:   16,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 30 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
}

// New returns the upstream named name, served by the endpoint URLs in order.
func New(name string, endpoints []string, opts ...Option) (*Registry, error) {
	o := options{log: slog.Default(), now: time.Now}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, fmt.Errorf("upstream %s: %w", name, err)
		}
	}
	if o.transport == nil {
		o.transport = NewTransport()
	}
	if o.tls != nil {
		t, ok := o.transport.(*http.Transport)
		if !ok {
			return nil, fmt.Errorf("upstream %s: TLS settings need an *http.Transport, not a %T", name, o.transport)
		}
		t = t.Clone()
		cfg := o.tls.Clone()
		if cfg.ClientSessionCache == nil {
			cfg.ClientSessionCache = tls.NewLRUClientSessionCache(sessionCacheSize)
		}
		t.TLSClientConfig = cfg
		o.transport = t
	}
	if o.metrics == nil {
		m, err := NewMetrics(prometheus.NewRegistry())
		if err != nil {
			return nil, err
		}
		o.metrics = m
	}
	if name == "" {
		return nil, errors.New("upstream with no name")
	}
	if len(endpoints) == 0 {
		return nil, fmt.Errorf("upstream %s: no endpoints", name)
	}
	fetch, err := o.fetch.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("upstream %s: %w", name, err)
	}
	r := &Registry{
		name:    name,
		creds:   o.creds,
		client:  &http.Client{Transport: o.transport},
		fetch:   fetch,
		log:     o.log.With("upstream", name),
		metrics: o.metrics,
		now:     o.now,
	}
	r.received = o.metrics.blobBytes.WithLabelValues(name)
	if t, ok := o.transport.(*http.Transport); ok {
		r.chunks, r.dialer = newChunkTransport(t, fetch.FirstByteTimeout, fetch.StallTimeout)
	} else { // a caller's own transport: used as it is
		r.ownChunks = &http.Client{Transport: o.transport, CheckRedirect: noRedirects}
	}
	r.buffers.New = func() any { b := make([]byte, fetchBufferSize); return &b }
	for _, e := range endpoints {
		u, err := url.Parse(e)
		if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
			return nil, fmt.Errorf("upstream %s: endpoint %q is not an http(s)://host[:port] URL", name, e)
		}
		u.Path = strings.TrimSuffix(u.Path, "/")
		labels := prometheus.Labels{"upstream": name, "endpoint": u.Host}
		wasted := o.metrics.wasted.MustCurryWith(labels)
		region := o.regions[strings.TrimSuffix(e, "/")]
		if region == "" {
			region = ECRRegion(u.Host)
		}
		r.endpoints = append(r.endpoints, &endpoint{
			url:          u,
			host:         u.Host,
			key:          keyOf(u),
			region:       region,
			failoverOnly: o.failover[strings.TrimSuffix(e, "/")],
			budget:       newBudget(fetch, o.log.With("upstream", name, "endpoint", u.Host), o.metrics.budget.With(labels), o.metrics.cuts.MustCurryWith(labels)),
			pipe: newPipe(fetch.MaxConnections, fetch.BackgroundShare, r.newLane, o.log.With("upstream", name, "endpoint", u.Host),
				o.metrics.connLimit.With(labels), o.metrics.connsInFlight.With(labels)),
			chunks:    o.metrics.chunks.MustCurryWith(labels),
			bytes:     o.metrics.endpointBytes.With(labels),
			discarded: wasted.WithLabelValues("discarded"),
			abandoned: wasted.WithLabelValues("abandoned"),
			up:        o.metrics.endpointUp.With(labels),
		})
		ep := r.endpoints[len(r.endpoints)-1]
		ep.up.Set(1)
		if r.dialer != nil {
			ep.pipe.roundTrip = func() time.Duration { return r.dialer.roundTrip(ep.key) }
		}
	}
	urls := make([]*url.URL, len(r.endpoints))
	for i, ep := range r.endpoints {
		urls[i] = ep.url
	}
	var proxy func(*http.Request) (*url.URL, error)
	if t, ok := o.transport.(*http.Transport); ok {
		proxy = t.Proxy
	}
	if r.targets, err = newTargets(r.log, urls, proxy, o.realms, o.allow); err != nil {
		return nil, fmt.Errorf("upstream %s: %w", name, err)
	}
	if o.policy != nil {
		o.policy(r.targets)
	}
	if r.dialer != nil {
		r.dialer.dial = r.targets.guard(r.dialer.dial)
	}
	// Set once the endpoints are known: it holds each connection to its
	// endpoint's budget. The token cache shares the client.
	r.client.Transport = r.newMetaTransport(o.transport)
	r.client.CheckRedirect = r.targets.clientRedirect
	r.tokens = newTokenCache(r.client)
	return r, nil
}

// newLane returns a lane for a chunk connection slot: a client of its own
// over the chunk transport, or over the caller's own transport, whose
// connections it cannot see.
func (r *Registry) newLane() *lane {
	if r.chunks == nil {
		return &lane{client: r.ownChunks}
	}
	return &lane{client: &http.Client{Transport: r.chunks.Clone(), CheckRedirect: noRedirects}, conns: map[dialKey]*chunkConn{}}
}

// Name returns the upstream's configured name.
func (r *Registry) Name() string { return r.name }

// Endpoints returns the endpoint URLs, in the order they are tried.
func (r *Registry) Endpoints() []string {
	out := make([]string, len(r.endpoints))
	for i, ep := range r.endpoints {
		out[i] = ep.url.Redacted() // a password in the URL stays out of logs
	}
	return out
}

// request is one registry API call, before auth.
type request struct {
	method string
	repo   string
	path   string // below /v2/<repo>/, e.g. "manifests/latest"
	query  string // encoded, without "?"
	header http.Header
	client *http.Client // default: the registry's pooled client
}

func (q request) op() string { return q.method + " " + q.urlPath() }

// urlPath is q's path below an endpoint's: /v2/<repo>/<path>, or
// /v2/<path> for a request of no repository (the catalog).
func (q request) urlPath() string {
	if q.repo == "" {
		return "/v2/" + q.path
	}
	return "/v2/" + q.repo + "/" + q.path
}

// scope is the token scope q needs.
func (q request) scope() string {
	if q.repo == "" {
		return "registry:catalog:*"
	}
	return "repository:" + q.repo + ":pull"
}

// do sends q to each endpoint in turn until one answers with anything but a
// transport error or a 5xx, and returns that answer. A non-2xx answer comes
// back as an *Error; the caller closes the body of a successful one.
func (r *Registry) do(ctx context.Context, q request, ok ...int) (*http.Response, error) {
	var last error
	var failed []string // endpoints that could not answer
	eps := r.ordered(r.endpoints)
	for i, ep := range eps {
		resp, err := r.send(ctx, ep, q)
		if err == nil {
			if isOK(resp.StatusCode, ok) {
				ep.markUp()
				return resp, nil
			}
			e := r.statusError(ep.host, q.op(), resp)
			resp.Body.Close()
			if e.Kind == ErrNotFound && len(failed) > 0 && strings.HasPrefix(q.path, "manifests/") {
				// A replica answering for a dead primary may lack tags:
				// replication rules do not backfill what predates them.
				e.Message = fmt.Sprintf("%s: not on %s, asked because %s could not answer; "+
					"replication does not backfill tags pushed before the rule existed", e.Message, ep.name(),
					strings.Join(failed, ", "))
			}
			err = e
		}
		if !errors.Is(err, ErrUnavailable) || ctx.Err() != nil {
			return nil, err
		}
		last = err
		failed = append(failed, ep.name())
		if len(r.endpoints) > 1 {
			ep.markFailed(r, err)
		}
		if i+1 < len(eps) {
			r.log.Warn("endpoint failed, trying the next", "endpoint", ep.name(), "err", err)
		}
	}
	return nil, last
}

func isOK(status int, ok []int) bool {
	if len(ok) == 0 {
		return status == http.StatusOK
	}
	for _, s := range ok {
		if s == status {
			return true
		}
	}
	return false
}

// send performs q against one endpoint, with credentials: a cached bearer
// token, or preemptive basic credentials (ECR); else it answers the
// registry's challenge once, Bearer or Basic. Preemptive credentials the
// registry refuses (an expired ECR token gets 403) are renewed once.
func (r *Registry) send(ctx context.Context, ep *endpoint, q request) (*http.Response, error) {
	scope := q.scope()
	who := Endpoint{Upstream: r.name, Host: ep.host, Region: ep.region}
	var auth, cachedKey string
	if v, ok := r.challenges.Load(ep.host); ok {
		ch := v.(challenge)
		key := tokenKey(ch.params["realm"], ch.params["service"], scope)
		if tok, ok := r.tokens.cached(key); ok {
			auth, cachedKey = "Bearer "+tok, key
		}
	}
	pre, preemptive := r.creds.(Preemptive)
	if auth == "" && preemptive {
		var err error
		if auth, err = r.basicAuth(ctx, who); err != nil {
			return nil, r.authError(ep, q, err)
		}
	}
	resp, err := r.sendOnce(ctx, ep.url, q, auth)
	if err != nil {
		return nil, err
	}
	if preemptive && auth != "" && cachedKey == "" &&
		(resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden) && pre.Refresh(ctx, who) {
		resp.Body.Close()
		r.log.Info("credentials refused, renewing them", "endpoint", ep.host, "status", resp.StatusCode)
		if auth, err = r.basicAuth(ctx, who); err != nil {
			return nil, r.authError(ep, q, err)
		}
		return r.refusedCredentials(ep, q)(r.sendOnce(ctx, ep.url, q, auth))
	}
	if resp.StatusCode != http.StatusUnauthorized {
		return resp, nil
	}
	if cachedKey != "" {
		r.tokens.forget(cachedKey) // rotated or revoked before its time
	}
	ch, ok := parseChallenge(resp.Header.Get("WWW-Authenticate"))
	switch {
	case ok && ch.scheme == "basic" && !preemptive:
		if auth, err = r.basicAuth(ctx, who); err != nil {
			resp.Body.Close()
			return nil, r.authError(ep, q, err)
		}
		if auth == "" {
			e := r.statusError(ep.host, q.op(), resp)
			resp.Body.Close()
			e.Message = "no basic auth credentials for " + ep.name() + " (the registry says: " + e.Message + ")"
			return nil, e
		}
		resp.Body.Close()
		return r.refusedCredentials(ep, q)(r.sendOnce(ctx, ep.url, q, auth))
	case !ok || ch.scheme != "bearer":
		return resp, nil // no usable challenge: the 401 stands
	}
	resp.Body.Close()
	r.challenges.Store(ep.host, ch)
	tok, key, err := r.tokens.get(ctx, ch, scope, func(ctx context.Context, realm *url.URL) (string, string, bool, error) {
		if r.creds == nil {
			return "", "", false, nil
		}
		if err := r.targets.realmCredentials(realm, ep.url); err != nil {
			r.targets.withheld(realm, err)
			return "", "", false, nil
		}
		return r.creds.Basic(ctx, who)
	})
	if err != nil {
		return nil, r.authError(ep, q, err)
	}
	resp, err = r.sendOnce(ctx, ep.url, q, "Bearer "+tok)
	if err == nil && resp.StatusCode == http.StatusUnauthorized {
		r.tokens.forget(key)
	}
	return resp, err
}

// refusedCredentials turns a 401 or 403 to a request that carried our
// credentials into an error that says they were refused: the fix is then
// the credentials, not configuring some.
func (r *Registry) refusedCredentials(ep *endpoint, q request) func(*http.Response, error) (*http.Response, error) {
	return func(resp *http.Response, err error) (*http.Response, error) {
		if err != nil || (resp.StatusCode != http.StatusUnauthorized && resp.StatusCode != http.StatusForbidden) {
			return resp, err
		}
		e := r.statusError(ep.host, q.op(), resp)
		resp.Body.Close()
		e.Err = ErrCredentialsRefused
		e.Message = "the credentials configured for " + ep.name() + " were refused (the registry says: " + e.Message + ")"
		return nil, e
	}
}

// basicAuth returns the Authorization header for who's basic credentials,
// or "" when there are none.
func (r *Registry) basicAuth(ctx context.Context, who Endpoint) (string, error) {
	if r.creds == nil {
		return "", nil
	}
	user, pass, ok, err := r.creds.Basic(ctx, who)
	if err != nil || !ok {
		return "", err
	}
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass)), nil
}

// authError wraps a failure to obtain credentials or a token.
func (r *Registry) authError(ep *endpoint, q request, err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	kind := ErrUnauthorized
	if errors.Is(err, ErrUnavailable) {
		kind = ErrUnavailable
	}
	return &Error{Upstream: r.name, Endpoint: ep.host, Op: q.op(), Status: http.StatusUnauthorized, Kind: kind, Err: err}
}

func (r *Registry) sendOnce(ctx context.Context, ep *url.URL, q request, auth string) (*http.Response, error) {
	if until, blocked := r.limit.blocked(time.Now()); blocked {
		return nil, &Error{Upstream: r.name, Endpoint: ep.Host, Op: q.op(), Status: http.StatusTooManyRequests,
			Kind: ErrTooManyRequests, RetryAfter: time.Until(until).Round(time.Second),
			Message: "rate limited by the upstream: holding off until " + until.UTC().Format(time.TimeOnly) + " UTC"}
	}
	u := *ep
	u.Path = ep.Path + q.urlPath()
	u.RawQuery = q.query
	req, err := http.NewRequestWithContext(ctx, q.method, u.String(), nil)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", q.op(), err)
	}
	for k, v := range q.header {
		req.Header[k] = v
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	client := q.client
	if client == nil {
		client = r.client
	}
	resp, err := client.Do(req)
	if err != nil {
		r.metrics.request(r.name, q.method, 0)
		return nil, r.transportError(ep.Host, q.op(), err)
	}
	r.metrics.request(r.name, q.method, resp.StatusCode)
	r.recordRateLimit(resp)
	return resp, nil
}

// HeadManifest asks for a manifest's descriptor without fetching it (on
// Docker Hub a HEAD does not count as a pull). The digest is empty when the
// upstream does not send Docker-Content-Digest.
func (r *Registry) HeadManifest(ctx context.Context, repo, ref string, accept []string) (Descriptor, error) {
	q := request{method: http.MethodHead, repo: repo, path: "manifests/" + ref, header: http.Header{"Accept": accept}}
	resp, err := r.do(ctx, q, http.StatusOK, http.StatusMethodNotAllowed, http.StatusNotImplemented)
	if err != nil {
		return Descriptor{}, err
	}
	resp.Body.Close()
	if headRefused(resp.StatusCode) {
		// ErrInvalid: the caller asks with a GET instead.
		return Descriptor{}, &Error{Upstream: r.name, Endpoint: responseHost(resp), Op: q.op(), Status: resp.StatusCode,
			Kind: ErrInvalid, Message: "the upstream does not answer HEAD"}
	}
	desc := Descriptor{MediaType: mediaType(resp.Header.Get("Content-Type")), Size: resp.ContentLength}
	if d, err := digest.Parse(resp.Header.Get("Docker-Content-Digest")); err == nil {
		desc.Digest = d
	}
	return desc, nil
}

// GetManifest fetches a manifest. When ref is a digest the content is checked
// against it; manifests over MaxManifestSize are refused.
func (r *Registry) GetManifest(ctx context.Context, repo, ref string, accept []string) (Descriptor, []byte, error) {
	q := request{method: http.MethodGet, repo: repo, path: "manifests/" + ref, header: http.Header{"Accept": accept}}
	resp, err := r.do(ctx, q)
	if err != nil {
		return Descriptor{}, nil, err
	}
	defer resp.Body.Close()
	invalid := func(format string, a ...any) error {
		return &Error{Upstream: r.name, Endpoint: responseHost(resp), Op: q.op(), Status: resp.StatusCode,
			Kind: ErrInvalid, Message: fmt.Sprintf(format, a...)}
	}
	if resp.ContentLength > MaxManifestSize {
		return Descriptor{}, nil, invalid("manifest of %d bytes is over the %d-byte limit", resp.ContentLength, MaxManifestSize)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, MaxManifestSize+1))
	if err != nil {
		return Descriptor{}, nil, r.transportError(responseHost(resp), q.op(), err)
	}
	if len(body) > MaxManifestSize {
		return Descriptor{}, nil, invalid("manifest is over the %d-byte limit", MaxManifestSize)
	}
	alg := digest.Canonical
	want, refIsDigest := digest.Parse(ref)
	if refIsDigest == nil {
		alg = want.Algorithm()
	}
	desc := Descriptor{Digest: alg.FromBytes(body), MediaType: mediaType(resp.Header.Get("Content-Type")), Size: int64(len(body))}
	if refIsDigest == nil && desc.Digest != want {
		return Descriptor{}, nil, invalid("manifest content hashes to %s, not the %s asked for", desc.Digest, want)
	}
	return desc, body, nil
}

// HeadBlob returns a blob's size without fetching it.
func (r *Registry) HeadBlob(ctx context.Context, repo string, d digest.Digest) (int64, error) {
	resp, err := r.do(ctx, request{method: http.MethodHead, repo: repo, path: "blobs/" + d.String()},
		http.StatusOK, http.StatusMethodNotAllowed, http.StatusNotImplemented)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	if !headRefused(resp.StatusCode) {
		return resp.ContentLength, nil
	}
	// An upstream that refuses HEAD is asked for the first byte: its
	// Content-Range gives the size (a whole answer, its Content-Length),
	// and the rest of the body is never read.
	resp, err = r.do(ctx, request{method: http.MethodGet, repo: repo, path: "blobs/" + d.String(),
		header: http.Header{"Range": {"bytes=0-0"}}}, http.StatusOK, http.StatusPartialContent)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		return resp.ContentLength, nil
	}
	_, total, ok := strings.Cut(resp.Header.Get("Content-Range"), "/")
	size, err := strconv.ParseInt(total, 10, 64)
	if !ok || err != nil {
		return -1, nil // unknown: the download learns it
	}
	return size, nil
}

// TagPage is one page of a repository's tag list.
type TagPage struct {
	Tags []string
	// Next is the query (n and last) of the next page, as the upstream's
	// Link header gives it; empty on the last page.
	Next url.Values
}

// ListTags returns a page of repo's tags: n of them (0: as many as the
// upstream gives) after last (empty: from the start).
func (r *Registry) ListTags(ctx context.Context, repo string, n int, last string) (TagPage, error) {
	query := url.Values{}
	if n > 0 {
		query.Set("n", strconv.Itoa(n))
	}
	if last != "" {
		query.Set("last", last)
	}
	q := request{method: http.MethodGet, repo: repo, path: "tags/list", query: query.Encode()}
	resp, err := r.do(ctx, q)
	if err != nil {
		return TagPage{}, err
	}
	defer resp.Body.Close()
	var body struct {
		Tags []string `json:"tags"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, MaxManifestSize)).Decode(&body); err != nil {
		return TagPage{}, &Error{Upstream: r.name, Endpoint: responseHost(resp), Op: q.op(), Status: resp.StatusCode,
			Kind: ErrInvalid, Message: "the tag list is not JSON: " + err.Error()}
	}
	page := TagPage{Tags: body.Tags}
	if page.Tags == nil {
		page.Tags = []string{}
	}
	page.Next = nextPage(resp.Header.Get("Link"))
	if page.Next == nil && n > 0 && len(page.Tags) == n {
		// A full page without a Link (some registries send none): there
		// may be more, after the last tag; at worst the next page is empty.
		page.Next = url.Values{"n": {strconv.Itoa(n)}, "last": {page.Tags[n-1]}}
	}
	return page, nil
}

// nextPage reads the query of a Link header's rel="next" target:
// `</v2/library/alpine/tags/list?n=100&last=3.19>; rel="next"`.
func nextPage(link string) url.Values {
	for part := range strings.SplitSeq(link, ",") {
		target, params, ok := strings.Cut(part, ";")
		if !ok || !strings.Contains(strings.NewReplacer(" ", "", `"`, "").Replace(params), "rel=next") {
			continue
		}
		u, err := url.Parse(strings.Trim(strings.TrimSpace(target), "<>"))
		if err != nil {
			continue
		}
		q := u.Query()
		next := url.Values{}
		for _, k := range []string{"n", "last"} {
			if v := q.Get(k); v != "" {
				next.Set(k, v)
			}
		}
		if len(next) > 0 {
			return next
		}
	}
	return nil
}

// headRefused reports whether a HEAD's status says the upstream does not
// answer HEAD at all.
func headRefused(status int) bool {
	return status == http.StatusMethodNotAllowed || status == http.StatusNotImplemented
}

func mediaType(contentType string) string {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return ""
	}
	return mt
}

// responseHost is the host that sent resp: after redirects, not the endpoint.
func responseHost(resp *http.Response) string {
	if resp.Request == nil || resp.Request.URL == nil {
		return ""
	}
	return resp.Request.URL.Host
}
