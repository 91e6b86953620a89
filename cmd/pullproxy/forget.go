package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
)

// forget runs `pullproxy forget DIGEST...`.
func forget(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newMirrorCommand("forget", "forget",
		"usage: pullproxy forget [--data-dir DIR | --config FILE | --server ADDR] DIGEST...\n\n"+
			"After a blob that failed verification was deleted upstream and pushed again: ask every\n"+
			"endpoint for it again at once, instead of after its wait (1 minute, doubling to 30).\n\n", stderr)
	fs := c.flags
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("forget: want one or more digests (sha256:...)")
	}
	for _, arg := range fs.Args() {
		if _, err := digest.Parse(arg); err != nil {
			return fmt.Errorf("forget: %q is not a digest: %w", arg, err)
		}
	}
	cfg, err := c.config()
	if err != nil {
		return err
	}
	target, err := c.target(cfg)
	if err != nil {
		return err
	}
	for _, arg := range fs.Args() {
		ans, err := admin.Forget(ctx, target, arg)
		if err != nil {
			return fmt.Errorf("forget %s: %w", arg, err)
		}
		if len(ans.Cleared) == 0 {
			fmt.Fprintf(stdout, "%s: no endpoint was kept from it: nothing to forget\n", ans.Digest)
		}
		for _, c := range ans.Cleared {
			fmt.Fprintf(stdout, "%s: %s %s is asked for it again (it served it corrupt %d time(s) in a row; next try was %s)\n",
				ans.Digest, c.Upstream, c.Endpoint, c.Failures, c.RetryAt.Local().Format(time.TimeOnly))
		}
	}
	return nil
}
