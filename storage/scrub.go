package storage

import (
	"context"
	"errors"
	"io"
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

// Scrub makes one pass over every committed blob, re-hashing it (see
// Store.verifyBlob) at most at the scrubber's rate of bytes a second: a
// blob whose content no longer hashes to its digest is quarantined, and a
// record that disagrees with a verified file is corrected. Reading at a
// low rate leaves the disk to serving, and the page cache too: pages read
// once stay on the kernel's inactive list, which it reclaims before the
// blobs being served. It returns when the pass is done or ctx is
// cancelled.
func (sc *Scrubber) Scrub(ctx context.Context) (ScrubStats, error) {
	var st ScrubStats
	s := sc.store
	pace := &pacer{ctx: ctx, rate: float64(sc.rate), start: time.Now(), read: &sc.read}
	err := s.walkBlobs(func(d digest.Digest, path string) error {
		before := pace.n
		p, err := s.verifyBlob(ctx, d, path, pace.reader, true)
		st.Bytes += pace.n - before
		if err != nil {
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				return err
			}
			s.log.Warn("scrubbing a blob", "digest", d, "err", err)
			return nil
		}
		st.Blobs++
		if p != nil && p.Kind == ProblemDamaged {
			st.Damaged++
		}
		return nil
	}, nil)
	return st, err
}

// pacer reads at most rate bytes a second, counted from start, over the
// readers it makes, until ctx ends.
type pacer struct {
	ctx   context.Context
	rate  float64
	start time.Time
	n     int64         // bytes read
	from  int64         // n when start was last set
	read  *atomic.Int64 // also counts the bytes read
}

func (p *pacer) reader(r io.Reader) io.Reader { return &pacedReader{p: p, r: r} }

type pacedReader struct {
	p *pacer
	r io.Reader
}

func (pr *pacedReader) Read(b []byte) (int, error) {
	p := pr.p
	// Sleep as long as reading that fast needs to have taken.
	due := p.start.Add(time.Duration(float64(p.n-p.from) / p.rate * float64(time.Second)))
	if wait := time.Until(due); wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-p.ctx.Done():
			t.Stop()
			return 0, p.ctx.Err()
		}
	} else if wait < -time.Second {
		// Behind by more than a second (a slow disk): no burst to catch up.
		p.start, p.from = time.Now(), p.n
	}
	if err := p.ctx.Err(); err != nil {
		return 0, err
	}
	n, err := pr.r.Read(b[:min(len(b), 1<<20)])
	p.n += int64(n)
	p.read.Add(int64(n))
	return n, err
}
