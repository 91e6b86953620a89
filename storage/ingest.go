package storage

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/opencontainers/go-digest"
)

// Ingest stores blob d of size bytes read from r, verified against both
// before it is committed (ErrSizeMismatch, ErrDigestMismatch otherwise, and
// nothing is kept). It reports whether the blob was added: false when the
// store held it already. Sizes are claims: a size no eviction could make
// room for is refused (ErrTooLarge) before anything is evicted or written,
// and a blob the store holds is not taken as brought on the caller's word:
// r is read and verified all the same, and a size other than the one held
// is refused. It writes a file of its own and renames it into place, so
// that a download of the same blob in a running server is left alone: both
// hold the same bytes.
func (s *Store) Ingest(ctx context.Context, d digest.Digest, size int64, r io.Reader) (bool, error) {
	if err := validate(d); err != nil {
		return false, err
	}
	if !d.Algorithm().Available() {
		return false, fmt.Errorf("blob %s: algorithm %s is not supported", d, d.Algorithm())
	}
	if size < 0 {
		return false, fmt.Errorf("ingesting %s: no size: %w", d, ErrSizeMismatch)
	}
	if err := s.CheckFits(d, size); err != nil {
		return false, fmt.Errorf("ingesting %w", err)
	}
	if held, err := s.StatBlob(ctx, d); err == nil {
		return false, s.ingestHeld(ctx, d, size, held, r)
	}
	if !s.makeRoom(ctx, size) {
		return false, fmt.Errorf("ingesting %s of %d bytes: the store cannot make room for it within its bound "+
			"(what is left is open, pinned or manifests): %w", d, size, ErrNoSpace)
	}
	f, err := os.CreateTemp(filepath.Join(s.root, "partial"), "ingest-*")
	if err != nil {
		return false, fmt.Errorf("ingesting %s: %w", d, pathless(err))
	}
	defer os.Remove(f.Name()) // a no-op once renamed
	if err := copyVerified(ctx, f, d, size, r); err != nil {
		f.Close()
		return false, err
	}
	if err := s.commitFile(f, d, size); err != nil {
		return false, err
	}
	if err := s.recordBlob(ctx, d, size); err != nil {
		return true, err
	}
	return true, nil
}

// ingestHeld checks a blob the store holds, of held bytes, against what a
// caller brings: the claimed size first, then r's bytes, read and hashed.
func (s *Store) ingestHeld(ctx context.Context, d digest.Digest, size, held int64, r io.Reader) error {
	if size != held {
		return fmt.Errorf("ingesting %s: %d bytes are declared, and the store holds it verified with %d: %w",
			d, size, held, ErrSizeMismatch)
	}
	if err := copyVerified(ctx, io.Discard, d, size, r); err != nil {
		return err
	}
	// Used again now: an import that brings it is not to see it evicted
	// as the least recently used.
	if err := s.Touch(ctx, d); err != nil {
		s.log.Warn("recording a blob's use", "digest", d, "err", err)
	}
	return nil
}

// copyVerified copies size bytes of r to w, and fails unless r holds
// exactly size bytes hashing to d. Once ctx ends, it stops.
func copyVerified(ctx context.Context, w io.Writer, d digest.Digest, size int64, r io.Reader) error {
	h := d.Algorithm().Hash()
	n, err := io.Copy(io.MultiWriter(w, h), io.LimitReader(ctx2reader{ctx, r}, size+1))
	if err != nil {
		return fmt.Errorf("ingesting %s: after %d bytes: %w", d, n, err)
	}
	if n != size {
		return fmt.Errorf("ingesting %s: %d bytes where %d were declared: %w", d, n, size, ErrSizeMismatch)
	}
	if got := digest.NewDigest(d.Algorithm(), h); got != d {
		return fmt.Errorf("ingesting %s: its bytes hash to %s: %w", d, got, ErrDigestMismatch)
	}
	return nil
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

// An IngestBatch is a set of ingests taken back whole unless it is kept:
// an import. Each blob it adds is written to its journal (under ingests/ in
// the data dir) before the blob is committed, so that a batch a crash or a
// kill interrupted is taken back when the store opens next.
type IngestBatch struct {
	s       *Store
	journal *os.File
	added   []digest.Digest
}

// BeginIngest starts a batch.
func (s *Store) BeginIngest() (*IngestBatch, error) {
	dir := filepath.Join(s.root, "ingests")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("starting an ingest: %w", err)
	}
	f, err := os.CreateTemp(dir, "batch-*")
	if err != nil {
		return nil, fmt.Errorf("starting an ingest: %w", pathless(err))
	}
	return &IngestBatch{s: s, journal: f}, nil
}

