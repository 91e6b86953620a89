// Package registrytest runs a real OCI registry in process, on loopback, for
// tests and benchmarks that need a production-like upstream.
//
// The registry is distribution v3 (github.com/distribution/distribution/v3,
// the code behind Docker's "registry" image) built with handlers.NewApp and
// the filesystem storage driver rooted in a directory chosen by the caller,
// so multi-hundred-MiB images live on disk, not in memory. Blobs are served
// by net/http's ServeContent, so Range requests behave as in production,
// including open-ended "bytes=N-" ranges (which go-containerregistry's
// pkg/registry refuses).
//
// Push uploads a synthetic image (incompressible pseudo-random layers made
// from a seed) over HTTP to the registry itself, streaming: a layer is
// generated once, hashed on the fly and sent in a single PATCH, then the
// upload is closed with an empty PUT ?digest=.
//
// # Configuration
//
// The registry is configured in code (see newConfig): filesystem storage,
// no auth, delete disabled, redirects disabled (but see WithBlobRedirects),
// upload purging disabled, an in-memory blob descriptor cache, no
// notification endpoints, no health
// checks (App.RegisterHealthChecks is never called; it registers into a
// process-global health registry and may only run once per process) and no
// debug/prometheus listener. Schema1 manifests do not exist in
// distribution v3, so there is nothing to switch off for them.
//
// # Logging and other process-wide state
//
// distribution logs through logrus via its internal dcontext package, which
// reads a *logrus.Entry from the context (falling back to a package-level
// default built on logrus.StandardLogger()). The only public way to change
// that (registry.NewRegistry) calls logrus.SetLevel, logrus.SetFormatter and
// dcontext.SetDefaultLogger, i.e. process-wide setters, and also registers
// health checks globally, so this package does not use it. Instead, the
// contexts handed to distribution (the App's base context and every
// request's context) are wrapped so that a lookup of dcontext's private
// logger key yields this Registry's own logrus logger: error level, output
// discarded unless WithLogOutput is given. The key is recognised by its Go
// type name (package path + "loggerKey"); TestLogOutput fails if a future
// distribution version renames it. Nothing global of logrus is changed.
//
// A few code paths in distribution log through the logrus package-level
// functions directly (upload purging, which is disabled here; storage
// walks, used by catalog/GC; notification sink failures, with no endpoints
// configured here; a corrupt resumable-hash state). Those would reach
// logrus.StandardLogger() (stderr, info level by default); they are not hit
// by push and pull.
//
// Importing this package also runs distribution's init functions: it
// registers "registry_storage_*", "registry_notifications_*" and
// "registry_proxy_*" collectors with prometheus' default registerer (via
// docker/go-metrics), publishes an expvar map named "registry", and
// registers the filesystem storage driver in distribution's driver factory.
// This package registers a storage middleware of its own there (see
// WithBlobRedirects).
package registrytest

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"reflect"
	"sync"
	"time"

	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/handlers"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem" // registers the "filesystem" driver
	"github.com/sirupsen/logrus"
)

