package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
)

// status runs `pullproxy status`: a running server's live state of its
// upstreams, from its admin endpoint.
func status(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var af config.CommandFlags
	af.Register(fs)
	var endpoint admin.Flags
	endpoint.Register(fs, "read the state")
	asJSON := fs.Bool("json", false, "print JSON, as /debug/upstreams answers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := af.Load()
	if err != nil {
		return err
	}
	target, err := endpoint.Target(cfg)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	return admin.PrintStatus(ctx, target, stdout, *asJSON)
}
