// Package proxy serves the read side of the OCI distribution API from the
// local store, filling it from upstream registries on a miss.
package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/singleflight"

	"github.com/pullproxy/pullproxy/internal/spans"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/storage/content"
	"github.com/pullproxy/pullproxy/upstream"
)

// Upstream is a registry pullproxy mirrors. *upstream.Registry implements it.
type Upstream interface {
	Name() string
	HeadManifest(ctx context.Context, repo, ref string, accept []string) (upstream.Descriptor, error)
	GetManifest(ctx context.Context, repo, ref string, accept []string) (upstream.Descriptor, []byte, error)
	HeadBlob(ctx context.Context, repo string, d digest.Digest) (int64, error)
	// ListTags returns a page of repo's tags: n (0: the upstream's
	// choice) after last.
	ListTags(ctx context.Context, repo string, n int, last string) (upstream.TagPage, error)
	// Referrers lists the descriptors of the manifests in repo whose
	// subject is the digest; ErrNotFound when the upstream has no
	// referrers API (or no such repository).
	Referrers(ctx context.Context, repo string, subject digest.Digest) ([]json.RawMessage, error)
	// FetchBlob writes a blob into w and reports how: the endpoint that
	// served it, chunks, cuts.
	FetchBlob(ctx context.Context, repo string, d digest.Digest, w content.Writer) (upstream.FetchReport, error)
	// ReportCorrupt says that the blob fetched as rep says failed
	// verification, and returns the ranges to fetch again, keeping the
	// rest (nil: discard it whole).
	ReportCorrupt(d digest.Digest, rep upstream.FetchReport, cause error) []spans.Span
	// ReportVerified says that the blob fetched as rep says verified:
	// whatever its endpoints served corrupt before is forgotten.
	ReportVerified(d digest.Digest, rep upstream.FetchReport)
	// Endpoints lists the URLs serving the upstream, in the order they are tried.
	Endpoints() []string
}

var _ Upstream = (*upstream.Registry)(nil)

// BlobStore keeps verified blobs, and the downloads that fill it.
type BlobStore interface {
	OpenBlob(ctx context.Context, d digest.Digest) (*os.File, int64, error)
	StatBlob(ctx context.Context, d digest.Digest) (int64, error)
	// NewPartial starts or resumes a download of d; size is -1 when unknown.
	NewPartial(ctx context.Context, d digest.Digest, size int64) (*storage.Partial, error)
	Touch(ctx context.Context, d digest.Digest) error
	// DeclaredSize is the size a manifest of upstream/repo declared for d.
	DeclaredSize(ctx context.Context, upstream, repo string, d digest.Digest) (int64, error)
}

// ManifestStore keeps manifests: small blobs read whole, with their media
// type and the sizes they declare for what they reference.
type ManifestStore interface {
	ReadBlob(ctx context.Context, d digest.Digest, limit int64) ([]byte, error)
	PutBlob(ctx context.Context, d digest.Digest, b []byte) error
	Blob(ctx context.Context, d digest.Digest) (storage.BlobRecord, error)
	SetMediaType(ctx context.Context, d digest.Digest, mediaType string) error
	SetDeclaredSizes(ctx context.Context, upstream, repo string, sizes map[digest.Digest]int64) error
}

// TagStore keeps what tags resolved to upstream.
type TagStore interface {
	Tag(ctx context.Context, upstream, repo, tag string) (storage.TagRecord, error)
	PutTag(ctx context.Context, upstream, repo, tag string, rec storage.TagRecord) error
	TagList(ctx context.Context, upstream, repo, query string) (storage.TagListRecord, error)
	PutTagList(ctx context.Context, upstream, repo, query string, rec storage.TagListRecord) error
	// Repositories lists the repositories known, as "<upstream>/<repo>", sorted.
	Repositories(ctx context.Context) ([]string, error)
	Referrers(ctx context.Context, upstream, repo string, subject digest.Digest) (storage.ReferrersRecord, error)
	PutReferrers(ctx context.Context, upstream, repo string, subject digest.Digest, rec storage.ReferrersRecord) error
}

