package archive

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"sync/atomic"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/proxy"
)

// Mirror is what an export reads images through: the mirror core, which
// fetches what the store lacks with the same downloads and checks as a
// client's pull. *proxy.Server is one.
type Mirror interface {
	Manifest(ctx context.Context, upstreamName, repo, ref string) (proxy.Manifest, error)
	EnsureBlob(ctx context.Context, upstreamName, repo string, d digest.Digest, landed func(n int64)) (int64, error)
	OpenBlob(ctx context.Context, upstreamName, repo string, d digest.Digest) (*os.File, int64, error)
}

var _ Mirror = (*proxy.Server)(nil)

// mirrorRepo is one repository of an upstream, read through the mirror as
// go-containerregistry's images and indexes, so that its layout writer
// writes them. go-containerregistry's interfaces take no context: the
// export's is kept here.
type mirrorRepo struct {
	ctx            context.Context
	m              Mirror
	upstream, repo string
	read           *atomic.Int64 // blob bytes read, for the progress
}

// descriptor returns what ref names: an image or an index.
func (r *mirrorRepo) descriptor(ref string) (proxy.Manifest, error) {
	return r.m.Manifest(r.ctx, r.upstream, r.repo, ref)
}

// image is the image whose manifest is m.
func (r *mirrorRepo) image(m proxy.Manifest) (v1.Image, error) {
	return partial.CompressedToImage(&mirrorImage{r: r, m: m})
}

// index is the index whose body is m.
func (r *mirrorRepo) index(m proxy.Manifest) v1.ImageIndex { return &mirrorIndex{r: r, m: m} }

// openBlob stores d if need be and opens it.
func (r *mirrorRepo) openBlob(d digest.Digest) (*os.File, int64, error) {
	if _, err := r.m.EnsureBlob(r.ctx, r.upstream, r.repo, d, nil); err != nil {
		return nil, 0, err
	}
	return r.m.OpenBlob(r.ctx, r.upstream, r.repo, d)
}

// mirrorImage is an image read through the mirror.
type mirrorImage struct {
	r *mirrorRepo
	m proxy.Manifest
}

func (i *mirrorImage) RawManifest() ([]byte, error) { return i.m.Body, nil }
func (i *mirrorImage) MediaType() (types.MediaType, error) {
	return types.MediaType(i.m.MediaType), nil
}
func (i *mirrorImage) Digest() (v1.Hash, error) { return v1.NewHash(i.m.Digest.String()) }

// LayerByDigest is the layer (or the config) of the manifest with digest h.
func (i *mirrorImage) LayerByDigest(h v1.Hash) (partial.CompressedLayer, error) {
	m, err := v1.ParseManifest(bytes.NewReader(i.m.Body))
	if err != nil {
		return nil, fmt.Errorf("the manifest of %s: %w", i.m.Digest, err)
	}
	for _, desc := range append(m.Layers, m.Config) {
		if desc.Digest == h {
			return &mirrorLayer{r: i.r, d: digest.Digest(h.String()), mediaType: desc.MediaType}, nil
		}
	}
	return nil, fmt.Errorf("the manifest of %s names no blob %s", i.m.Digest, h)
}

func (i *mirrorImage) RawConfigFile() ([]byte, error) {
	m, err := v1.ParseManifest(bytes.NewReader(i.m.Body))
	if err != nil {
		return nil, fmt.Errorf("the manifest of %s: %w", i.m.Digest, err)
	}
	f, _, err := i.r.openBlob(digest.Digest(m.Config.Digest.String()))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}

// mirrorLayer is a layer (or config) blob read through the mirror: stored
// first if the store lacks it, then read from its file.
type mirrorLayer struct {
	r         *mirrorRepo
	d         digest.Digest
	mediaType types.MediaType
}

func (l *mirrorLayer) Digest() (v1.Hash, error) { return v1.NewHash(l.d.String()) }

func (l *mirrorLayer) Size() (int64, error) {
	return l.r.m.EnsureBlob(l.r.ctx, l.r.upstream, l.r.repo, l.d, nil)
}

func (l *mirrorLayer) MediaType() (types.MediaType, error) { return l.mediaType, nil }

func (l *mirrorLayer) Compressed() (io.ReadCloser, error) {
	f, _, err := l.r.openBlob(l.d)
	if err != nil {
		return nil, err
	}
	return countedFile{f, l.r.read}, nil
}

// countedFile counts what is read from a blob's file into read.
type countedFile struct {
	*os.File
	read *atomic.Int64
}

func (f countedFile) Read(p []byte) (int, error) {
	n, err := f.File.Read(p)
	f.read.Add(int64(n))
	return n, err
}

// mirrorIndex is an index read through the mirror; its images and indexes
// are read as they are asked for.
type mirrorIndex struct {
	r *mirrorRepo
	m proxy.Manifest
}

func (x *mirrorIndex) MediaType() (types.MediaType, error) {
	return types.MediaType(x.m.MediaType), nil
}
func (x *mirrorIndex) Digest() (v1.Hash, error)     { return v1.NewHash(x.m.Digest.String()) }
func (x *mirrorIndex) Size() (int64, error)         { return int64(len(x.m.Body)), nil }
func (x *mirrorIndex) RawManifest() ([]byte, error) { return x.m.Body, nil }

func (x *mirrorIndex) IndexManifest() (*v1.IndexManifest, error) {
	return v1.ParseIndexManifest(bytes.NewReader(x.m.Body))
}

func (x *mirrorIndex) Image(h v1.Hash) (v1.Image, error) {
	m, err := x.r.descriptor(h.String())
	if err != nil {
		return nil, err
	}
	return x.r.image(m)
}

func (x *mirrorIndex) ImageIndex(h v1.Hash) (v1.ImageIndex, error) {
	m, err := x.r.descriptor(h.String())
	if err != nil {
		return nil, err
	}
	return x.r.index(m), nil
}
