package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/archive"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
)

// importArchives runs `pullproxy import`: OCI image-layout archives and
// docker-save tars into the store, every blob verified, their tags
// recorded under their registries' names, so that a site without any
// upstream serves them (serve --offline).
func importArchives(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newMirrorCommand("import", "import",
		"usage: pullproxy import [--data-dir DIR | --config FILE | --server ADDR] [--retag] FILE.tar...\n\n"+
			"Loads OCI image-layout archives (pullproxy export, skopeo oci-archive:) and docker-save tars\n"+
			"(crane pull, docker save) into the store, verifying every digest and size, and records their\n"+
			"tags (full references: docker.io/library/alpine:3.20). An archive with a bad entry is refused\n"+
			"whole and leaves the store as it was, as does an import cancelled.\n\n"+
			"Tags are recorded only for upstreams that are not online (offline: true, or not configured;\n"+
			"without a config the public registries are configured): an online upstream's tags stay the\n"+
			"upstream's, and its blobs are imported. --retag records them all the same.\n\n", stderr)
	fs := c.flags
	retag := fs.Bool("retag", false, "record the archive's tags and repositories even for upstreams that are online (configured, not offline: true)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("import: no archive given")
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
		return admin.Import(ctx, *server, fs.Args(), *retag, stdout)
	}
	defer m.Close()
	failed := 0
	for _, file := range fs.Args() {
		imp := archive.NewImporter(m, file, *retag)
		var size int64
		if fi, err := os.Stat(file); err == nil {
			size = fi.Size()
		}
		report := progress.Start(stdout, progress.IsTerminal(stdout), "importing "+file, func() (int64, int64, string) {
			return imp.Read(), size, ""
		})
		err := imp.Run(ctx)
		report.End()
		if err != nil {
			fmt.Fprintf(stdout, "error %s: %v\n", file, err)
			failed++
			continue
		}
		imp.Report(stdout, file)
	}
	if failed > 0 {
		return fmt.Errorf("import: %d of %d archives refused", failed, fs.NArg())
	}
	return nil
}