// Registry is an in-process distribution registry on loopback.
type Registry struct {
	app    *handlers.App
	srv    *http.Server
	ln     net.Listener
	host   string
	client *http.Client

	scheme string // http or https
	caFile string // with TLS: the CA's certificate, PEM

	served    chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// Option configures Start.
type Option func(*options)

type options struct {
	wrap          func(http.Handler) http.Handler
	logOutput     io.Writer
	tls           bool
	blobRedirects bool
}

// WithBlobRedirects makes the registry answer blob GETs and HEADs with a
// 307 to the blob's file, which the same server serves from its storage
// directory (net/http's FileServer: ranges as ServeContent serves them).
// Registries backed by object storage answer so: ECR redirects to S3,
// Docker Hub to its CDN. It also keeps a benchmark's upstream from taking
// CPU that its clients are measured on: distribution serves a blob GET
// itself through a freshly allocated 4 MiB read buffer, and across ranged
// requests of a MiB or so, allocating it took 30% of the registry's CPU in
// serving blobs, besides the collections it caused (pullbench's profile).
func WithBlobRedirects() Option {
	return func(o *options) { o.blobRedirects = true }
}

// WithHandlerWrapper makes the server serve wrap(h) instead of the
// registry's handler h, e.g. to count or delay requests. The requests made
// by Push go through the wrapper too.
func WithHandlerWrapper(wrap func(http.Handler) http.Handler) Option {
	return func(o *options) { o.wrap = wrap }
}

// WithLogOutput sends the registry's error-level log lines (logrus text
// format) to w instead of discarding them. w must be safe for concurrent
// use by logrus (logrus serialises writes with its own mutex).
func WithLogOutput(w io.Writer) Option {
	return func(o *options) { o.logOutput = w }
}

// Start starts a registry storing its content under dir (created if
// missing; content already there is served, so a directory can be reused
// across runs) and serving on 127.0.0.1 on a free port. ctx only bounds
// start-up; the registry runs until Close.
func Start(ctx context.Context, dir string, opts ...Option) (*Registry, error) {
	if dir == "" {
		return nil, errors.New("registrytest: empty storage directory")
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("registrytest: %w", err)
	}

	logger := logrus.New() // a private logger: logrus globals are left alone
	logger.SetLevel(logrus.ErrorLevel)
	if o.logOutput != nil {
		logger.SetOutput(o.logOutput)
	} else {
		logger.SetOutput(io.Discard)
		logger.SetLevel(logrus.PanicLevel) // don't even format messages
	}
	entry := logrus.NewEntry(logger)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("registrytest: listen: %w", err)
	}
	scheme, caFile := "http", ""
	clientTLS := (*tls.Config)(nil)
	if o.tls {
		ca, err := newTestCA()
		if err == nil {
			caFile, err = ca.writeCA(dir)
		}
		if err != nil {
			ln.Close()
			return nil, fmt.Errorf("registrytest: making a test CA: %w", err)
		}
		scheme = "https"
		ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{ca.serving}, NextProtos: []string{"h2", "http/1.1"}})
		clientTLS = &tls.Config{RootCAs: ca.pool}
	}
	cfg, err := newConfig(dir, ln.Addr().String())
	if err != nil {
		ln.Close()
		return nil, err
	}
	if o.blobRedirects {
		cfg.Storage["redirect"] = configuration.Parameters{"disable": false}
		cfg.Middleware = map[string][]configuration.Middleware{"storage": {{Name: sameHostRedirect}}}
	}

	appCtx := &loggerContext{Context: context.WithoutCancel(ctx), logger: entry}
	app, err := newApp(appCtx, cfg)
	if err != nil {
		ln.Close()
		return nil, err
	}

	var h http.Handler = &injectLogger{next: app, logger: entry}
	if o.blobRedirects {
		h = withBlobStore(h, dir)
	}
	if o.wrap != nil {
		h = o.wrap(h)
	}
	errLog := io.Writer(io.Discard)
	if o.logOutput != nil {
		errLog = o.logOutput
	}
	r := &Registry{
		app:    app,
		ln:     ln,
		host:   ln.Addr().String(),
		scheme: scheme,
		caFile: caFile,
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: 30 * time.Second,
			ErrorLog:          log.New(errLog, "registrytest: http: ", 0),
		},
		client: &http.Client{Transport: &http.Transport{
			Proxy:               nil, // loopback: never go through $HTTP_PROXY
			TLSClientConfig:     clientTLS,
			MaxIdleConnsPerHost: 16,
			IdleConnTimeout:     30 * time.Second,
			DisableCompression:  true,
		}},
		served: make(chan struct{}),
	}
	go func() {
		defer close(r.served)
		_ = r.srv.Serve(ln)
	}()
	return r, nil
}

