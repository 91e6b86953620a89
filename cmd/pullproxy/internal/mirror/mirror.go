// Package mirror opens a data dir with its upstreams and the registry
// server over them, as serve runs it and as seed, import and export use it
// when no server runs on the data dir: the store and its eviction bound,
// the background scrub, the shared bucket, and each upstream's client.
package mirror

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/proxy"
	"github.com/pullproxy/pullproxy/proxy/imagesync"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/upstream"
)

// Mirror is a data dir opened with its upstreams and the registry server
// over them: what serve listens with, and what seed and import work on
// when no server runs on the data dir.
type Mirror struct {
	Store     *storage.Store
	Server    *proxy.Server
	Names     []string             // upstreams, as logged: name=endpoints
	Upstreams []*upstream.Registry // the online ones, for their live state
	Bucket    *bucket.Bucket       // the shared bucket, when replicas share one; nil: none
	Sync      *imagesync.Syncer    // the sync rules, run by a server; nil: none configured
	MaxConns  int                  // client connections the server allows

	reg     *prometheus.Registry
	closers []func() // run in reverse by Close
}

// Close stops what Open started: the server's downloads, the
// background work, then the store.
func (m *Mirror) Close() {
	for i := len(m.closers) - 1; i >= 0; i-- {
		m.closers[i]()
	}
}

// Open opens cfg's data dir, sets its eviction bound, and builds the
// server over cfg's upstreams. background starts the scrub and the evictor
// too (a server's work, not a command's).
func Open(ctx context.Context, cfg config.File, log *slog.Logger, requestLog *proxy.RequestLog, background bool) (_ *Mirror, err error) {
	m := &Mirror{reg: prometheus.NewRegistry()}
	defer func() {
		if err != nil {
			m.Close()
		}
	}()
	reg := m.reg
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	upMetrics, err := upstream.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	store, err := storage.Open(ctx, cfg.DataDir, storage.WithLogger(log))
	if err != nil {
		return nil, err
	}
	m.Store = store
	m.closers = append(m.closers, func() { store.Close() })
	removeLeftovers(cfg.DataDir, log)
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "pullproxy_store_damaged_blobs_total",
		Help: "Stored blobs found damaged on disk (wrong size or digest) and quarantined, to be fetched again."},
		func() float64 { return float64(store.Damaged()) }))
	if rate := int64(deref(cfg.ScrubRate)); rate > 0 && background {
		sc := storage.NewScrubber(store, rate)
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "pullproxy_scrub_read_bytes_total",
			Help: "Bytes the background scrub read to re-hash stored blobs."},
			func() float64 { return float64(sc.Read()) }))
		scrubCtx, stopScrub := context.WithCancel(ctx)
		scrubDone := make(chan struct{})
		go func() {
			defer close(scrubDone)
			runScrubs(scrubCtx, sc, deref(cfg.ScrubInterval), log)
		}()
		m.closers = append(m.closers, func() { stopScrub(); <-scrubDone })
	}

	var served proxy.Store = store
	var shared proxy.SharedBlobs
	if cfg.Storage.Shared() {
		b, err := bucket.Open(ctx, cfg.Storage.BucketConfig(), bucket.WithLogger(log), bucket.WithMetrics(reg))
		if err != nil {
			class, fix := bucket.Diagnose(err)
			return nil, fmt.Errorf("opening the shared bucket: %s: %w (fix: %s; pullproxy doctor checks it)", class, err, fix)
		}
		served, shared, m.Bucket = bucket.NewStore(store, b), b, b
		m.closers = append(m.closers, b.Close) // after the server's downloads and the janitor end
		if background {
			janitorCtx, stopJanitor := context.WithCancel(ctx)
			janitorDone := make(chan struct{})
			go func() {
				defer close(janitorDone)
				b.RunJanitor(janitorCtx, time.Hour)
			}()
			m.closers = append(m.closers, func() { stopJanitor(); <-janitorDone })
		}
	}

	clients, _ := proxy.ParseClientList(cfg.AllowClients) // checked by validate
	m.MaxConns = cfg.MaxClientConns
	if m.MaxConns == 0 {
		m.MaxConns = defaultMaxClientConnections()
	}
	opts := []proxy.Option{
		proxy.WithStore(served),
		proxy.WithSharedBlobs(shared),
		proxy.WithLogger(log),
		proxy.WithRequestLog(requestLog),
		proxy.WithMetricsRegistry(reg),
		proxy.WithTagTTL(*cfg.TagTTL),
		proxy.WithNotFoundTTL(deref(cfg.NotFoundTTL)),
		proxy.WithFetchTimeout(*cfg.FetchTimeout),
		proxy.WithSendTimeout(deref(cfg.SendTimeout)),
		proxy.WithMaxClientConnections(m.MaxConns),
		proxy.WithAllowedClients(clients),
		proxy.WithBlobLoop(*cfg.BlobLoop),
	}
	if cfg.DefaultUpstream != "" {
		opts = append(opts, proxy.WithDefaultUpstream(cfg.DefaultUpstream))
	}
	transport := upstream.NewTransport()
	for _, u := range cfg.Upstreams {
		upClients, _ := proxy.ParseClientList(u.AllowClients) // checked by validate
		if cfg.Offline || u.Offline {
			opts = append(opts, proxy.WithUpstream(proxy.Offline(u.Name)), proxy.WithUpstreamAllowedClients(u.Name, upClients))
			m.Names = append(m.Names, u.Name+"=offline")
			continue
		}
		r, err := NewRegistry(u, nil, log, upMetrics, transport, cfg.Fetch.Options())
		if err != nil {
			return nil, err
		}
		opts = append(opts, proxy.WithUpstream(r), proxy.WithUpstreamAllowedClients(u.Name, upClients))
		m.Upstreams = append(m.Upstreams, r)
		m.Names = append(m.Names, u.Name+"="+strings.Join(r.Endpoints(), ","))
	}
	// The sync rules' state is read before eviction starts: what they
	// keep is pinned from the first pass.
	if m.Sync, err = newSyncer(ctx, cfg, m, log); err != nil {
		return nil, err
	}
	evictCtx, stopEviction := context.WithCancel(ctx)
	waitEviction, err := startEviction(evictCtx, cfg, store, m.Sync, reg, log, background)
	if err != nil {
		stopEviction()
		return nil, err
	}
	m.closers = append(m.closers, func() { stopEviction(); waitEviction() })

	srv, err := proxy.New(opts...)
	if err != nil {
		return nil, err
	}
	m.Server = srv
	m.closers = append(m.closers, func() { srv.Close() })
	if background && m.Sync != nil {
		syncCtx, stopSync := context.WithCancel(ctx)
		syncDone := make(chan struct{})
		go func() {
			defer close(syncDone)
			m.Sync.Run(syncCtx, srv)
		}()
		m.closers = append(m.closers, func() { stopSync(); <-syncDone }) // before the server closes
	}
	return m, nil
}