// Added returns the blobs the batch added so far.
func (b *IngestBatch) Added() []digest.Digest { return b.added }

// Ingest is Store.Ingest, the blob taken back with the batch.
func (b *IngestBatch) Ingest(ctx context.Context, d digest.Digest, size int64, r io.Reader) (bool, error) {
	if _, err := b.s.StatBlob(ctx, d); err != nil {
		if err := b.note(d); err != nil {
			return false, err
		}
	}
	added, err := b.s.Ingest(ctx, d, size, r)
	if added {
		b.added = append(b.added, d)
	}
	return added, err
}

// Put is Store.PutBlob for a small blob (a manifest), taken back with the
// batch. It reports whether the blob was added.
func (b *IngestBatch) Put(ctx context.Context, d digest.Digest, raw []byte) (bool, error) {
	if _, err := b.s.StatBlob(ctx, d); err == nil {
		return false, nil
	}
	if err := b.note(d); err != nil {
		return false, err
	}
	if err := b.s.PutBlob(ctx, d, raw); err != nil {
		return false, err
	}
	b.added = append(b.added, d)
	return true, nil
}

// note journals d before it is committed.
func (b *IngestBatch) note(d digest.Digest) error {
	if _, err := b.journal.WriteString(d.String() + "\n"); err != nil {
		return fmt.Errorf("journaling an ingest: %w", pathless(err))
	}
	if err := b.journal.Sync(); err != nil {
		return fmt.Errorf("journaling an ingest: %w", pathless(err))
	}
	return nil
}

// Keep ends the batch keeping what it added.
func (b *IngestBatch) Keep() error {
	b.journal.Close()
	if err := os.Remove(b.journal.Name()); err != nil {
		return fmt.Errorf("ending an ingest: %w", pathless(err))
	}
	return nil
}

// Abandon ends the batch removing every blob it added. It runs to its end
// whatever ctx says: a cancelled import is to leave nothing behind.
func (b *IngestBatch) Abandon(ctx context.Context) error {
	b.journal.Close()
	ctx = context.WithoutCancel(ctx)
	if err := b.s.RemoveBlobs(ctx, b.added); err != nil {
		return fmt.Errorf("taking back %d blobs an ingest added: %w", len(b.added), err)
	}
	b.added = nil
	if err := os.Remove(b.journal.Name()); err != nil {
		return fmt.Errorf("ending an ingest: %w", pathless(err))
	}
	return nil
}

// abandonIngests takes back the batches an earlier run left unfinished.
func (s *Store) abandonIngests(ctx context.Context) error {
	journals, _ := filepath.Glob(filepath.Join(s.root, "ingests", "batch-*"))
	for _, j := range journals {
		ds, err := readJournal(j)
		if err != nil {
			return err
		}
		if err := s.RemoveBlobs(ctx, ds); err != nil {
			return fmt.Errorf("taking back an unfinished import: %w", err)
		}
		if err := os.Remove(j); err != nil {
			return fmt.Errorf("taking back an unfinished import: %w", pathless(err))
		}
		s.log.Info("took back what an unfinished import added", "blobs", len(ds))
	}
	return nil
}

func readJournal(path string) ([]digest.Digest, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading an import's journal: %w", pathless(err))
	}
	defer f.Close()
	var ds []digest.Digest
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// A line cut short by a crash does not parse: it was not committed.
		if d, err := digest.Parse(strings.TrimSpace(sc.Text())); err == nil {
			ds = append(ds, d)
		}
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("reading an import's journal: %w", err)
	}
	return ds, nil
}
