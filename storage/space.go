package storage

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	"github.com/opencontainers/go-digest"
)

// ErrNoSpace: the data dir's file system has not the room a download
// needs, counting what downloads in progress will still write.
var ErrNoSpace = errors.New("not enough free space in the data dir")

// ErrTooLarge: a blob's declared or advertised size is more than the store
// could ever hold, whatever it evicted. It comes with ErrNoSpace.
var ErrTooLarge = errors.New("larger than the store can hold")

// Before a download's bytes are written the store checks that they fit:
// an upstream that claims a blob of 50 GiB would otherwise fill the disk,
// and every download and metadata write after it would fail. A download
// whose size is known holds a reservation, the bytes it has yet to write,
// until it is committed, failed or abandoned; a new one is refused when the
// file system's free space, less those reservations and a margin for the
// metadata and manifests, cannot take it.

// spaceMargin is what the check keeps free besides reservations: a
// twentieth of the file system, at most 256 MiB.
func spaceMargin(total int64) int64 { return min(total/20, 256<<20) }

// CheckFits returns an error wrapping ErrTooLarge (and ErrNoSpace) when a
// blob of size bytes could never be stored, whatever was evicted: above
// max_size, above the share of the file system max_size allows, or above
// the file system less the margin kept free. A size is a claim (a
// manifest's, an upstream's, an archive's) until the bytes are verified:
// it is checked here before anything is evicted for it.
func (s *Store) CheckFits(d digest.Digest, size int64) error {
	if size < 0 {
		return nil
	}
	bound, what := s.sizeBound()
	if bound > 0 && size > bound {
		return fmt.Errorf("%s declares %d bytes (%s), more than %s (%s): %w: %w",
			d, size, humanSize(size), what, humanSize(bound), ErrTooLarge, ErrNoSpace)
	}
	return nil
}

// sizeBound returns the most bytes one blob could take in the store, and
// what sets that bound; 0 when nothing can tell.
func (s *Store) sizeBound() (int64, string) {
	_, total, err := s.space(s.root)
	if err != nil || total <= 0 {
		total = 0
	}
	bound, what := int64(0), ""
	if total > 0 {
		bound, what = total-spaceMargin(total), "the data dir's file system less the space kept free"
	}
	switch p := s.eviction; {
	case p.MaxBytes > 0 && (bound == 0 || p.MaxBytes < bound):
		bound, what = p.MaxBytes, "max_size"
	case p.MaxBytes == 0 && p.MaxPercent > 0 && total > 0:
		if b := int64(float64(total) * p.MaxPercent / 100); b < bound {
			bound, what = b, fmt.Sprintf("max_size (%g%% of the data dir's file system)", p.MaxPercent)
		}
	}
	return bound, what
}

// humanSize renders n bytes for an error message: 1.5 GiB.
func humanSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// reserve checks that p's remaining bytes, size in all, fit, and if so
// counts p among the downloads holding a reservation. The size is a claim
// until the bytes are verified, so nothing is evicted for a blob that could
// never fit (CheckFits), nor for one that the store's bound could not take
// with all it may evict gone; and up front only what the file system needs
// to take the bytes. The store is brought back within its bound when the
// blob is committed (evictAfterCommit): a claim whose bytes then fail
// verification has cost no cached blob.
func (s *Store) reserve(p *Partial, size int64) error {
	if err := s.CheckFits(p.digest, size); err != nil {
		return fmt.Errorf("downloading %w", err)
	}
	// Not the caller's context: an eviction round is short, and what it
	// frees serves every download.
	ctx := context.Background()
	if err := s.boundAllows(ctx, p.digest, size-p.Written()); err != nil {
		return err
	}
	shortfall, err := s.tryReserve(p, size)
	if err == nil || shortfall <= 0 {
		return err
	}
	if !s.evictAtLeast(ctx, shortfall, p.digest, "making room on the file system for a download") {
		return err
	}
	_, err = s.tryReserve(p, size)
	return err
}

// tryReserve is one attempt of reserve. On failure it also returns how
// many bytes the file system lacks for p (0: evicting cannot help).
func (s *Store) tryReserve(p *Partial, size int64) (int64, error) {
	need := size - p.Written()
	free, total, err := s.space(s.root)
	if err != nil {
		return 0, nil // nothing to tell by: the writes will say
	}
	s.spaceMu.Lock()
	defer s.spaceMu.Unlock()
	promised := s.promisedLocked(p)
	if margin := spaceMargin(total); need+promised+margin > free {
		return need + promised + margin - free, fmt.Errorf("downloading %s needs %d bytes: %d are free on the data dir's file system, "+
			"%d promised to downloads in progress, %d kept free: %w", p.digest, need, free, promised, margin, ErrNoSpace)
	}
	s.reserved[p] = struct{}{}
	return 0, nil
}

// promised returns the bytes downloads in progress, but for except, have
// yet to write.
func (s *Store) promised(except *Partial) int64 {
	s.spaceMu.Lock()
	defer s.spaceMu.Unlock()
	return s.promisedLocked(except)
}

func (s *Store) promisedLocked(except *Partial) int64 {
	var n int64
	for q := range s.reserved {
		if q != except {
			n += max(0, q.Size()-q.Written())
		}
	}
	return n
}

// unreserve ends p's reservation, if it holds one.
func (s *Store) unreserve(p *Partial) {
	s.spaceMu.Lock()
	delete(s.reserved, p)
	s.spaceMu.Unlock()
}

// diskSpace returns the free (to unprivileged users) and total bytes of
// the file system holding path.
func diskSpace(path string) (free, total int64, err error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return 0, 0, err
	}
	return int64(st.Bavail) * int64(st.Bsize), int64(st.Blocks) * int64(st.Bsize), nil
}