// MemberStore keeps which repositories of which upstreams each digest is
// known to belong to: content is stored once, but served only under those.
type MemberStore interface {
	IsMember(ctx context.Context, upstream, repo string, d digest.Digest) (bool, error)
	AddMembers(ctx context.Context, upstream, repo string, ds ...digest.Digest) error
}

// Store is where content is kept. *storage.Store implements it.
type Store interface {
	BlobStore
	ManifestStore
	TagStore
	MemberStore
}

var (
	_ Store        = (*storage.Store)(nil)
	_ Store        = (*bucket.Store)(nil)
	_ blobFDOpener = (*bucket.Store)(nil)
)

// Server is the registry HTTP handler. Create it with New and Close it to
// stop the downloads it started.
type Server struct {
	blobs           BlobStore
	manifests       ManifestStore
	tags            TagStore
	members         MemberStore
	sharedBlobs     SharedBlobs // nil: none
	upstreams       map[string]Upstream
	defaultUpstream Upstream
	tagTTL          time.Duration
	notFound        *notFound             // tags and manifests upstreams said they lack, briefly
	sendTimeout     time.Duration         // a client that takes no piece of a blob for this long is dropped
	clientConns     *clientConns          // open client connections, and their bound
	clients         clientList            // networks clients may connect from; empty: any
	upstreamClients map[string]clientList // by upstream name: networks that may pull from it; absent: any
	log             *slog.Logger
	requestLog      *RequestLog // nil: request lines go through log
	metrics         *metrics
	gatherer        prometheus.Gatherer
	mux             *http.ServeMux
	blobLoop        bool                     // Serve may start the blob loop
	fast            atomic.Pointer[fastPath] // set by Serve

	downloads *downloads
	accesses  *accesses
	// accessesDone is closed once the last accesses are recorded, after Close.
	accessesDone chan struct{}
	// resolving coalesces concurrent lookups of one tag or manifest digest.
	resolving singleflight.Group

	// ctx is the parent of work that outlives requests (downloads, shared
	// lookups); Close cancels it.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup // downloads running
	mu     sync.Mutex     // guards closed against wg.Add racing Close's wg.Wait
	closed bool
}

// track counts a download in, unless the server is closing.
func (s *Server) track() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

// Option configures a Server. An option given a nil value is as if it were
// not given: the default applies.
type Option func(*config) error

type config struct {
	store        Store
	upstreams    []Upstream
	defaultName  string
	tagTTL       time.Duration
	notFoundTTL  time.Duration
	sendTimeout  time.Duration
	maxConns     int
	clients      []netip.Prefix
	upClients    map[string][]netip.Prefix
	fetchTimeout time.Duration
	log          *slog.Logger
	requestLog   *RequestLog
	registry     *prometheus.Registry
	noBlobLoop   bool
	sharedBlobs  SharedBlobs
}

// WithStore sets the store. Required.
func WithStore(s Store) Option {
	return func(c *config) error { c.store = s; return nil }
}

// WithUpstream adds an upstream, matched by its name against containerd's
// ns parameter and the first component of a path.
func WithUpstream(u Upstream) Option {
	return func(c *config) error {
		if u != nil {
			c.upstreams = append(c.upstreams, u)
		}
		return nil
	}
}

// WithDefaultUpstream names the upstream for requests that name none.
// Default: docker.io when configured, otherwise none (such requests get 404).
func WithDefaultUpstream(name string) Option {
	return func(c *config) error { c.defaultName = name; return nil }
}

// WithTagTTL sets how long a tag's digest is served before it is revalidated
// upstream. Default: 5 minutes.
func WithTagTTL(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return fmt.Errorf("negative tag TTL %v", d)
		}
		c.tagTTL = d
		return nil
	}
}

// WithNotFoundTTL sets how long an upstream's 404 for a tag or a manifest
// is answered from memory, without asking again. 0 turns it off. Default:
// 5 seconds: long enough to absorb a crash loop, short enough that a tag
// pushed meanwhile is found at once.
func WithNotFoundTTL(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return fmt.Errorf("negative not-found TTL %v", d)
		}
		c.notFoundTTL = d
		return nil
	}
}

