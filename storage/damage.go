package storage

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"
)

// A blob file is correct when it is committed, but a disk, a file system
// or a person can change it afterwards: a flipped bit, a file cut short by
// a crash of the file system, an edit. Such a blob would be served forever
// under its digest, and the client that verifies it fails every pull. The
// store therefore checks what it can cheaply on every read:
//
//   - a blob's size, against the size recorded when it was committed (a
//     stat, which every open makes anyway, and a map look-up);
//   - a manifest's digest: manifests are read whole and small;
//
// and the scrubber (Scrub) re-hashes every blob in the background. A blob
// found damaged is moved to quarantine/ under the data dir, out of the way
// of readers, and reads then find it missing (ErrNotFound, with
// ErrDamaged), so that it is fetched again.

// ErrDamaged: a stored blob's file no longer holds what was committed. It
// comes with ErrNotFound: the blob has been quarantined and is to be
// fetched again.
var ErrDamaged = errors.New("damaged on disk")

// recordedSize returns the size d was committed with, and whether one is
// recorded (a blob committed before its record was written, or whose
// record was lost, has none). Sizes are kept in memory once read: this
// runs on every blob served.
func (s *Store) recordedSize(d digest.Digest) (int64, bool) {
	if v, ok := s.sizes.Load(d); ok {
		size := v.(int64)
		return size, size >= 0
	}
	var rec BlobRecord
	if err := s.get(blobKey(d), &rec); err != nil {
		if errors.Is(err, ErrNotFound) {
			// Remembered too, so that a blob without a record does not
			// cost a database read at every open. A size stored meanwhile
			// (a commit racing this read) wins over the absence.
			if v, loaded := s.sizes.LoadOrStore(d, int64(-1)); loaded && v.(int64) >= 0 {
				return v.(int64), true
			}
		}
		return 0, false
	}
	s.sizes.Store(d, rec.Size)
	return rec.Size, true
}

// checkSize reports a blob file of size bytes, whose descriptor fd was
// opened from the blob's path, as damaged when its size is not the one
// recorded: it quarantines the file and returns the error for the reader.
func (s *Store) checkSize(d digest.Digest, fd int, size int64) error {
	want, ok := s.recordedSize(d)
	if !ok || want == size {
		return nil
	}
	why := fmt.Sprintf("the file holds %d bytes, %d were committed", size, want)
	s.quarantine(d, fd, why)
	return fmt.Errorf("blob %s: %w: %w: %s", d, ErrNotFound, ErrDamaged, why)
}

// quarantine moves blob d's file into quarantine/, if it is still the file
// open as fd (-1: whichever is there; a fresh copy committed meanwhile is
// left alone), and says so in the log. The file is kept for whoever wants
// to look at what the disk did to it; quarantine/ may be emptied at will.
func (s *Store) quarantine(d digest.Digest, fd int, why string) {
	src := s.blobPath(d)
	if fd >= 0 {
		var open, there syscall.Stat_t
		if syscall.Fstat(fd, &open) != nil || syscall.Stat(src, &there) != nil ||
			open.Dev != there.Dev || open.Ino != there.Ino {
			return
		}
	}
	s.damaged.Add(1)
	dir := filepath.Join(s.root, "quarantine")
	dst := filepath.Join(dir, string(d.Algorithm())+"-"+d.Encoded()+"-"+strconv.FormatInt(time.Now().Unix(), 10))
	err := os.MkdirAll(dir, 0o755)
	if err == nil {
		s.fds.forget(d)
		err = os.Rename(src, dst)
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		// It cannot be moved: removing it keeps it from being served.
		if rerr := os.Remove(src); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			s.log.Error("a damaged blob could be neither quarantined nor removed: it stays in the store",
				"digest", d, "damage", why, "path", src, "err", err, "fix", "remove the file by hand; the blob is fetched again when asked for")
			return
		}
		dst = ""
	}
	s.log.Warn("stored blob damaged on disk: quarantined, to be fetched again when asked for",
		"digest", d, "damage", why, "quarantined_as", dst,
		"likely_cause", "disk or file-system damage, or something other than pullproxy writing to the data dir",
		"fix", "check the disk (dmesg, smartctl); files in quarantine/ may be removed")
}

// Damaged returns how many stored blobs were found damaged since Open.
func (s *Store) Damaged() int64 { return s.damaged.Load() }
