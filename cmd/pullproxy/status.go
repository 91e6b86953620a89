package main

import (
	"context"
	"io"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
)

// status runs `pullproxy status`: a running server's live state of its
// upstreams, from its admin endpoint.
func status(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newMirrorCommand("status", "read the state", "", stderr)
	fs := c.flags
	asJSON := fs.Bool("json", false, "print JSON, as /debug/upstreams answers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := c.config()
	if err != nil {
		return err
	}
	target, err := c.target(cfg)
	if err != nil {
		return err
	}
	return admin.PrintStatus(ctx, target, stdout, *asJSON)
}
