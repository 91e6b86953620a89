package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"runtime"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/storage"
)

// exitError ends the process with code after printing err, if any.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string {
	if e.err == nil {
		return ""
	}
	return e.err.Error()
}

func (e *exitError) Unwrap() error { return e.err }

// Exit codes of verify, as fsck's: problems found and all repaired, found
// and left, or no verdict.
const (
	verifyRepaired = 1
	verifyFound    = 2
	verifyFailed   = 3
)

// verify runs `pullproxy verify`: it re-hashes the store, checks files and
// metadata against each other, reports every problem on stdout, and with
// --repair fixes them so that what was damaged is fetched again.
func verify(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("verify", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dataDir := fs.String("data-dir", "", "the data dir to verify (default: the config's, or ./data)")
	configPath := fs.String("config", "", "YAML configuration file, for its data_dir")
	repair := fs.Bool("repair", false, "quarantine damaged blobs (fetched again when asked for), remove stray files, "+
		"fix metadata records, and rebuild a damaged metadata database")
	parallel := fs.Int("parallel", runtime.GOMAXPROCS(0), "blobs hashed at once")
	quiet := fs.Bool("quiet", false, "no progress on stderr")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: pullproxy verify [--repair] [--data-dir DIR | --config FILE]\n\n"+
			"Re-hashes every stored blob and checks blob files and metadata against each other, while no\n"+
			"server uses the data dir. Exit status: 0 nothing wrong; 1 problems found and repaired;\n"+
			"2 problems found (run with --repair); 3 the verification could not run.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return &exitError{code: verifyFailed, err: err}
	}
	cfg := config.Default()
	if *configPath != "" {
		if err := config.LoadFile(*configPath, &cfg); err != nil {
			return &exitError{code: verifyFailed, err: err}
		}
	}
	if *dataDir != "" {
		cfg.DataDir = *dataDir
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	var store *storage.Store
	var rebuilt *storage.Problem
	var err error
	if *repair {
		store, rebuilt, err = storage.OpenForRepair(ctx, cfg.DataDir, storage.WithLogger(log))
	} else {
		store, err = storage.Open(ctx, cfg.DataDir, storage.WithLogger(log))
	}
	switch {
	case errors.Is(err, storage.ErrInUse):
		return &exitError{code: verifyFailed, err: fmt.Errorf("verify: %w; stop the server first", err)}
	case errors.Is(err, storage.ErrMetadataDamaged):
		fmt.Fprintf(stdout, "%s %s: %v\n", storage.ProblemRebuilt, cfg.DataDir, err)
		return &exitError{code: verifyFound, err: errors.New("verify: the metadata database is damaged: run with --repair to rebuild it")}
	case err != nil:
		return &exitError{code: verifyFailed, err: fmt.Errorf("verify: %w", err)}
	}
	defer store.Close()

	opts := storage.VerifyOptions{Repair: *repair, Parallel: *parallel}
	if !*quiet {
		opts.Progress = func(done, total int64) {
			pct := 100.0
			if total > 0 {
				pct = 100 * float64(done) / float64(total)
			}
			fmt.Fprintf(stderr, "verified %s of %s (%.0f%%)\n", progress.Bytes(done), progress.Bytes(total), pct)
		}
	}
	problems, err := store.Verify(ctx, opts)
	if rebuilt != nil {
		problems = append([]storage.Problem{*rebuilt}, problems...)
	}
	repaired := 0
	for _, p := range problems {
		what := string(p.Digest)
		if what == "" {
			what = p.Path
		}
		line := fmt.Sprintf("%s %s: %s", p.Kind, what, p.Detail)
		if p.Repaired != "" {
			line += "; " + p.Repaired
			repaired++
		}
		fmt.Fprintln(stdout, line)
	}
	if err != nil {
		return &exitError{code: verifyFailed, err: fmt.Errorf("verify: %w", err)}
	}
	fmt.Fprintf(stdout, "%d problems, %d repaired\n", len(problems), repaired)
	switch {
	case len(problems) == 0:
		return nil
	case repaired == len(problems):
		return &exitError{code: verifyRepaired}
	}
	return &exitError{code: verifyFound}
}
