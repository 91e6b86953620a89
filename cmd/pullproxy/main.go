// Command pullproxy is an OCI pull-through mirror for containerd, CRI-O and
// Docker. See README.md.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/logbuffer"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/proxy"
)

// shutdownGrace bounds how long responses in progress may take to finish
// once pullproxy is told to stop.
const shutdownGrace = 20 * time.Second

// version is set at link time: -ldflags "-X main.version=…".
var version = "dev"

const usage = `pullproxy: an OCI pull-through mirror

Usage:
  pullproxy serve [flags]   run the mirror
  pullproxy verify [flags]  re-hash the store and check it against its metadata (--repair fixes it)
  pullproxy seed [flags] REF...
                            fetch images into the store before they are needed
  pullproxy export -o FILE.tar REF...
                            write an OCI image-layout archive of images, from the store
  pullproxy import FILE.tar...
                            load OCI-layout archives and docker-save tars into the store
  pullproxy doctor REF [--platform os/arch] [--json]
                            walk the pull of an image against its upstream, and say what fails and the fix
  pullproxy status [--data-dir DIR | --config FILE | --server ADDR]
                            a running server's live state of its upstreams' paths
  pullproxy forget [--server URL] DIGEST...
                            after a corrupt blob was pushed again upstream: fetch it at once
  pullproxy probe URL [--sessions N] [--bytes SIZE] [--compare URL2] [--json]
                            measure whether and where a path cuts sessions
  pullproxy node-config --mirror URL [flags]
                            write a node's containerd hosts.toml (or CRI-O registries.conf) for the mirror
  pullproxy version         print the version

Run "pullproxy serve -h" for serve's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil && !errors.Is(err, flag.ErrHelp) {
		code := 1
		if ee := (*exitError)(nil); errors.As(err, &ee) {
			code = ee.code
		}
		if err.Error() != "" {
			fmt.Fprintln(os.Stderr, "pullproxy:", err)
		}
		os.Exit(code)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command given")
	}
	switch args[0] {
	case "serve":
		return serve(ctx, args[1:], stderr)
	case "verify":
		return verify(ctx, args[1:], stdout, stderr)
	case "node-config":
		return nodeConfig(args[1:], stdout, stderr)
	case "seed":
		return seed(ctx, args[1:], stdout, stderr)
	case "doctor":
		return doctorCommand(ctx, args[1:], stdout, stderr)
	case "status":
		return status(ctx, args[1:], stdout, stderr)
	case "forget":
		return forget(ctx, args[1:], stdout, stderr)
	case "probe":
		return probe(ctx, args[1:], stdout, stderr)
	case "export":
		return export(ctx, args[1:], stdout, stderr)
	case "import":
		return importArchives(ctx, args[1:], stdout, stderr)
	case "version", "--version", "-version":
		fmt.Fprintln(stdout, "pullproxy", version)
		return nil
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}

// serveConfig reads the configuration: defaults, then the file, then flags.
func serveConfig(args []string, stderr io.Writer) (config.File, error) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "", "address to serve the registry API on (default 127.0.0.1:5000)")
	dataDir := fs.String("data-dir", "", "directory for blobs and metadata (default ./data)")
	configPath := fs.String("config", "", "YAML configuration file")
	logLevel := fs.String("log-level", "", "debug, info, warn or error (default info)")
	cpuProfile := fs.String("cpu-profile", "", "write a CPU profile of the run to this file, for go tool pprof")
	adminListen := fs.String("admin-listen", "", "address of the admin endpoint (seed, import, export, forget, status): unix:/path, a loopback host:port, or off (default unix:DATA-DIR/admin.sock)")
	adminTokenFile := fs.String("admin-token-file", "", "the bearer token a TCP admin endpoint requires (default DATA-DIR/admin.token, created mode 0600)")
	offline := fs.Bool("offline", false, "never contact an upstream: serve what the store holds (an air-gapped site)")
	maxSize := fs.String("max-size", "", "bound on the store: a size (100GiB), a percentage of the data dir's file system (80%), or off (default 85%)")
	var ups config.UpstreamFlags
	fs.Var(&ups, "upstream", "NAME=URL[,URL...]: mirror registry NAME from these endpoints (repeatable)")
	if err := fs.Parse(args); err != nil {
		return config.File{}, err
	}
	if fs.NArg() > 0 {
		return config.File{}, fmt.Errorf("serve: unexpected argument %q", fs.Arg(0))
	}
	cfg := config.Default()
	if *configPath != "" {
		if err := config.LoadFile(*configPath, &cfg); err != nil {
			return cfg, err
		}
	}
	if *listen != "" {
		cfg.Listen = *listen
	}
	if *dataDir != "" {
		cfg.DataDir = *dataDir
	}
	if *logLevel != "" {
		cfg.LogLevel = *logLevel
	}
	if *offline {
		cfg.Offline = true
	}
	if *adminListen != "" {
		cfg.AdminListen = *adminListen
	}
	if *adminTokenFile != "" {
		cfg.AdminTokenFile = *adminTokenFile
	}
	if *maxSize != "" {
		b, err := config.ParseStoreBound(*maxSize)
		if err != nil {
			return cfg, fmt.Errorf("--max-size: %w", err)
		}
		cfg.MaxSize = b
	}
	cfg.CPUProfile = *cpuProfile
	cfg.Upstreams = config.WithDefaultUpstreams(config.MergeUpstreams(cfg.Upstreams, ups))
	return cfg, cfg.Validate()
}

func newLogger(cfg config.File, w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", cfg.LogLevel)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch strings.ToLower(cfg.LogFormat) {
	case "", "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("log format %q: want text or json", cfg.LogFormat)
}

func serve(ctx context.Context, args []string, stderr io.Writer) error {
	cfg, err := serveConfig(args, stderr)
	if err != nil {
		return err
	}
	logOut := logbuffer.New(stderr)
	defer logOut.Close()
	log, err := newLogger(cfg, logOut)
	if err != nil {
		return err
	}
	log = slog.New(logbuffer.FlushOnWarn(log.Handler(), logOut))
	requestLog, err := proxy.NewRequestLog(logOut, cfg.LogFormat)
	if err != nil {
		return err
	}
	if cfg.CPUProfile != "" {
		stop, err := startCPUProfile(cfg.CPUProfile)
		if err != nil {
			return err
		}
		defer stop()
	}

	m, err := mirror.Open(ctx, cfg, log, requestLog, true)
	if err != nil {
		return err
	}
	defer m.Close()
	srv, names, maxConns := m.Server, m.Names, m.MaxConns
	listenTLS, err := cfg.TLS.ServerTLS(log)
	if err != nil {
		return err
	}

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", cfg.Listen, err)
	}
	scheme := "http"
	if listenTLS != nil {
		// TLS connections are served by net/http alone: the blob loop
		// sends plain TCP with sendfile.
		ln, scheme = tls.NewListener(ln, listenTLS), "https"
	}
	httpSrv := &http.Server{
		Handler:           srv,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	stopAdmin := func(context.Context) {}
	adminLn, err := admin.Listen(cfg.AdminAddress())
	if err != nil {
		ln.Close()
		return err
	}
	if adminLn != nil {
		adminSrv, err := admin.Start(m, adminLn, cfg.DataDir, cfg.AdminTokenPath(), log)
		if err != nil {
			adminLn.Close()
			ln.Close()
			return err
		}
		// Before the store closes (m.Close, deferred earlier).
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
			defer cancel()
			adminSrv.Shutdown(ctx)
		}()
		stopAdmin = adminSrv.Shutdown
		addr := adminLn.Addr().String()
		if adminLn.Addr().Network() == "unix" {
			addr = "unix:" + addr
		}
		log.Info("admin endpoint listening", "addr", addr)
	}

	log.Info("pullproxy serving", "version", version, "addr", ln.Addr().String(), "data_dir", cfg.DataDir,
		"upstreams", names, "max_client_connections", maxConns, "scheme", scheme)

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln, httpSrv) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down")
	// Downloads first: their readers then end their responses short (a
	// clean close, which clients resume from elsewhere or after the
	// restart), so waiting for responses does not wait for upstreams. Their
	// progress is recorded for the next start.
	srv.Close()
	shutdownCtx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	// Admin requests (a seed, an import) drain alongside, and end before
	// the store closes.
	adminDone := make(chan struct{})
	go func() { stopAdmin(shutdownCtx); close(adminDone) }()
	if err := srv.Shutdown(shutdownCtx, httpSrv); err != nil {
		log.Warn("connections still open at shutdown were closed", "err", err)
	}
	<-adminDone
	return nil
}

// startCPUProfile profiles the process's CPU into path until stop.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
