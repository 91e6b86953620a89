package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/pullproxy/pullproxy/storage"
)

// importArchives runs `pullproxy import`: OCI image-layout archives and
// docker-save tars into the store, every blob verified, their tags
// recorded under their registries' names, so that a site without any
// upstream serves them (serve --offline).
func importArchives(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("import", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var af archiveFlags
	af.register(fs)
	var admin adminFlags
	admin.register(fs, "import")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: pullproxy import [--data-dir DIR | --config FILE | --server ADDR] FILE.tar...\n\n"+
			"Loads OCI image-layout archives (pullproxy export, skopeo oci-archive:) and docker-save tars\n"+
			"(crane pull, docker save) into the store, verifying every digest and size, and records their\n"+
			"tags (full references: docker.io/library/alpine:3.20). An archive with a bad entry is refused\n"+
			"whole and leaves the store as it was.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("import: no archive given")
	}
	cfg, err := af.config()
	if err != nil {
		return err
	}
	if admin.server != "" {
		target, err := admin.target(cfg)
		if err != nil {
			return fmt.Errorf("import: %w", err)
		}
		return importThroughServer(ctx, target, fs.Args(), stdout)
	}
	m, err := openCommandMirror(ctx, cfg, stderr)
	if errors.Is(err, storage.ErrInUse) {
		// A server runs on the data dir: through its admin endpoint.
		target, terr := admin.target(cfg)
		if terr != nil {
			return fmt.Errorf("%w; and its admin endpoint: %w", err, terr)
		}
		return importThroughServer(ctx, target, fs.Args(), stdout)
	}
	if err != nil {
		return err
	}
	defer m.Close()
	failed := 0
	for _, file := range fs.Args() {
		imp := &importer{store: m.store, file: file}
		var size int64
		if fi, err := os.Stat(file); err == nil {
			size = fi.Size()
		}
		report := startProgress(stdout, isTerminal(stdout), "importing "+file, func() (int64, int64, string) {
			return imp.read.Load(), size, ""
		})
		err := imp.run(ctx, cfg.DataDir)
		report.End()
		if err != nil {
			fmt.Fprintf(stdout, "error %s: %v\n", file, err)
			failed++
			continue
		}
		for _, t := range imp.tagged {
			fmt.Fprintf(stdout, "imported %s %s\n", t.ref, t.digest)
		}
		fmt.Fprintf(stdout, "imported %s: %d images, %d blobs added, %s\n", file, len(imp.tagged), len(imp.added), humanBytes(imp.bytes))
	}
	if failed > 0 {
		return fmt.Errorf("import: %d of %d archives refused", failed, fs.NArg())
	}
	return nil
}

// importer loads one archive.
type importer struct {
	store *storage.Store
	file  string

	added  []digest.Digest // blobs this archive added: taken back on failure
	bytes  int64
	read   atomic.Int64 // blob bytes read from the archive so far
	tagged []importedTag
	// What each repository gets: its digests, and the sizes its manifests
	// declare (see storage.SetDeclaredSizes), recorded once all is in.
	members  map[repoKey]map[digest.Digest]int64
	seenBlob map[digest.Digest]bool
}

type repoKey struct{ upstream, repo string }

type importedTag struct {
	ref       string
	img       pinnedImage
	digest    digest.Digest
	mediaType string
	size      int64
}

func (imp *importer) run(ctx context.Context, dataDir string) (err error) {
	imp.members, imp.seenBlob = map[repoKey]map[digest.Digest]int64{}, map[digest.Digest]bool{}
	defer func() {
		if err != nil && len(imp.added) > 0 {
			if rerr := imp.store.RemoveBlobs(context.WithoutCancel(ctx), imp.added); rerr != nil {
				err = errors.Join(err, fmt.Errorf("taking back what it added: %w", rerr))
			}
			imp.added = nil
		}
	}()
	kind, err := archiveKind(imp.file)
	if err != nil {
		return err
	}
	switch kind {
	case "oci":
		// Extracted beside the store, on its file system: layout reads
		// blobs by path.
		dir, err := os.MkdirTemp(dataDir, ".import-*")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		if err := extractTar(imp.file, dir); err != nil {
			return err
		}
		if err := imp.fromLayout(ctx, dir); err != nil {
			return err
		}
	case "docker":
		if err := imp.fromDockerSave(ctx); err != nil {
			return err
		}
	}
	return imp.record(ctx)
}

