package storage

import (
	"errors"
	"fmt"
	"syscall"
)

// ErrNoSpace: the data dir's file system has not the room a download
// needs, counting what downloads in progress will still write.
var ErrNoSpace = errors.New("not enough free space in the data dir")

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

// reserve checks that p's remaining bytes, size in all, fit, and if so
// counts p among the downloads holding a reservation.
func (s *Store) reserve(p *Partial, size int64) error {
	free, total, err := s.space(s.root)
	if err != nil {
		return nil // nothing to tell by: the writes will say
	}
	need := size - p.Written()
	s.spaceMu.Lock()
	defer s.spaceMu.Unlock()
	var promised int64
	for q := range s.reserved {
		if q != p {
			promised += max(0, q.Size()-q.Written())
		}
	}
	if margin := spaceMargin(total); need+promised+margin > free {
		return fmt.Errorf("downloading %s needs %d bytes: %d are free on the data dir's file system, "+
			"%d promised to downloads in progress, %d kept free: %w", p.digest, need, free, promised, margin, ErrNoSpace)
	}
	s.reserved[p] = struct{}{}
	return nil
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
