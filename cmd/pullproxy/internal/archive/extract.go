package archive

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// An archive is read in place, never unpacked: its entries are indexed
// first (names, and where each one's bytes lie in the file), and each blob
// is then read from the file through a reader bounded by the size its
// manifest declares. What an import writes is only the blobs it ingests,
// each checked against the store's bound first, so an archive cannot make
// pullproxy write more than it holds: a sparse entry (whose header claims
// more bytes than the archive carries) is refused, as are links, devices
// and names outside the archive.

// archiveIndex is an archive's regular entries, by cleaned name.
type archiveIndex struct {
	f       *os.File
	size    int64 // of the archive file
	entries map[string]archiveEntry
	links   map[string]bool // names of links: refused when read
}

// archiveEntry is where an entry's bytes lie in the archive file.
type archiveEntry struct {
	name         string // as the archive spells it
	offset, size int64
}

// maxArchiveEntries bounds an archive's entries: an image layout has a
// few per layer.
const maxArchiveEntries = 1 << 20

// indexArchive reads the headers of the tar at path, checking that each
// entry's bytes lie within the file. The caller closes the index.
func indexArchive(ctx context.Context, path string) (_ *archiveIndex, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	x := &archiveIndex{f: f, size: fi.Size(), entries: map[string]archiveEntry{}, links: map[string]bool{}}
	// tar.Reader reads headers block by block and seeks past entries'
	// bytes: after Next, the file's offset is where the entry's bytes start.
	tr := tar.NewReader(f)
	last := ""
	var total int64
	for n := 0; ; n++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if n > maxArchiveEntries {
			return nil, fmt.Errorf("more than %d entries: not an image archive", maxArchiveEntries)
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil && last != "" {
			return nil, fmt.Errorf("the archive ends inside entry %q (truncated?): %w", last, err)
		}
		if err != nil {
			return nil, fmt.Errorf("not a readable tar: %w", err)
		}
		last = hdr.Name
		if err := checkEntryHeader(hdr); err != nil {
			return nil, err
		}
		clean := filepath.ToSlash(filepath.Clean(filepath.FromSlash(hdr.Name)))
		switch hdr.Typeflag {
		case tar.TypeDir:
			continue
		case tar.TypeSymlink, tar.TypeLink:
			// docker save links a repeated layer; read by name, a link is
			// refused (readers follow none).
			x.links[clean] = true
			continue
		}
		offset, err := f.Seek(0, io.SeekCurrent)
		if err != nil {
			return nil, err
		}
		if hdr.Size < 0 || offset+hdr.Size > x.size {
			return nil, fmt.Errorf("the archive ends inside entry %q: it declares %d bytes, and the archive holds %d after its header (truncated?)",
				hdr.Name, hdr.Size, max(0, x.size-offset))
		}
		if total += hdr.Size; total > x.size {
			return nil, fmt.Errorf("entry %q: the entries declare more bytes than the archive holds", hdr.Name)
		}
		if _, dup := x.entries[clean]; dup || x.links[clean] {
			return nil, fmt.Errorf("entry %q: twice in the archive", hdr.Name)
		}
		x.entries[clean] = archiveEntry{name: hdr.Name, offset: offset, size: hdr.Size}
	}
	return x, nil
}

// checkEntryHeader refuses what has no place in an image archive: names
// outside it, devices, and sparse entries, whose bytes would expand to
// what their header claims rather than what the archive carries.
func checkEntryHeader(hdr *tar.Header) error {
	if !filepath.IsLocal(filepath.FromSlash(hdr.Name)) {
		return fmt.Errorf("entry %q: a name outside the archive", hdr.Name)
	}
	if hdr.Typeflag == tar.TypeGNUSparse {
		return fmt.Errorf("entry %q: a sparse file has no place in an image archive", hdr.Name)
	}
	for k := range hdr.PAXRecords {
		if strings.HasPrefix(k, "GNU.sparse.") {
			return fmt.Errorf("entry %q: a sparse file (PAX %s) has no place in an image archive", hdr.Name, k)
		}
	}
	switch hdr.Typeflag {
	case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink:
		return nil
	}
	return fmt.Errorf("entry %q: type %q has no place in an image archive", hdr.Name, hdr.Typeflag)
}

// Close closes the archive file.
func (x *archiveIndex) Close() error { return x.f.Close() }

// entry returns the regular entry named name.
func (x *archiveIndex) entry(name string) (archiveEntry, error) {
	name = filepath.ToSlash(filepath.Clean(filepath.FromSlash(name)))
	if x.links[name] {
		return archiveEntry{}, fmt.Errorf("entry %q: a link where a file is needed", name)
	}
	e, ok := x.entries[name]
	if !ok {
		return archiveEntry{}, fmt.Errorf("entry %q: not in the archive", name)
	}
	return e, nil
}

// open returns a reader of entry name's bytes, which must be exactly want
// bytes (a size a manifest declares), stopped once ctx ends.
func (x *archiveIndex) open(ctx context.Context, name string, want int64) (io.Reader, error) {
	e, err := x.entry(name)
	if err != nil {
		return nil, err
	}
	if e.size != want {
		return nil, fmt.Errorf("entry %q: %d bytes where %d are declared", e.name, e.size, want)
	}
	return ctxReader{ctx, io.NewSectionReader(x.f, e.offset, e.size)}, nil
}

// readSmall reads entry name whole, refusing one over limit bytes.
func (x *archiveIndex) readSmall(ctx context.Context, name string, limit int64) ([]byte, error) {
	e, err := x.entry(name)
	if err != nil {
		return nil, err
	}
	if e.size > limit {
		return nil, fmt.Errorf("entry %q: %d bytes, over the %d-byte limit", e.name, e.size, limit)
	}
	r, err := x.open(ctx, name, e.size)
	if err != nil {
		return nil, err
	}
	return io.ReadAll(r)
}

// ctxReader stops a read once ctx ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := context.Cause(c.ctx); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