// archiveKind tells an OCI image layout (index.json) from a docker-save
// tar (manifest.json); one with both (docker save since 25) is read as a
// docker-save tar, whose manifest.json names its images fully.
func archiveKind(file string) (string, error) {
	f, err := os.Open(file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	docker, oci := false, false
	last := ""
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil && last != "" {
			// Next reads past the previous entry's bytes: that is where
			// the archive ended.
			return "", fmt.Errorf("the archive ends inside entry %q (truncated?): %w", last, err)
		}
		if err != nil {
			return "", fmt.Errorf("not a readable tar: %w", err)
		}
		last = hdr.Name
		switch strings.TrimPrefix(hdr.Name, "./") {
		case "index.json":
			oci = true
		case "manifest.json":
			docker = true
		}
	}
	// docker save (since Docker 25) writes both, and names the images
	// fully only in manifest.json: read it as a docker-save tar.
	if docker {
		return "docker", nil
	}
	if oci {
		return "oci", nil
	}
	return "", errors.New("neither an OCI image layout (no index.json) nor a docker-save tar (no manifest.json)")
}

// extractTar writes a tar's regular files and directories under dir,
// refusing names that would land outside it and links.
func extractTar(file, dir string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading the tar: %w", err)
		}
		clean := filepath.Clean(filepath.FromSlash(hdr.Name))
		if !filepath.IsLocal(clean) {
			return fmt.Errorf("entry %q: a name outside the archive", hdr.Name)
		}
		target := filepath.Join(dir, clean)
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				return err
			}
			out, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
			if err != nil {
				return fmt.Errorf("entry %q: %w", hdr.Name, err)
			}
			n, err := io.Copy(out, tr)
			out.Close()
			if err != nil {
				return fmt.Errorf("entry %q: %d of its %d bytes: %w (a truncated archive?)", hdr.Name, n, hdr.Size, err)
			}
		default:
			return fmt.Errorf("entry %q: links and devices have no place in an image archive", hdr.Name)
		}
	}
}

