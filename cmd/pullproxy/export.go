package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/archive"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/upstream"
)

// export runs `pullproxy export`: an OCI image-layout archive of images,
// from the store, fetched first where the store lacks them.
func export(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newMirrorCommand("export", "export",
		"usage: pullproxy export -o FILE.tar [--data-dir DIR | --config FILE | --server ADDR] REF...\n\n"+
			"Writes an OCI image-layout archive of the images, every platform, from the store (fetching what\n"+
			"it lacks), each tagged with its full reference (org.opencontainers.image.ref.name). skopeo\n"+
			"(oci-archive:), crane and ctr image import read it; pullproxy import loads it elsewhere.\n\n", stderr)
	fs := c.flags
	out := fs.String("o", "", "the archive to write (an OCI image layout as a tar)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" || fs.NArg() == 0 {
		fs.Usage()
		return errors.New("export: want -o FILE.tar and at least one image")
	}
	var pins []imageref.Ref
	for _, ref := range fs.Args() {
		p, err := imageref.Parse(ref)
		if err != nil {
			return fmt.Errorf("export: %w", err)
		}
		pins = append(pins, p)
	}
	cfg, err := c.config()
	if err != nil {
		return err
	}
	cfg.Upstreams = withStoreOnlyUpstreams(cfg.Upstreams, pins)
	m, server, err := c.open(ctx, cfg, stderr)
	if err != nil {
		return err
	}
	if server != nil {
		return admin.Export(ctx, *server, fs.Args(), *out, stdout)
	}
	defer m.Close()
	err = fsutil.WriteFileFunc(*out, func(w io.Writer) error {
		return archive.Export(ctx, m.Server, pins, filepath.Dir(*out), w, stdout, progress.IsTerminal(stdout))
	})
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	fmt.Fprintf(stdout, "wrote %s\n", *out)
	return nil
}

// withStoreOnlyUpstreams adds to ups, as offline, the upstreams of pins
// that ups lacks: an image the store holds is exported without its
// upstream configured (an air-gapped site's data dir, or a copy of one).
func withStoreOnlyUpstreams(ups []config.Upstream, pins []imageref.Ref) []config.Upstream {
	have := map[string]bool{}
	for _, u := range ups {
		have[upstream.CanonicalName(u.Name)] = true
	}
	for _, p := range pins {
		if !have[p.Upstream] {
			have[p.Upstream] = true
			ups = append(ups, config.Upstream{Name: p.Upstream, Offline: true})
		}
	}
	return ups
}
