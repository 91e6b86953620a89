// Package archive reads and writes image archives: OCI image layouts
// (pullproxy export, skopeo oci-archive:) and docker-save tars (crane
// pull, docker save). Export assembles a layout from what a registry
// server answers; an Importer loads an archive into the store, read in
// place and verified blob by blob, all or nothing.
package archive

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/storage"
)

// Importer loads one archive into a store.
type Importer struct {
	store *storage.Store
	file  string
	// mayRetag tells whether the archive may move upstream's tags and
	// record its repositories: an upstream that is online keeps its own
	// (the archive's blobs are imported all the same: content-addressed,
	// they change no answer) unless the operator asks (--retag).
	mayRetag func(upstream string) bool

	batch  *storage.IngestBatch // what this archive added: taken back on failure
	bytes  int64
	read   atomic.Int64 // blob bytes read from the archive so far
	tagged []importedTag
	kept   []string // upstreams whose tags the archive left alone
	// What each repository gets: its digests, and the sizes its manifests
	// declare (see storage.SetDeclaredSizes), recorded once all is in.
	members  map[repoKey]map[digest.Digest]int64
	seenBlob map[digest.Digest]bool
}

// NewImporter returns the importer of file into m's store: tags of m's
// online upstreams are moved only when retag.
func NewImporter(m *mirror.Mirror, file string, retag bool) *Importer {
	online := map[string]bool{}
	for _, u := range m.Upstreams {
		online[u.Name()] = true
	}
	return &Importer{store: m.Store, file: file, mayRetag: func(up string) bool { return retag || !online[up] }}
}

type repoKey struct{ upstream, repo string }

type importedTag struct {
	ref       string
	img       imageref.Ref
	digest    digest.Digest
	mediaType string
	size      int64
}

// errImportCancelled: the import was stopped (SIGTERM, the client gone)
// and what it added was taken back.
var errImportCancelled = errors.New("import cancelled")

// Run imports the archive: every size it declares checked first, every
// blob verified, and what it added taken back on failure or
// cancellation.
func (imp *Importer) Run(ctx context.Context) (err error) {
	imp.members, imp.seenBlob = map[repoKey]map[digest.Digest]int64{}, map[digest.Digest]bool{}
	if imp.mayRetag == nil {
		imp.mayRetag = func(string) bool { return true }
	}
	x, err := indexArchive(ctx, imp.file)
	if err != nil {
		return imp.cancelled(ctx, err)
	}
	defer x.Close()
	kind, err := archiveKind(x)
	if err != nil {
		return err
	}
	// Every size the archive declares is checked before anything is
	// written or evicted.
	var plan *layoutPlan
	switch kind {
	case "oci":
		if plan, err = imp.planLayout(ctx, x); err != nil {
			return imp.cancelled(ctx, err)
		}
	case "docker":
		for _, e := range x.entries {
			if err := imp.store.CheckFits("", e.size); err != nil {
				return fmt.Errorf("entry %q: %w", e.name, err)
			}
		}
	}
	if imp.batch, err = imp.store.BeginIngest(); err != nil {
		return err
	}
	defer func() {
		if err == nil {
			err = imp.batch.Keep()
			return
		}
		if rerr := imp.batch.Abandon(ctx); rerr != nil {
			err = errors.Join(err, fmt.Errorf("taking back what it added (the next start does): %w", rerr))
			return
		}
		err = imp.cancelled(ctx, err)
	}()
	switch kind {
	case "oci":
		err = imp.fromLayout(ctx, x, plan)
	case "docker":
		err = imp.fromDockerSave(ctx)
	}
	if err != nil {
		return err
	}
	return imp.record(ctx)
}

// Read returns the blob bytes read from the archive so far.
func (imp *Importer) Read() int64 { return imp.read.Load() }

// cancelled tells a failure that came of ctx's end as such.
func (imp *Importer) cancelled(ctx context.Context, err error) error {
	if ctx.Err() == nil {
		return err
	}
	return fmt.Errorf("%w (%v): nothing was kept", errImportCancelled, context.Cause(ctx))
}

// added returns the blobs the import added.
func (imp *Importer) added() []digest.Digest {
	if imp.batch == nil {
		return nil
	}
	return imp.batch.Added()
}

// archiveKind tells an OCI image layout (index.json) from a docker-save
// tar (manifest.json); one with both (docker save since 25) is read as a
// docker-save tar, whose manifest.json names its images fully.
func archiveKind(x *archiveIndex) (string, error) {
	_, docker := x.entries["manifest.json"]
	_, oci := x.entries["index.json"]
	if docker {
		return "docker", nil
	}
	if oci {
		return "oci", nil
	}
	return "", errors.New("neither an OCI image layout (no index.json) nor a docker-save tar (no manifest.json)")
}