// fromLayout imports every image and index index.json names with a full
// reference.
func (imp *importer) fromLayout(ctx context.Context, dir string) error {
	lp, err := layout.FromPath(dir)
	if err != nil {
		return fmt.Errorf("reading the OCI layout: %w", err)
	}
	idx, err := lp.ImageIndex()
	if err != nil {
		return fmt.Errorf("index.json: %w", err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return fmt.Errorf("index.json: %w", err)
	}
	for _, desc := range im.Manifests {
		refName := desc.Annotations[ocispec.AnnotationRefName]
		img, err := parsePin(refName)
		if err != nil || !strings.Contains(refName, "/") {
			return fmt.Errorf("index.json: %s is named %q, not a full reference (registry/repository:tag): "+
				"export it with pullproxy export, or name it so", desc.Digest, refName)
		}
		rk := repoKey{img.upstream, img.repo}
		if desc.MediaType.IsIndex() {
			child, err := idx.ImageIndex(desc.Digest)
			if err != nil {
				return fmt.Errorf("%s: %w", refName, err)
			}
			if err := imp.index(ctx, rk, child); err != nil {
				return fmt.Errorf("%s: %w", refName, err)
			}
		} else {
			child, err := idx.Image(desc.Digest)
			if err != nil {
				return fmt.Errorf("%s: %w", refName, err)
			}
			if err := imp.image(ctx, rk, child); err != nil {
				return fmt.Errorf("%s: %w", refName, err)
			}
		}
		imp.tag(refName, img, digestOf(desc.Digest), string(desc.MediaType), desc.Size)
	}
	return nil
}

// fromDockerSave imports every tagged image of a docker-save tar.
func (imp *importer) fromDockerSave(ctx context.Context) error {
	opener := func() (io.ReadCloser, error) { return os.Open(imp.file) }
	manifest, err := tarball.LoadManifest(opener)
	if err != nil {
		return fmt.Errorf("manifest.json: %w", err)
	}
	for _, entry := range manifest {
		for _, repoTag := range entry.RepoTags {
			tag, err := name.NewTag(repoTag)
			if err != nil {
				return fmt.Errorf("manifest.json: tag %q: %w", repoTag, err)
			}
			img, err := tarball.Image(opener, &tag)
			if err != nil {
				return fmt.Errorf("%s: %w", repoTag, err)
			}
			pin, err := parsePin(repoTag)
			if err != nil {
				return fmt.Errorf("manifest.json: %w", err)
			}
			if err := imp.image(ctx, repoKey{pin.upstream, pin.repo}, img); err != nil {
				return fmt.Errorf("%s: %w", repoTag, err)
			}
			d, _ := img.Digest()
			mt, _ := img.MediaType()
			size, _ := img.Size()
			imp.tag(repoTag, pin, digestOf(d), string(mt), size)
		}
	}
	return nil
}

// index imports an index and every image (or index) it lists.
func (imp *importer) index(ctx context.Context, rk repoKey, idx v1.ImageIndex) error {
	im, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	for _, desc := range im.Manifests {
		var err error
		if desc.MediaType.IsIndex() {
			var child v1.ImageIndex
			if child, err = idx.ImageIndex(desc.Digest); err == nil {
				err = imp.index(ctx, rk, child)
			}
		} else {
			var child v1.Image
			if child, err = idx.Image(desc.Digest); err == nil {
				err = imp.image(ctx, rk, child)
			}
		}
		if err != nil {
			return fmt.Errorf("%s: %w", desc.Digest, err)
		}
		imp.member(rk, digestOf(desc.Digest), desc.Size)
	}
	raw, err := idx.RawManifest()
	if err != nil {
		return err
	}
	mt, _ := idx.MediaType()
	d, _ := idx.Digest()
	return imp.manifest(ctx, rk, digestOf(d), string(mt), raw)
}

// image imports an image: its config, its layers, its manifest.
func (imp *importer) image(ctx context.Context, rk repoKey, img v1.Image) error {
	m, err := img.Manifest()
	if err != nil {
		return err
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if err := imp.blob(ctx, rk, digestOf(m.Config.Digest), m.Config.Size, bytes.NewReader(cfg)); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	for _, ld := range m.Layers {
		if strings.Contains(string(ld.MediaType), "nondistributable") || strings.Contains(string(ld.MediaType), "foreign") {
			continue
		}
		l, err := img.LayerByDigest(ld.Digest)
		if err != nil {
			return fmt.Errorf("layer %s: %w", ld.Digest, err)
		}
		rc, err := l.Compressed()
		if err != nil {
			return fmt.Errorf("layer %s: %w", ld.Digest, err)
		}
		err = imp.blob(ctx, rk, digestOf(ld.Digest), ld.Size, rc)
		rc.Close()
		if err != nil {
			return fmt.Errorf("entry blobs/%s/%s: %w", ld.Digest.Algorithm, ld.Digest.Hex, err)
		}
	}
	raw, err := img.RawManifest()
	if err != nil {
		return err
	}
	mt, _ := img.MediaType()
	d, _ := img.Digest()
	return imp.manifest(ctx, rk, digestOf(d), string(mt), raw)
}

// blob stores a blob, verified, unless the store holds it.
func (imp *importer) blob(ctx context.Context, rk repoKey, d digest.Digest, size int64, r io.Reader) error {
	imp.member(rk, d, size)
	if imp.seenBlob[d] {
		return nil
	}
	added, err := imp.store.Ingest(ctx, d, size, countingReader{r, &imp.read})
	if err != nil {
		return err
	}
	imp.seenBlob[d] = true
	if added {
		imp.added = append(imp.added, d)
		imp.bytes += size
	}
	return nil
}

// manifest stores a manifest or index, verified by its digest.
func (imp *importer) manifest(ctx context.Context, rk repoKey, d digest.Digest, mediaType string, raw []byte) error {
	imp.member(rk, d, int64(len(raw)))
	if _, err := imp.store.StatBlob(ctx, d); err != nil {
		if err := imp.store.PutBlob(ctx, d, raw); err != nil {
			return fmt.Errorf("manifest %s: %w", d, err)
		}
		imp.added = append(imp.added, d)
		imp.bytes += int64(len(raw))
	}
	return imp.store.SetMediaType(ctx, d, mediaType)
}

func (imp *importer) member(rk repoKey, d digest.Digest, size int64) {
	if imp.members[rk] == nil {
		imp.members[rk] = map[digest.Digest]int64{}
	}
	imp.members[rk][d] = size
}

func (imp *importer) tag(ref string, img pinnedImage, d digest.Digest, mediaType string, size int64) {
	imp.tagged = append(imp.tagged, importedTag{ref: ref, img: img, digest: d, mediaType: mediaType, size: size})
}

// record writes what the archive's content is: which repositories hold
// which digests, the tags, and the tag lists, once every blob is in.
func (imp *importer) record(ctx context.Context) error {
	for rk, sizes := range imp.members {
		if err := imp.store.SetDeclaredSizes(ctx, rk.upstream, rk.repo, sizes); err != nil {
			return err
		}
		if err := imp.store.AddMembers(ctx, rk.upstream, rk.repo, slices.Collect(maps.Keys(sizes))...); err != nil {
			return err
		}
	}
	now := time.Now()
	newTags := map[repoKey][]string{}
	for _, t := range imp.tagged {
		if _, err := digest.Parse(t.img.ref); err == nil {
			continue // by digest: no tag
		}
		rec := storage.TagRecord{Digest: t.digest, MediaType: t.mediaType, Size: t.size, CheckedAt: now}
		if err := imp.store.PutTag(ctx, t.img.upstream, t.img.repo, t.img.ref, rec); err != nil {
			return err
		}
		rk := repoKey{t.img.upstream, t.img.repo}
		newTags[rk] = append(newTags[rk], t.img.ref)
	}
	// The whole tag list (the page without n or last), so that listing
	// clients see the imported tags offline.
	for rk, tags := range newTags {
		list, err := imp.store.TagList(ctx, rk.upstream, rk.repo, "")
		if err != nil && !errors.Is(err, storage.ErrNotFound) {
			return err
		}
		all := slices.Compact(slices.Sorted(slices.Values(append(list.Tags, tags...))))
		if err := imp.store.PutTagList(ctx, rk.upstream, rk.repo, "", storage.TagListRecord{Tags: all, CheckedAt: now}); err != nil {
			return err
		}
	}
	return nil
}

// importThroughServer sends each archive to a running server's admin
// endpoint, and copies what it reports to out.
func importThroughServer(ctx context.Context, server adminTarget, files []string, out io.Writer) error {
	failed := 0
	for _, file := range files {
		f, err := os.Open(file)
		if err != nil {
			return fmt.Errorf("import: %w", err)
		}
		resp, err := adminCall(ctx, server, http.MethodPost, "/import?name="+url.QueryEscape(file), "application/x-tar", f)
		f.Close()
		if errors.Is(err, errAdminRefused) {
			fmt.Fprintln(out, err)
			failed++
			continue
		}
		if err != nil {
			return fmt.Errorf("import: %w", err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		text := strings.TrimSpace(string(body))
		if err != nil || !strings.HasSuffix(text, "done") {
			fmt.Fprintln(out, text)
			failed++
			continue
		}
		fmt.Fprintln(out, strings.TrimSuffix(text, "done"))
	}
	if failed > 0 {
		return fmt.Errorf("import: %d of %d archives refused", failed, len(files))
	}
	return nil
}
