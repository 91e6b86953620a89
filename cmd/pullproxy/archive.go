package main

import (
	"archive/tar"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
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

// export runs `pullproxy export`: an OCI image-layout archive of images,
// from the store, fetched first where the store lacks them.
func export(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("export", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var af config.CommandFlags
	af.Register(fs)
	out := fs.String("o", "", "the archive to write (an OCI image layout as a tar)")
	var admin adminFlags
	admin.register(fs, "export")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: pullproxy export -o FILE.tar [--data-dir DIR | --config FILE | --server ADDR] REF...\n\n"+
			"Writes an OCI image-layout archive of the images, every platform, from the store (fetching what\n"+
			"it lacks), each tagged with its full reference (org.opencontainers.image.ref.name). skopeo\n"+
			"(oci-archive:), crane and ctr image import read it; pullproxy import loads it elsewhere.\n\n")
		fs.PrintDefaults()
	}
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
	cfg, err := af.Load()
	if err != nil {
		return err
	}
	if admin.server != "" {
		target, err := admin.target(cfg)
		if err != nil {
			return fmt.Errorf("export: %w", err)
		}
		return exportThroughServer(ctx, target, fs.Args(), *out, stdout)
	}
	cfg.Upstreams = withStoreOnlyUpstreams(cfg.Upstreams, pins)
	m, err := openCommandMirror(ctx, cfg, stderr)
	if errors.Is(err, storage.ErrInUse) {
		// A server runs on the data dir: through its admin endpoint.
		target, terr := admin.target(cfg)
		if terr != nil {
			return fmt.Errorf("%w; and its admin endpoint: %w", err, terr)
		}
		return exportThroughServer(ctx, target, fs.Args(), *out, stdout)
	}
	if err != nil {
		return err
	}
	defer m.Close()
	err = fsutil.WriteFileFunc(*out, func(w io.Writer) error {
		return exportImages(ctx, m.Server, pins, filepath.Dir(*out), w, stdout, progress.IsTerminal(stdout))
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

// exportImages writes an OCI image-layout archive of pins to w, the
// images read through srv's registry API on a loopback port of this
// process: the same requests, checks and fetching as a client's pull. The
// layout is assembled under tmpBase. It reports each image to report.
func exportImages(ctx context.Context, srv http.Handler, pins []imageref.Ref, tmpBase string, w io.Writer, report io.Writer, terminal bool) error {
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

// exportThroughServer asks a running server's admin endpoint for the
// archive, and writes it to out.
func exportThroughServer(ctx context.Context, server adminTarget, refs []string, out string, stdout io.Writer) error {
	q := url.Values{"ref": refs}
	resp, err := adminCall(ctx, server, http.MethodGet, "/export?"+q.Encode(), "", nil)
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	defer resp.Body.Close()
	var got atomic.Int64
	report := progress.Start(stdout, progress.IsTerminal(stdout), "exporting", func() (int64, int64, string) { return got.Load(), 0, "" })
	err = fsutil.WriteFileFunc(out, func(w io.Writer) error {
		_, err := io.Copy(w, progress.CountingReader{R: resp.Body, N: &got})
		return err
	})
	report.End()
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	// The server says what it exported in a trailer-free way: the
	// archive's index names each image.
	fmt.Fprintf(stdout, "wrote %s (%s)\n", out, progress.Bytes(got.Load()))
	return nil
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

// countingBody is a response body read through a countingReader.
type countingBody struct {
	io.Closer
	r progress.CountingReader
}

func (b countingBody) Read(p []byte) (int, error) { return b.r.Read(p) }