// WithSendTimeout sets how long a client may take none of a blob's body
// before it is dropped (on connections net/http serves: how long it has to
// take each MiB): a client that stops reading otherwise holds a
// connection, a goroutine and a file open indefinitely. 0 turns it off.
// Default: 1 minute.
func WithSendTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d < 0 {
			return fmt.Errorf("negative send timeout %v", d)
		}
		c.sendTimeout = d
		return nil
	}
}

// WithMaxClientConnections bounds the client connections Serve holds open
// at once; past it a new connection is answered 503 with Retry-After and
// closed (see clientConns). 0: no bound. Default: 0; cmd/pullproxy sets
// one from the process's descriptor limit.
func WithMaxClientConnections(n int) Option {
	return func(c *config) error {
		if n < 0 {
			return fmt.Errorf("negative bound on client connections %d", n)
		}
		c.maxConns = n
		return nil
	}
}

// WithAllowedClients limits who may connect to networks (see
// ParseClientList): a connection from anywhere else is answered 403 and
// closed before its request is read. Default: anyone.
func WithAllowedClients(networks []netip.Prefix) Option {
	return func(c *config) error { c.clients = networks; return nil }
}

// WithUpstreamAllowedClients limits who may pull from the upstream named
// name to networks; others get 403 DENIED for its content. Repeatable, one
// upstream at a time. Default: anyone the listener lets in.
func WithUpstreamAllowedClients(name string, networks []netip.Prefix) Option {
	return func(c *config) error {
		if len(networks) == 0 {
			return nil
		}
		if c.upClients == nil {
			c.upClients = map[string][]netip.Prefix{}
		}
		c.upClients[upstream.CanonicalName(name)] = networks
		return nil
	}
}

// WithFetchTimeout bounds one upstream blob download, whoever waits for it.
// Default: 1 hour.
func WithFetchTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("fetch timeout %v is not positive", d)
		}
		c.fetchTimeout = d
		return nil
	}
}

// WithLogger sets the logger. Default: slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l != nil {
			c.log = l
		}
		return nil
	}
}

// WithRequestLog writes the line logged per request through l rather than
// through the logger, which costs more CPU than serving a small blob (see
// RequestLog). The logger's level still decides whether the line is written.
func WithRequestLog(l *RequestLog) Option {
	return func(c *config) error { c.requestLog = l; return nil }
}

// WithBlobLoop sets whether Serve serves stored blobs on kept-alive
// connections with a loop of its own (see fastPath) rather than net/http.
// Default: true. Turning it off costs CPU on every request for a stored
// blob, most for small blobs, where net/http's work around a response
// outweighs the send; it is there in case a client trips over the loop.
func WithBlobLoop(enabled bool) Option {
	return func(c *config) error { c.noBlobLoop = !enabled; return nil }
}

// SharedBlobs is the tier of blobs replicas share: *bucket.Bucket. A blob
// the local store lacks is looked for there before the upstream, and
// fetched through it (see bucket.Bucket.Fetch) so that replicas fetch
// each blob from the upstream once between them.
type SharedBlobs interface {
	StatBlob(ctx context.Context, d digest.Digest) (int64, error)
	// BlobURL returns a URL clients may GET d from, for Redirect.
	BlobURL(ctx context.Context, d digest.Digest) (string, error)
	// Redirect says whether GETs of blobs it holds are redirected to it.
	Redirect() bool
	Fetch(ctx context.Context, dl content.Download, confirm, fetch func(context.Context) error) (*bucket.Fetch, error)
}

// WithSharedBlobs puts a tier of blobs shared with other replicas behind
// the store. Default (and for nil): none.
func WithSharedBlobs(b SharedBlobs) Option {
	return func(c *config) error { c.sharedBlobs = b; return nil }
}

// WithMetricsRegistry registers the server's metrics with reg and serves reg
// at /metrics. Default: a registry of the server's own.
func WithMetricsRegistry(reg *prometheus.Registry) Option {
	return func(c *config) error { c.registry = reg; return nil }
}