// manifestLimit bounds a manifest or index read from an archive.
const manifestLimit = 4 << 20

// layoutPlan is what an OCI layout holds, read from its manifests before
// any blob is: per tagged image, the blobs and manifests to store.
type layoutPlan struct {
	blobs     []plannedBlob
	manifests []plannedManifest
}

type plannedBlob struct {
	rk   repoKey
	d    digest.Digest
	size int64
}

type plannedManifest struct {
	rk        repoKey
	d         digest.Digest
	mediaType string
	raw       []byte
}

func blobEntryName(d digest.Digest) string {
	return "blobs/" + string(d.Algorithm()) + "/" + d.Encoded()
}

// planLayout reads index.json and every manifest it leads to, each
// verified by its digest, and checks every size they declare against the
// store's bound and the archive's entries.
func (imp *Importer) planLayout(ctx context.Context, x *archiveIndex) (*layoutPlan, error) {
	raw, err := x.readSmall(ctx, "index.json", manifestLimit)
	if err != nil {
		return nil, err
	}
	var idx ocispec.Index
	if err := json.Unmarshal(raw, &idx); err != nil {
		return nil, fmt.Errorf("index.json: %w", err)
	}
	plan := &layoutPlan{}
	for _, desc := range idx.Manifests {
		refName := desc.Annotations[ocispec.AnnotationRefName]
		img, err := imageref.Parse(refName)
		if err != nil || !strings.Contains(refName, "/") {
			return nil, fmt.Errorf("index.json: %s is named %q, not a full reference (registry/repository:tag): "+
				"export it with pullproxy export, or name it so", desc.Digest, refName)
		}
		if err := imp.planManifest(ctx, x, plan, repoKey{img.Upstream, img.Repo}, desc, 0); err != nil {
			return nil, fmt.Errorf("%s: %w", refName, err)
		}
		imp.tag(refName, img, desc.Digest, desc.MediaType, desc.Size)
	}
	return plan, nil
}

// planManifest plans the manifest or index desc, and what it references.
func (imp *Importer) planManifest(ctx context.Context, x *archiveIndex, plan *layoutPlan, rk repoKey, desc ocispec.Descriptor, depth int) error {
	if depth > 4 {
		return errors.New("indexes nested too deep")
	}
	d := desc.Digest
	if err := d.Validate(); err != nil {
		return fmt.Errorf("descriptor: %w", err)
	}
	if desc.Size > manifestLimit {
		return fmt.Errorf("manifest %s: %d bytes declared, over the %d-byte limit", d, desc.Size, manifestLimit)
	}
	r, err := x.open(ctx, blobEntryName(d), desc.Size)
	if err != nil {
		return err
	}
	raw, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("entry %s: %w", blobEntryName(d), err)
	}
	if got := d.Algorithm().FromBytes(raw); got != d {
		return fmt.Errorf("entry %s: its bytes hash to %s", blobEntryName(d), got)
	}
	var m struct {
		MediaType string               `json:"mediaType"`
		Config    *ocispec.Descriptor  `json:"config"`
		Layers    []ocispec.Descriptor `json:"layers"`
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if err := json.Unmarshal(raw, &m); err != nil {
		return fmt.Errorf("manifest %s: %w", d, err)
	}
	mediaType := desc.MediaType
	if mediaType == "" {
		mediaType = m.MediaType
	}
	for _, child := range m.Manifests {
		if err := imp.planManifest(ctx, x, plan, rk, child, depth+1); err != nil {
			return fmt.Errorf("%s: %w", child.Digest, err)
		}
	}
	blobs := m.Layers
	if m.Config != nil {
		blobs = append([]ocispec.Descriptor{*m.Config}, blobs...)
	}
	for _, b := range blobs {
		if strings.Contains(b.MediaType, "nondistributable") || strings.Contains(b.MediaType, "foreign") {
			continue
		}
		if err := b.Digest.Validate(); err != nil {
			return fmt.Errorf("manifest %s: %w", d, err)
		}
		if err := imp.store.CheckFits(b.Digest, b.Size); err != nil {
			return fmt.Errorf("entry %s: %w", blobEntryName(b.Digest), err)
		}
		if _, err := x.open(ctx, blobEntryName(b.Digest), b.Size); err != nil {
			return err
		}
		plan.blobs = append(plan.blobs, plannedBlob{rk, b.Digest, b.Size})
	}
	plan.manifests = append(plan.manifests, plannedManifest{rk, d, mediaType, raw})
	return nil
}