// NewRegistry builds upstream u's client over its endpoints, or over urls
// when given (one endpoint at a time, for doctor).
func NewRegistry(u config.Upstream, urls []string, log *slog.Logger, m *upstream.Metrics, transport *http.Transport, fetch upstream.FetchConfig) (*upstream.Registry, error) {
	creds, err := u.Auth.Credentials(u.Name, log, m)
	if err != nil {
		return nil, err
	}
	tlsCfg, err := u.TLSConfig(log)
	if err != nil {
		return nil, err
	}
	upOpts := []upstream.Option{upstream.WithLogger(log), upstream.WithMetrics(m),
		upstream.WithTransport(transport), upstream.WithFetchConfig(fetch),
		upstream.WithCredentials(creds), upstream.WithTLSConfig(tlsCfg),
		upstream.WithTokenRealmHosts(u.TokenRealmHosts...), upstream.WithRedirectAllow(u.RedirectAllow...)}
	all := urls == nil
	for _, e := range u.Endpoints {
		if all {
			urls = append(urls, e.URL)
		}
		if e.Region != "" {
			upOpts = append(upOpts, upstream.WithEndpointRegion(e.URL, e.Region))
		}
		if e.FailoverOnly {
			upOpts = append(upOpts, upstream.WithFailoverOnly(e.URL))
		}
	}
	// Canonical (docker.io for registry-1.docker.io, lower case): the
	// store's keys, offline upstreams, pins and imports all use it.
	return upstream.New(upstream.CanonicalName(u.Name), urls, upOpts...)
}

// leftoverPatterns are the temporary files and directories imports and
// exports make in the data dir, which a kill leaves behind.
var leftoverPatterns = []string{".import-*", ".import-upload-*", ".export-*", ".pullproxy-export-*"}

// removeLeftovers removes what killed imports and exports left in the
// data dir: the store is open, so no other process is using them.
func removeLeftovers(dataDir string, log *slog.Logger) {
	for _, pattern := range leftoverPatterns {
		paths, _ := filepath.Glob(filepath.Join(dataDir, pattern))
		for _, p := range paths {
			if err := os.RemoveAll(p); err == nil {
				log.Info("removed what an interrupted import or export left", "path", filepath.Base(p))
			}
		}
	}
}

// maxClientConnectionsCap is the most client connections allowed by
// default, however high the descriptor limit.
const maxClientConnectionsCap = 16384

// deref is *p, or the zero value for nil.
func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}