// New returns a Server.
func New(opts ...Option) (*Server, error) {
	c := config{tagTTL: 5 * time.Minute, notFoundTTL: 5 * time.Second, sendTimeout: time.Minute,
		fetchTimeout: time.Hour, log: slog.Default()}
	for _, o := range opts {
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if c.store == nil {
		return nil, errors.New("proxy: no store")
	}
	if c.registry == nil {
		c.registry = prometheus.NewRegistry()
	}
	m, err := newMetrics(c.registry)
	if err != nil {
		return nil, fmt.Errorf("proxy: registering metrics: %w", err)
	}
	s := &Server{
		blobs:       c.store,
		manifests:   c.store,
		tags:        c.store,
		members:     c.store,
		sharedBlobs: c.sharedBlobs,
		upstreams:   map[string]Upstream{},
		tagTTL:      c.tagTTL,
		notFound:    newNotFound(c.notFoundTTL),
		sendTimeout: c.sendTimeout,
		clientConns: &clientConns{max: int64(c.maxConns)},
		clients:     c.clients,
		blobLoop:    !c.noBlobLoop,
		log:         c.log,
		requestLog:  c.requestLog,
		metrics:     m,
		gatherer:    c.registry,
	}
	open := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_http_connections_open",
		Help: "Client connections open (served by Serve)."}, func() float64 { return float64(s.clientConns.open.Load()) })
	if err := c.registry.Register(open); err != nil {
		return nil, fmt.Errorf("proxy: registering metrics: %w", err)
	}
	for _, u := range c.upstreams {
		name := upstream.CanonicalName(u.Name())
		if _, dup := s.upstreams[name]; dup {
			return nil, fmt.Errorf("proxy: upstream %s configured twice", name)
		}
		s.upstreams[name] = u
	}
	for name, l := range c.upClients {
		if s.upstreams[name] == nil {
			return nil, fmt.Errorf("proxy: allowed clients given for %s, which is not a configured upstream", name)
		}
		if s.upstreamClients == nil {
			s.upstreamClients = map[string]clientList{}
		}
		s.upstreamClients[name] = l
	}
	switch {
	case c.defaultName != "":
		s.defaultUpstream = s.upstreams[upstream.CanonicalName(c.defaultName)]
		if s.defaultUpstream == nil {
			return nil, fmt.Errorf("proxy: default upstream %s is not configured", c.defaultName)
		}
	default:
		s.defaultUpstream = s.upstreams[upstream.DockerHub] // may be nil
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.downloads = newDownloads(s, c.fetchTimeout)
	for _, g := range []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_downloads_in_flight",
			Help: "Blob downloads from upstreams in progress."},
			func() float64 { return float64(s.downloads.running()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_download_waiters",
			Help: "Client responses being served from downloads in progress, waiting on their bytes."},
			func() float64 { return float64(s.metrics.waiters.Load()) }),
	} {
		if err := c.registry.Register(g); err != nil {
			return nil, fmt.Errorf("proxy: registering metrics: %w", err)
		}
	}
	s.accesses, s.accessesDone = newAccesses(), make(chan struct{})
	go func() {
		defer close(s.accessesDone)
		s.recordAccesses(s.ctx)
	}()
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("/v2/", s.serveRegistry)
	s.mux.Handle("GET /metrics", promhttp.HandlerFor(c.registry, promhttp.HandlerOpts{}))
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	s.mux.HandleFunc("GET /readyz", s.serveReady)
	return s, nil
}

// readyChecker is a store that can tell whether it can serve: its files
// writable, its metadata open. *storage.Store implements it.
type readyChecker interface {
	Ready(ctx context.Context) error
}

// readyTimeout bounds the readiness checks: a disk that hangs is not ready.
const readyTimeout = 5 * time.Second

