// Command distproxy runs distribution's registry (the code of Docker's
// "registry" image) from a configuration file, for cpubench to compare
// pullproxy with: with `proxy: remoteurl:` set it is distribution's
// pull-through cache, fetching, hashing, storing and serving blobs.
//
//	distproxy CONFIG
//
// It listens on the configuration's http.addr (port 0: any free port) and
// logs "distproxy serving addr=HOST:PORT" on stderr once it accepts. The
// handler is the registry's own (handlers.NewApp, as the registry binary
// serves it) without the access log, health checks and tracing the binary
// wraps it in; the binary itself does not build here, since its main links
// storage drivers (gcs, s3, azure) whose modules this repository's go.sum
// does not list.
package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"

	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/handlers"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem" // registers "filesystem"
	"github.com/sirupsen/logrus"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "distproxy:", err)
		os.Exit(1)
	}
}

func run() error {
	if len(os.Args) != 2 {
		return fmt.Errorf("usage: distproxy CONFIG")
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		return err
	}
	cfg, err := configuration.Parse(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("parsing %s: %w", os.Args[1], err)
	}
	level, err := logrus.ParseLevel(string(cfg.Log.Level))
	if err != nil {
		return err
	}
	logrus.SetLevel(level)
	logrus.SetOutput(os.Stderr)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ln, err := net.Listen("tcp", cfg.HTTP.Addr)
	if err != nil {
		return err
	}
	app := handlers.NewApp(ctx, cfg)
	srv := &http.Server{Handler: app}
	fmt.Fprintf(os.Stderr, "distproxy serving addr=%s\n", ln.Addr())
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.Serve(ln); err != http.ErrServerClosed {
		return err
	}
	return nil
}