// NewHandler returns distribution's registry as an http.Handler storing
// under dir, for a test to serve itself (as the upstream of an
// httptest.Server, say). Errors, if any, go to logOutput (nil: nowhere).
func NewHandler(ctx context.Context, dir string, logOutput io.Writer) (http.Handler, error) {
	logger := logrus.New()
	logger.SetLevel(logrus.ErrorLevel)
	if logOutput != nil {
		logger.SetOutput(logOutput)
	} else {
		logger.SetOutput(io.Discard)
		logger.SetLevel(logrus.PanicLevel)
	}
	entry := logrus.NewEntry(logger)
	cfg, err := newConfig(dir, "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	app, err := newApp(&loggerContext{Context: context.WithoutCancel(ctx), logger: entry}, cfg)
	if err != nil {
		return nil, err
	}
	return &injectLogger{next: app, logger: entry}, nil
}

// newApp calls handlers.NewApp, which reports configuration problems by
// panicking.
func newApp(ctx context.Context, cfg *configuration.Configuration) (app *handlers.App, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("registrytest: distribution NewApp: %v", p)
		}
	}()
	return handlers.NewApp(ctx, cfg), nil
}

// newConfig builds the minimal distribution configuration described in the
// package documentation.
func newConfig(dir, addr string) (*configuration.Configuration, error) {
	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return nil, err
	}
	cfg := &configuration.Configuration{
		Version: configuration.CurrentVersion,
		Log: configuration.Log{
			// Informational only: NewApp does not read these (they are
			// applied by registry.NewRegistry, through global setters).
			AccessLog: configuration.AccessLog{Disabled: true},
			Level:     "error",
			Formatter: "text",
		},
		Storage: configuration.Storage{
			"filesystem": configuration.Parameters{"rootdirectory": dir},
			"delete":     configuration.Parameters{"enabled": false},
			"redirect":   configuration.Parameters{"disable": true},
			"cache":      configuration.Parameters{"blobdescriptor": "inmemory"},
			"maintenance": configuration.Parameters{
				// NewApp type-asserts these to map[any]any.
				"uploadpurging": map[any]any{"enabled": false},
				"readonly":      map[any]any{"enabled": false},
			},
		},
		// What the YAML parser defaults a deployed registry's to: the
		// struct's zero value refuses every n and lists nothing.
		Catalog: configuration.Catalog{MaxEntries: 1000},
		HTTP: configuration.HTTP{
			Addr:   addr,
			Net:    "tcp",
			Secret: hex.EncodeToString(secret),
		},
	}
	return cfg, nil
}

// URL returns the registry's base URL, "http://127.0.0.1:PORT", or
// "https://…" with WithTLS.
func (r *Registry) URL() string { return r.scheme + "://" + r.host }

// CAFile returns the path of the PEM certificate of the CA that issued the
// registry's certificate, or "" without WithTLS.
func (r *Registry) CAFile() string { return r.caFile }

// Host returns the registry's address, "127.0.0.1:PORT".
func (r *Registry) Host() string { return r.host }

// Close stops the server (closing open connections at once, so it does not
// wait for slow downloads) and the registry application. It may be called
// more than once. The storage directory is left in place.
func (r *Registry) Close() error {
	r.closeOnce.Do(func() {
		r.closeErr = r.srv.Close()
		<-r.served
		if err := r.app.Shutdown(); err != nil && r.closeErr == nil {
			r.closeErr = err
		}
		r.client.CloseIdleConnections()
	})
	return r.closeErr
}

// injectLogger makes distribution find this registry's logger in every
// request's context.
type injectLogger struct {
	next   http.Handler
	logger *logrus.Entry
}

func (h *injectLogger) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	h.next.ServeHTTP(w, req.WithContext(&loggerContext{Context: req.Context(), logger: h.logger}))
}

// dcontextLoggerKey identifies the (unexported) type of the context key
// under which distribution's internal dcontext package looks up its logger:
//
//	package dcontext
//	type loggerKey struct{}
const (
	dcontextPkgPath   = "github.com/distribution/distribution/v3/internal/dcontext"
	dcontextLoggerKey = "loggerKey"
)

// loggerContext answers distribution's logger lookups with a fixed logger.
// dcontext.WithLogger values set deeper in the chain (distribution adds
// request fields that way) still take precedence, since they are found
// before the lookup reaches this context, and they are derived from this
// logger anyway.
type loggerContext struct {
	context.Context
	logger *logrus.Entry
}

func (c *loggerContext) Value(key any) any {
	if t := reflect.TypeOf(key); t != nil && t.Name() == dcontextLoggerKey && t.PkgPath() == dcontextPkgPath {
		return c.logger
	}
	return c.Context.Value(key)
}