// fromLayout stores what planLayout found: blobs first, then the
// manifests that reference them.
func (imp *Importer) fromLayout(ctx context.Context, x *archiveIndex, plan *layoutPlan) error {
	for _, b := range plan.blobs {
		r, err := x.open(ctx, blobEntryName(b.d), b.size)
		if err != nil {
			return err
		}
		if err := imp.blob(ctx, b.rk, b.d, b.size, r); err != nil {
			return fmt.Errorf("entry %s: %w", blobEntryName(b.d), err)
		}
	}
	for _, m := range plan.manifests {
		if err := imp.manifest(ctx, m.rk, m.d, m.mediaType, m.raw); err != nil {
			return err
		}
	}
	return nil
}

// fromDockerSave imports every tagged image of a docker-save tar.
func (imp *Importer) fromDockerSave(ctx context.Context) error {
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
			pin, err := imageref.Parse(repoTag)
			if err != nil {
				return fmt.Errorf("manifest.json: %w", err)
			}
			if err := imp.image(ctx, repoKey{pin.Upstream, pin.Repo}, img); err != nil {
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

// image imports an image: its config, its layers, its manifest.
func (imp *Importer) image(ctx context.Context, rk repoKey, img v1.Image) error {
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
func (imp *Importer) blob(ctx context.Context, rk repoKey, d digest.Digest, size int64, r io.Reader) error {
	imp.member(rk, d, size)
	if imp.seenBlob[d] {
		return nil
	}
	added, err := imp.batch.Ingest(ctx, d, size, progress.CountingReader{R: r, N: &imp.read})
	if err != nil {
		return err
	}
	imp.seenBlob[d] = true
	if added {
		imp.bytes += size
	}
	return nil
}

// manifest stores a manifest or index, verified by its digest.
func (imp *Importer) manifest(ctx context.Context, rk repoKey, d digest.Digest, mediaType string, raw []byte) error {
	imp.member(rk, d, int64(len(raw)))
	added, err := imp.batch.Put(ctx, d, raw)
	if err != nil {
		return fmt.Errorf("manifest %s: %w", d, err)
	}
	if added {
		imp.bytes += int64(len(raw))
	}
	return imp.store.SetMediaType(ctx, d, mediaType)
}

func (imp *Importer) member(rk repoKey, d digest.Digest, size int64) {
	if imp.members[rk] == nil {
		imp.members[rk] = map[digest.Digest]int64{}
	}
	imp.members[rk][d] = size
}

func (imp *Importer) tag(ref string, img imageref.Ref, d digest.Digest, mediaType string, size int64) {
	imp.tagged = append(imp.tagged, importedTag{ref: ref, img: img, digest: d, mediaType: mediaType, size: size})
}

// record writes what the archive's content is: which repositories hold
// which digests, the tags, and the tag lists, once every blob is in.
func (imp *Importer) record(ctx context.Context) error {
	for rk, sizes := range imp.members {
		if !imp.mayRetag(rk.upstream) {
			if !slices.Contains(imp.kept, rk.upstream) {
				imp.kept = append(imp.kept, rk.upstream)
			}
			continue
		}
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
		if _, err := digest.Parse(t.img.Ref); err == nil || !imp.mayRetag(t.img.Upstream) {
			continue // by digest, or the upstream's own: no tag
		}
		rec := storage.TagRecord{Digest: t.digest, MediaType: t.mediaType, Size: t.size, CheckedAt: now}
		if err := imp.store.PutTag(ctx, t.img.Upstream, t.img.Repo, t.img.Ref, rec); err != nil {
			return err
		}
		rk := repoKey{t.img.Upstream, t.img.Repo}
		newTags[rk] = append(newTags[rk], t.img.Ref)
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

// Report writes what the import did to w: each image, and whether its
// tag was recorded.
func (imp *Importer) Report(w io.Writer, name string) {
	for _, t := range imp.tagged {
		if imp.mayRetag(t.img.Upstream) {
			fmt.Fprintf(w, "imported %s %s\n", t.ref, t.digest)
			continue
		}
		fmt.Fprintf(w, "imported %s %s: its blobs only; the tag stays %s's, which is online (--retag to move it)\n",
			t.ref, t.digest, t.img.Upstream)
	}
	fmt.Fprintf(w, "imported %s: %d images, %d blobs added, %s\n", name, len(imp.tagged), len(imp.added()), progress.Bytes(imp.bytes))
}
