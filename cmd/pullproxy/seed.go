package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
)

// seed runs `pullproxy seed`: it fetches images into the store before they
// are needed, on a data dir no server runs on, or through a running
// server's admin endpoint (--server).
func seed(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newMirrorCommand("seed", "seed",
		"usage: pullproxy seed [--platform os/arch,...|all] [--referrers] [--data-dir DIR | --config FILE | --server ADDR] REF... | -f FILE\n\n"+
			"Fetches images into the store before they are needed. REF names the upstream first:\n"+
			"docker.io/library/alpine:3.20, ghcr.io/org/app@sha256:...\n\n", stderr)
	fs := c.flags
	platforms := fs.String("platform", "", "os/arch[/variant],... of an index's images to seed, or all (default: this machine's, linux/"+hostArch()+")")
	referrers := fs.Bool("referrers", false, "seed what refers to the images too (signatures, SBOMs)")
	file := fs.String("f", "", "a file of references, one per line (# comments)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	refs := fs.Args()
	if *file != "" {
		more, err := readRefFile(*file)
		if err != nil {
			return err
		}
		refs = append(refs, more...)
	}
	if len(refs) == 0 {
		fs.Usage()
		return errors.New("seed: no image given")
	}
	req := mirror.SeedRequest{Refs: refs, Referrers: *referrers}
	switch *platforms {
	case "all":
	case "":
		req.Platforms = []string{"linux/" + hostArch()}
	default:
		req.Platforms = strings.Split(*platforms, ",")
	}
	cfg, err := c.config()
	if err != nil {
		return err
	}
	m, server, err := c.open(ctx, cfg, stderr)
	if err != nil {
		return err
	}
	if server != nil {
		return admin.Seed(ctx, *server, req, stdout)
	}
	defer m.Close()
	return m.Seed(ctx, req, stdout, progress.IsTerminal(stdout))
}

// readRefFile reads references, one per line; blank lines and # comments
// are skipped.
func readRefFile(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("seed: %w", err)
	}
	var refs []string
	for line := range strings.Lines(string(b)) {
		line, _, _ = strings.Cut(line, "#")
		if line = strings.TrimSpace(line); line != "" {
			refs = append(refs, line)
		}
	}
	return refs, nil
}