// serveReady answers /readyz: 200 when the store can be written and its
// metadata read, and the server is not shutting down; else 503 and why,
// so that a load balancer sends clients elsewhere.
func (s *Server) serveReady(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	var err error
	if closed {
		err = errShuttingDown
	} else if rc, ok := s.blobs.(readyChecker); ok {
		ctx, cancel := context.WithTimeout(r.Context(), readyTimeout)
		err = rc.Ready(ctx)
		cancel()
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "not ready: %v\n", err)
		return
	}
	w.Write([]byte("ready\n"))
}

// Close cancels the downloads in progress and waits for them to stop.
// Their progress is kept for the next start. It records the blob accesses
// noted so far; later ones are not recorded.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	<-s.accessesDone
	return nil
}

// ServeHTTP serves the registry API under /v2/, /metrics, /healthz and /readyz.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// A clean /v2/ path is what the mux would route to serveRegistry
	// anyway; going there directly spares every blob request the mux's
	// matching and its allocations.
	// /v2 is the base too: the mux would redirect it to /v2/, a round trip
	// some clients do not make.
	if p := r.URL.Path; (strings.HasPrefix(p, "/v2/") && (p == "/v2/" || path.Clean(p) == p) || p == "/v2") && r.Method != http.MethodConnect {
		s.serveRegistry(w, r)
		return
	}
	s.mux.ServeHTTP(w, r)
}

// serveRegistry handles everything under /v2/. A connection that had a
// stored blob answered whole goes on to the blob loop (see fastPath).
func (s *Server) serveRegistry(w http.ResponseWriter, r *http.Request) {
	if rw := s.handleRegistry(w, r); rw.whole {
		s.takeOver(w, r)
	}
}

// handleRegistry answers a request under /v2/, and returns what it sent.
func (s *Server) handleRegistry(w http.ResponseWriter, r *http.Request) *responseRecorder {
	start := time.Now()
	rw := &responseRecorder{ResponseWriter: w, status: http.StatusOK}
	w = rw
	w.Header()["Docker-Distribution-API-Version"] = apiVersion
	kind := "other"
	ns := queryValue(r.URL.RawQuery, "ns")
	defer s.finish(r, ns, rw, start, &kind)

	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeErrorJSON(w, r, &ociError{status: http.StatusMethodNotAllowed, code: "UNSUPPORTED",
			message: "pullproxy is a read-only mirror: " + r.Method + " is not supported"})
		return rw
	}
	if r.URL.Path == "/v2/_catalog" {
		kind = "catalog"
		s.serveCatalog(w, r)
		return rw
	}
	if r.URL.Path == "/v2/" || r.URL.Path == "/v2" {
		kind = "ping"
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", "2")
		if r.Method != http.MethodHead {
			w.Write([]byte("{}"))
		}
		return rw
	}
	rt, err := s.resolve(r.Method, r.URL.Path, ns)
	if err != nil {
		oe := toOCI(err, "")
		if oe.code == "NAME_UNKNOWN" {
			s.log.Warn("refused request for an unconfigured upstream", "path", r.URL.Path,
				"ns", ns, "fix", "add the registry to upstreams if it should be mirrored")
		}
		s.writeError(w, r, oe)
		return rw
	}
	// A blob's request is decided whole by storedBlobAllowed, allow_clients included.
	if rt.kind != kindBlob && !s.pullAllowed(rt, r.RemoteAddr) {
		s.writeError(w, r, clientDenied(rt, r.RemoteAddr))
		return rw
	}
	kind = rt.kind
	switch rt.kind {
	case kindManifest:
		s.serveManifest(w, r, rt)
	case kindBlob:
		s.serveBlob(w, r, rt)
	case kindTags:
		s.serveTags(w, r, rt)
	case kindReferrers:
		s.serveReferrers(w, r, rt)
	}
	return rw
}

// finish counts a request served and logs it. *kind is the kind of request,
// known once it is resolved.
func (s *Server) finish(r *http.Request, ns string, rw *responseRecorder, start time.Time, kind *string) {
	s.count(*kind, r.Method, rw.status, rw.source, rw.written)
	s.metrics.observe(*kind, rw.source, time.Since(start))
	s.logRequest(r.Context(), r.Method, r.URL.Path, ns, r.RemoteAddr, rw.status, rw.written, start)
}

