// Package archivetest builds image archives for tests: OCI image layouts
// whose manifests may claim what they like, and the sparse tar entries
// that tar.Writer does not write, as hostile or careless producers make
// them.
package archivetest

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Layout builds an OCI image-layout tar whose manifests may claim
// what they like: the archives a hostile or careless producer writes.
type Layout struct {
	raw   bytes.Buffer // entries written so far
	tw    *tar.Writer
	names map[string]bool
	index ocispec.Index
}

// NewLayout starts an empty image layout.
func NewLayout() *Layout {
	a := &Layout{names: map[string]bool{}, index: ocispec.Index{MediaType: ocispec.MediaTypeImageIndex}}
	a.index.SchemaVersion = 2
	a.tw = tar.NewWriter(&a.raw)
	a.File("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	return a
}

// File adds a regular entry.
func (a *Layout) File(name string, b []byte) {
	if a.names[name] {
		return
	}
	a.names[name] = true
	a.tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: int64(len(b)), Mode: 0o644})
	a.tw.Write(b)
	a.tw.Flush()
}

// Blob adds b as a blob and returns its true descriptor.
func (a *Layout) Blob(mediaType string, b []byte) ocispec.Descriptor {
	d := digest.FromBytes(b)
	a.File(BlobEntryName(d), b)
	return ocispec.Descriptor{MediaType: mediaType, Digest: d, Size: int64(len(b))}
}

// SparseBlob adds a blob of size bytes, data then zeros, as a PAX sparse
// entry carrying data alone.
func (a *Layout) SparseBlob(mediaType string, data []byte, size int64) ocispec.Descriptor {
	whole := append(bytes.Clone(data), make([]byte, size-int64(len(data)))...)
	d := digest.FromBytes(whole)
	a.raw.Write(PAXSparseEntry(BlobEntryName(d), data, size))
	return ocispec.Descriptor{MediaType: mediaType, Digest: d, Size: size}
}

// Image adds an image of layers, tagged ref, and returns its manifest's
// descriptor.
func (a *Layout) Image(ref string, seed uint64, layers ...ocispec.Descriptor) ocispec.Descriptor {
	cfg := a.Blob(ocispec.MediaTypeImageConfig, []byte(fmt.Sprintf(
		`{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]},"comment":"%d"}`, seed)))
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, Config: cfg, Layers: layers}
	m.SchemaVersion = 2
	raw, _ := json.Marshal(m)
	desc := a.Blob(ocispec.MediaTypeImageManifest, raw)
	desc.Annotations = map[string]string{ocispec.AnnotationRefName: ref}
	a.index.Manifests = append(a.index.Manifests, desc)
	return desc
}

// Write writes the archive to path.
func (a *Layout) Write(t testing.TB, path string) {
	t.Helper()
	idx, _ := json.Marshal(a.index)
	a.File("index.json", idx)
	a.tw.Close()
	if err := os.WriteFile(path, a.raw.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// BlobEntryName is where an image layout holds blob d.
func BlobEntryName(d digest.Digest) string {
	return "blobs/" + string(d.Algorithm()) + "/" + d.Encoded()
}

// LayerBytes returns n reproducible incompressible bytes.
func LayerBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16)})
	r.Read(b)
	return b
}

// ustarBlock is a tar header block, written by hand: tar.Writer writes no
// sparse entries.
func ustarBlock(name string, size int64, typeflag byte, gnu bool) []byte {
	b := make([]byte, 512)
	copy(b[0:100], name)
	copy(b[100:108], "0000644\x00")
	copy(b[108:116], "0000000\x00")
	copy(b[116:124], "0000000\x00")
	copy(b[124:136], fmt.Sprintf("%011o\x00", size))
	copy(b[136:148], "00000000000\x00")
	b[156] = typeflag
	copy(b[257:265], "ustar\x0000")
	if gnu {
		copy(b[257:265], "ustar  \x00")
	}
	return b
}

// checksummed fills in b's header checksum.
func checksummed(b []byte) []byte {
	copy(b[148:156], "        ")
	sum := 0
	for _, c := range b {
		sum += int(c)
	}
	copy(b[148:156], fmt.Sprintf("%06o\x00 ", sum))
	return b
}

func padBlock(b []byte) []byte { return append(b, make([]byte, (512-len(b)%512)%512)...) }

func paxRecord(k, v string) string {
	r := " " + k + "=" + v + "\n"
	for n := len(r); ; {
		s := strconv.Itoa(n) + r
		if len(s) == n {
			return s
		}
		n = len(s)
	}
}

// PAXSparseEntry is a PAX (GNU 1.0) sparse entry named name of size
// bytes: data, then a hole.
func PAXSparseEntry(name string, data []byte, size int64) []byte {
	recs := paxRecord("GNU.sparse.major", "1") + paxRecord("GNU.sparse.minor", "0") +
		paxRecord("GNU.sparse.name", name) + paxRecord("GNU.sparse.realsize", strconv.FormatInt(size, 10))
	out := checksummed(ustarBlock("PaxHeaders/sparse", int64(len(recs)), tar.TypeXHeader, false))
	out = append(out, padBlock([]byte(recs))...)
	body := append(padBlock([]byte(fmt.Sprintf("1\n0\n%d\n", len(data)))), data...)
	out = append(out, checksummed(ustarBlock("GNUSparseFile.0/sparse", int64(len(body)), tar.TypeReg, false))...)
	return append(out, padBlock(body)...)
}

// GNUSparseEntry is an old-GNU sparse entry (type S) of size bytes:
// data, then a hole.
func GNUSparseEntry(name string, data []byte, size int64) []byte {
	h := ustarBlock(name, int64(len(data)), tar.TypeGNUSparse, true)
	copy(h[386:398], fmt.Sprintf("%011o\x00", 0))
	copy(h[398:410], fmt.Sprintf("%011o\x00", len(data)))
	copy(h[483:495], fmt.Sprintf("%011o\x00", size))
	return append(checksummed(h), padBlock(data)...)
}
