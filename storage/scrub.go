package storage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
)

// ScrubStats is what one pass of Scrub did.
type ScrubStats struct {
	Blobs   int   // blobs re-hashed
	Bytes   int64 // bytes read
	Damaged int   // blobs found damaged and quarantined
}

// Scrubber re-hashes the store's blobs in the background (see Scrub).
type Scrubber struct {
	store *Store
	rate  int64 // bytes a second

	read atomic.Int64 // bytes read by every pass so far
}

// NewScrubber returns a scrubber of s reading at most rate bytes a second.
func NewScrubber(s *Store, rate int64) *Scrubber {
	return &Scrubber{store: s, rate: max(rate, 1)}
}

// Read returns the bytes read by every pass so far.
func (sc *Scrubber) Read() int64 { return sc.read.Load() }

// scrubPiece is how much is read between two looks at the rate.
const scrubPiece = 1 << 20

// Scrub makes one pass over every committed blob: it re-hashes the file,
// at most the scrubber's rate of bytes a second, and quarantines those
// whose content no longer hashes to their digest, or whose size is not the
// one recorded (see quarantine). Reading at a low rate leaves the disk to
// serving, and the page cache too: pages read once stay on the kernel's
// inactive list, which it reclaims before the blobs being served. It
// returns when the pass is done or ctx is cancelled.
func (sc *Scrubber) Scrub(ctx context.Context) (ScrubStats, error) {
	var st ScrubStats
	s := sc.store
	buf := make([]byte, scrubPiece)
	start := time.Now()
	var budgetFrom int64 // bytes read in this pass when the rate was last met
	err := filepath.WalkDir(s.blobs, func(path string, e fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // removed meanwhile
			}
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !e.Type().IsRegular() {
			return nil
		}
		alg := filepath.Base(filepath.Dir(filepath.Dir(path)))
		d := digest.NewDigestFromEncoded(digest.Algorithm(alg), filepath.Base(path))
		if validate(d) != nil || s.blobPath(d) != path {
			return nil // not a blob file of ours
		}
		damaged, err := sc.check(d, buf, &st.Bytes, func() error {
			// Sleep as long as reading that fast needs to have taken.
			due := start.Add(time.Duration(float64(st.Bytes-budgetFrom) / float64(sc.rate) * float64(time.Second)))
			if wait := time.Until(due); wait > 0 {
				t := time.NewTimer(wait)
				defer t.Stop()
				select {
				case <-t.C:
				case <-ctx.Done():
					return ctx.Err()
				}
			} else if wait < -time.Second {
				// Behind by more than a second (a slow disk): no burst
				// to catch up.
				start, budgetFrom = time.Now(), st.Bytes
			}
			return nil
		})
		if err != nil {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return err
			}
			s.log.Warn("scrubbing a blob", "digest", d, "err", err)
			return nil
		}
		st.Blobs++
		if damaged {
			st.Damaged++
		}
		return nil
	})
	return st, err
}

// check re-hashes blob d and quarantines it when damaged. pace is called
// after every piece read.
func (sc *Scrubber) check(d digest.Digest, buf []byte, total *int64, pace func() error) (bool, error) {
	s := sc.store
	f, err := os.Open(s.blobPath(d))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil // evicted or quarantined meanwhile
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return false, err
	}
	fd := int(f.Fd())
	if err := s.checkSize(d, fd, fi.Size()); err != nil {
		return true, nil
	}
	h := d.Algorithm().Hash()
	for {
		n, err := f.Read(buf)
		h.Write(buf[:n])
		*total += int64(n)
		sc.read.Add(int64(n))
		if err == io.EOF {
			break
		}
		if err != nil {
			return false, fmt.Errorf("reading %s: %w", d, err)
		}
		if err := pace(); err != nil {
			return false, err
		}
	}
	if got := digest.NewDigest(d.Algorithm(), h); got != d {
		s.quarantine(d, fd, "its content hashes to "+got.String())
		return true, nil
	}
	return false, nil
}