// count counts a request served, and the blob bytes it sent from source
// ("" when it sent none).
func (s *Server) count(kind, method string, status int, source string, written int64) {
	s.metrics.request(kind, method, status).Inc()
	if c := s.metrics.served[source]; c != nil && kind == kindBlob {
		c.Add(float64(written))
	}
}

// apiVersion is the value of Docker-Distribution-API-Version, shared by
// every response: net/http only reads header values.
var apiVersion = []string{"registry/2.0"}

// logRequest writes the line every request gets, at Info. It builds the
// record itself rather than calling Logger.Info, which would also look up
// the caller's program counter and box every value: the line is the same.
func (s *Server) logRequest(ctx context.Context, method, urlPath, ns, remote string, status int, written int64, start time.Time) {
	h := s.log.Handler()
	if !h.Enabled(ctx, slog.LevelInfo) {
		return
	}
	now := time.Now()
	s.writeRequestLine(ctx, h, &requestLine{time: now, method: method, path: urlPath, ns: ns, remote: remote,
		status: status, bytes: written, duration: now.Sub(start).Round(time.Microsecond)})
}

// writeRequestLine writes line through the request log, or through h
// when there is none or the line has a value it leaves to slog.
func (s *Server) writeRequestLine(ctx context.Context, h slog.Handler, line *requestLine) {
	if s.requestLog != nil && s.requestLog.write(line) {
		return
	}
	rec := slog.NewRecord(line.time, slog.LevelInfo, "request", 0)
	rec.AddAttrs(slog.String("method", line.method), slog.String("path", line.path), slog.String("ns", line.ns),
		slog.Int("status", line.status), slog.Int64("bytes", line.bytes),
		slog.Duration("duration", line.duration), slog.String("remote", line.remote))
	h.Handle(ctx, rec)
}

// queryValue is the value of key in a raw query, as url.ParseQuery would
// read it, without parsing the whole query into a map when it needs no
// unescaping (containerd's "ns=docker.io").
func queryValue(q, key string) string {
	if q == "" {
		return ""
	}
	if strings.ContainsAny(q, "%+;") {
		v, _ := url.ParseQuery(q)
		return v.Get(key)
	}
	for q != "" {
		var pair string
		pair, q, _ = strings.Cut(q, "&")
		if k, v, _ := strings.Cut(pair, "="); k == key {
			return v
		}
	}
	return ""
}

// statusLabel is strconv.Itoa(status), without allocating for the common ones.
func statusLabel(status int) string {
	switch status {
	case http.StatusOK:
		return "200"
	case http.StatusPartialContent:
		return "206"
	case http.StatusNotModified:
		return "304"
	case http.StatusNotFound:
		return "404"
	}
	return strconv.Itoa(status)
}

// methodLabel bounds the method label: any method a client invents would
// otherwise make a series of its own.
func methodLabel(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPut, http.MethodPost, http.MethodPatch, http.MethodDelete:
		return m
	}
	return "other"
}

// fail reports err to the client, and to the operator with the likely fix.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, rt route, err error) {
	withCause := *toOCI(err, rt.kind)
	oe := &withCause
	if c := causeOf(err, rt); c != "" {
		oe.cause = c
	}
	fix := hint(err)
	if f := corruptFix(err, digest.Digest(rt.ref)); f != "" && rt.kind == kindBlob {
		fix = f
		// The upstream's refusal to fetch the blob again (ErrInvalid)
		// names the fix already.
		if !errors.Is(err, upstream.ErrInvalid) {
			oe.message += ": " + f
		}
	}
	if r.Context().Err() == nil {
		level := slog.LevelWarn
		if oe.status == http.StatusNotFound {
			level = slog.LevelInfo
		}
		attrs := []any{"upstream", rt.up.Name(), "repo", rt.repo, "ref", rt.ref, "status", oe.status, "err", err}
		if fix != "" {
			attrs = append(attrs, "fix", fix)
		}
		s.log.Log(r.Context(), level, rt.kind+" request failed", attrs...)
	}
	s.writeError(w, r, oe)
}
