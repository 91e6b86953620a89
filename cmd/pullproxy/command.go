package main

// What the commands besides serve share.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/storage"
)

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
