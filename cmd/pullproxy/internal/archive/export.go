package archive

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
)

// Export writes an OCI image-layout archive of pins to w, the
// images read through srv's registry API on a loopback port of this
// process: the same requests, checks and fetching as a client's pull. The
// layout is assembled under tmpBase. It reports each image to report.
func Export(ctx context.Context, srv http.Handler, pins []imageref.Ref, tmpBase string, w io.Writer, report io.Writer, terminal bool) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	go hs.Serve(ln)
	defer hs.Close()

	dir, err := os.MkdirTemp(tmpBase, ".pullproxy-export-*")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	var fetched atomic.Int64
	shown := progress.Start(report, terminal, "exporting", func() (int64, int64, string) {
		return fetched.Load(), 0, ""
	})
	defer shown.End()
	for _, p := range pins {
		full := p.Upstream + "/" + p.Repo + refSeparator(p.Ref) + p.Ref
		ref, err := name.ParseReference(ln.Addr().String()+"/"+p.Repo+refSeparator(p.Ref)+p.Ref, name.Insecure)
		if err != nil {
			return fmt.Errorf("%s: %w", full, err)
		}
		desc, err := remote.Get(ref, remote.WithContext(ctx), remote.WithTransport(nsTransport{p.Upstream, http.DefaultTransport, &fetched}))
		if err != nil {
			return fmt.Errorf("%s: %w", full, err)
		}
		opt := layout.WithAnnotations(map[string]string{ocispec.AnnotationRefName: full})
		if desc.MediaType.IsIndex() {
			idx, err := desc.ImageIndex()
			if err == nil {
				err = lp.AppendIndex(idx, opt)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", full, err)
			}
		} else {
			img, err := desc.Image()
			if err == nil {
				err = lp.AppendImage(img, opt)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", full, err)
			}
		}
		fmt.Fprintf(report, "exported %s %s\n", full, desc.Digest)
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

// nsTransport names the upstream of every request in containerd's ns
// parameter, as pullproxy routes them.
// It counts the bytes of the answers into read, for the progress.
type nsTransport struct {
	upstream string
	next     http.RoundTripper
	read     *atomic.Int64
}

func (t nsTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	q := r.URL.Query()
	q.Set("ns", t.upstream)
	r.URL.RawQuery = q.Encode()
	resp, err := t.next.RoundTrip(r)
	if err == nil {
		resp.Body = countingBody{resp.Body, progress.CountingReader{R: resp.Body, N: t.read}}
	}
	return resp, err
}

// countingBody is a response body read through a progress.CountingReader.
type countingBody struct {
	io.Closer
	r progress.CountingReader
}

func (b countingBody) Read(p []byte) (int, error) { return b.r.Read(p) }
