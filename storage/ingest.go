package storage

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
)

// Ingest stores blob d of size bytes read from r, verified against both
// before it is committed (ErrSizeMismatch, ErrDigestMismatch otherwise, and
// nothing is kept). It reports whether the blob was added: false when the
// store held it already (r is then not read). It writes a file of its own
// and renames it into place, so that a download of the same blob in a
// running server is left alone: both hold the same bytes.
func (s *Store) Ingest(ctx context.Context, d digest.Digest, size int64, r io.Reader) (bool, error) {
	if err := validate(d); err != nil {
		return false, err
	}
	if !d.Algorithm().Available() {
		return false, fmt.Errorf("blob %s: algorithm %s is not supported", d, d.Algorithm())
	}
	if _, err := s.StatBlob(ctx, d); err == nil {
		// Used again now: an import that brings it is not to see it
		// evicted as the least recently used.
		if err := s.Touch(ctx, d); err != nil {
			s.log.Warn("recording a blob's use", "digest", d, "err", err)
		}
		return false, nil
	}
	if size < 0 {
		return false, fmt.Errorf("ingesting %s: no size: %w", d, ErrSizeMismatch)
	}
	if s.overBound(size) > 0 && !s.makeRoom(ctx, size) && s.eviction.MaxBytes > 0 {
		return false, fmt.Errorf("ingesting %s of %d bytes: the store is at its max_size %d, and what is left is open or pinned: %w",
			d, size, s.eviction.MaxBytes, ErrNoSpace)
	}
	f, err := os.CreateTemp(filepath.Join(s.root, "partial"), "ingest-*")
	if err != nil {
		return false, fmt.Errorf("ingesting %s: %w", d, pathless(err))
	}
	defer os.Remove(f.Name()) // a no-op once renamed
	h := d.Algorithm().Hash()
	n, err := io.Copy(io.MultiWriter(f, h), io.LimitReader(ctx2reader{ctx, r}, size+1))
	if err != nil {
		f.Close()
		return false, fmt.Errorf("ingesting %s: after %d bytes: %w", d, n, err)
	}
	if n != size {
		f.Close()
		return false, fmt.Errorf("ingesting %s: %d bytes where %d were declared: %w", d, n, size, ErrSizeMismatch)
	}
	if got := digest.NewDigest(d.Algorithm(), h); got != d {
		f.Close()
		return false, fmt.Errorf("ingesting %s: its bytes hash to %s: %w", d, got, ErrDigestMismatch)
	}
	if err := s.commitFile(f, d, size); err != nil {
		return false, err
	}
	if err := s.recordBlob(ctx, d, size); err != nil {
		return true, err
	}
	return true, nil
}

// ctx2reader stops a copy once ctx ends.
type ctx2reader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctx2reader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
