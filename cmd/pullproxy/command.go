package main

// What the commands besides serve share.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"runtime"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/storage"
)

// mirrorCommand is a command that works on a mirror: on its data dir
// (--data-dir, --config), or through a running server's admin endpoint
// (--server, or the socket of a server found running on the data dir).
type mirrorCommand struct {
	name  string
	flags *flag.FlagSet
	where config.CommandFlags
	admin admin.Flags
}

// newMirrorCommand returns the command name with the flags that say where
// the mirror is. asks says what it asks of a running server, for the
// --server flag's text; usage is printed before the flags.
func newMirrorCommand(name, asks, usage string, stderr io.Writer) *mirrorCommand {
	c := &mirrorCommand{name: name, flags: flag.NewFlagSet(name, flag.ContinueOnError)}
	c.flags.SetOutput(stderr)
	c.where.Register(c.flags)
	c.admin.Register(c.flags, asks)
	if usage != "" {
		c.flags.Usage = func() {
			fmt.Fprint(stderr, usage)
			c.flags.PrintDefaults()
		}
	}
	return c
}

// config loads the configuration the flags name.
func (c *mirrorCommand) config() (config.File, error) { return c.where.Load() }

// target is the running server's admin endpoint, as the flags and cfg name it.
func (c *mirrorCommand) target(cfg config.File) (admin.Target, error) {
	t, err := c.admin.Target(cfg)
	if err != nil {
		return t, fmt.Errorf("%s: %w", c.name, err)
	}
	return t, nil
}

// open opens cfg's data dir for the command, unless a server is to do the
// work: with --server, or when a server runs on the data dir. It then
// returns that server's admin endpoint and no mirror.
func (c *mirrorCommand) open(ctx context.Context, cfg config.File, stderr io.Writer) (*mirror.Mirror, *admin.Target, error) {
	if c.admin.Server != "" {
		t, err := c.target(cfg)
		return nil, &t, err
	}
	m, err := openCommandMirror(ctx, cfg, stderr)
	if errors.Is(err, storage.ErrInUse) {
		t, terr := c.admin.Target(cfg)
		if terr != nil {
			return nil, nil, fmt.Errorf("%w; and its admin endpoint: %w", err, terr)
		}
		return nil, &t, nil
	}
	return m, nil, err
}

// openCommandMirror opens the data dir for a command, quietly: the
// command's output says what it does.
func openCommandMirror(ctx context.Context, cfg config.File, stderr io.Writer) (*mirror.Mirror, error) {
	log, err := newLogger(cfg, stderr)
	if err != nil {
		return nil, err
	}
	log = slog.New(levelFloor{log.Handler(), slog.LevelWarn})
	m, err := mirror.Open(ctx, cfg, log, nil, false)
	if errors.Is(err, storage.ErrInUse) {
		return nil, fmt.Errorf("%w; stop the server first", err)
	}
	return m, err
}

// levelFloor drops records below its level: a command's output is its
// progress, with only warnings and errors of the log.
type levelFloor struct {
	slog.Handler
	min slog.Level
}

func (h levelFloor) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.min && h.Handler.Enabled(ctx, l)
}

// hostArch is this machine's architecture, as image indexes name it.
func hostArch() string { return runtime.GOARCH }
