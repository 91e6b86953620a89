package archive

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"io/fs"

	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
)

// Export writes an OCI image-layout archive of pins to w, the images read
// through the mirror core m: from the store, fetched first where it lacks
// them, with the same downloads and checks as a client's pull. The layout
// is assembled under tmpBase. It reports each image to report.
func Export(ctx context.Context, m Mirror, pins []imageref.Ref, tmpBase string, w io.Writer, report io.Writer, terminal bool) error {
	dir, err := os.MkdirTemp(tmpBase, ".pullproxy-export-*")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	var read atomic.Int64
	shown := progress.Start(report, terminal, "exporting", func() (int64, int64, string) {
		return read.Load(), 0, ""
	})
	defer shown.End()
	for _, p := range pins {
		full := p.Upstream + "/" + p.Repo + refSeparator(p.Ref) + p.Ref
		repo := &mirrorRepo{ctx: ctx, m: m, upstream: p.Upstream, repo: p.Repo, read: &read}
		top, err := repo.descriptor(p.Ref)
		if err != nil {
			return fmt.Errorf("%s: %w", full, err)
		}
		opt := layout.WithAnnotations(map[string]string{ocispec.AnnotationRefName: full})
		if types.MediaType(top.MediaType).IsIndex() {
			err = lp.AppendIndex(repo.index(top), opt)
		} else {
			var img v1.Image
			if img, err = repo.image(top); err == nil {
				err = lp.AppendImage(img, opt)
			}
		}
		if err != nil {
			return fmt.Errorf("%s: %w", full, err)
		}
		fmt.Fprintf(report, "exported %s %s\n", full, top.Digest)
	}
	return writeTar(dir, w)
}

func refSeparator(ref string) string {
	if strings.Contains(ref, ":") {
		return "@"
	}
	return ":"
}

// writeTar writes the files under dir to w as a tar: an OCI image layout
// as an archive (oci-archive).
func writeTar(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		hdr, err := tar.FileInfoHeader(fi, "")
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		hdr.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			hdr.Name += "/"
		}
		hdr.ModTime, hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = time.Unix(0, 0), 0, 0, "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(tw, f)
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// digestOf converts a go-containerregistry hash.
func digestOf(h v1.Hash) digest.Digest { return digest.Digest(h.String()) }
