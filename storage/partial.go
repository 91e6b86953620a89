package storage

import (
	"context"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
)

// HoldBack is how many bytes at the end of a blob readers of a download are
// kept from until the digest is verified. A reader therefore never receives
// a complete-looking blob whose digest turned out wrong: on a mismatch it sees
// a short read it can retry, even if it never checks digests itself.
const HoldBack = 64 << 10

// Partial is a blob being downloaded: a file written at arbitrary offsets,
// the set of byte ranges written so far, and a running digest of the
// contiguous prefix. Any number of readers may wait on it for bytes while one
// or more writers fill it. It is safe for concurrent use.
type Partial struct {
	store  *Store
	digest digest.Digest
	path   string
	f      *os.File
	fi     os.FileInfo // f's identity, which Open checks

	mu        sync.Mutex
	size      int64 // -1 until known
	done      spans
	changed   chan struct{} // closed and replaced on a change, if watched
	watched   bool          // a waiter holds changed
	wanted    []int64       // offsets readers wait at, one entry per waiting reader
	committed string        // path of the verified blob, once committed
	err       error         // why the download failed, once it has
	discarded bool          // failed with bytes not to be trusted: none is handed out any more

	// The running hash is the writers' alone; readers never take hashMu,
	// and writers only try it: whoever holds it hashes for everyone.
	hashMu sync.Mutex
	hasher hash.Hash
	hashed atomic.Int64 // written under hashMu; read without it
	buf    []byte       // catch-up buffer for hashing bytes written out of order

	// Progress checkpoints (see checkpoint.go).
	unsaved       int64       // bytes written since the last checkpoint; under mu
	savedAt       time.Time   // time of the last checkpoint; under mu
	recorded      atomic.Bool // a progress record exists
	checkpointing atomic.Bool
	background    sync.WaitGroup // a checkpoint running; ended before the file is closed
}

// NewPartial starts a download of d, or resumes the one an earlier run left
// if it was recorded (see checkpoint.go). size is the expected size, or -1
// when it will be learned from upstream.
func (s *Store) NewPartial(ctx context.Context, d digest.Digest, size int64) (*Partial, error) {
	if err := validate(d); err != nil {
		return nil, err
	}
	if !d.Algorithm().Available() {
		return nil, fmt.Errorf("digest %s: algorithm %s is not supported", d, d.Algorithm())
	}
	if p, ok := s.resume(ctx, d, size); ok {
		return p, nil
	}
	// A new file, not the old one truncated: a reader still draining an
	// earlier download of d keeps the bytes that download vouched for.
	path := s.partialPath(d)
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("starting download of %s: %w", d, err)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return nil, fmt.Errorf("starting download of %s: %w", d, err)
	}
	p := newPartial(s, d, f)
	if size >= 0 {
		if err := p.SetSize(size); err != nil {
			f.Close()
			os.Remove(path)
			return nil, err
		}
	}
	return p, nil
}

func newPartial(s *Store, d digest.Digest, f *os.File) *Partial {
	fi, _ := f.Stat() // a nil FileInfo only makes Open find nothing
	return &Partial{
		fi:      fi,
		store:   s,
		digest:  d,
		path:    f.Name(),
		f:       f,
		size:    -1,
		changed: make(chan struct{}),
		hasher:  d.Algorithm().Hash(),
		savedAt: time.Now(),
	}
}

// Digest returns the digest the download must match.
func (p *Partial) Digest() digest.Digest { return p.digest }

// Size returns the blob's size, or -1 when not yet known.
func (p *Partial) Size() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.size
}

// SetSize fixes the blob's size. Setting the same size again is a no-op; a
// different one is ErrSizeMismatch.
func (p *Partial) SetSize(n int64) error {
	if n < 0 {
		return fmt.Errorf("%s: negative size %d", p.digest, n)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.size == n {
		return nil
	}
	if p.size >= 0 {
		return fmt.Errorf("%s is %d bytes, not %d: %w", p.digest, p.size, n, ErrSizeMismatch)
	}
	p.size = n
	p.notifyLocked()
	return nil
}

// WriteAt writes b at off and marks it done. Bytes already written are
// left as they are, whatever b holds there: the running hash has covered
// them, so the file must keep them (a stream restarted from byte 0, or
// another endpoint, cannot slip different bytes under a verified hash).
// Bytes beyond the blob's size are refused with ErrSizeMismatch. It returns
// len(b) when every byte is in the file.
func (p *Partial) WriteAt(b []byte, off int64) (int, error) {
	end := off + int64(len(b))
	var buf [4]span // gaps without an allocation, in the usual case of one
	p.mu.Lock()
	size := p.size
	gaps := p.done.gaps(buf[:0], off, end)
	p.mu.Unlock()
	if size >= 0 && end > size {
		return 0, fmt.Errorf("writing %s at %d-%d: past its %d bytes: %w", p.digest, off, end-1, size, ErrSizeMismatch)
	}
	for _, g := range gaps {
		if err := p.writeSpan(b[g.start-off:g.end-off], g.start); err != nil {
			return int(g.start - off), err
		}
	}
	return len(b), nil
}

// writeSpan writes b, none of which is written yet, at off.
func (p *Partial) writeSpan(b []byte, off int64) error {
	n, err := p.f.WriteAt(b, off)
	if n > 0 {
		// The bytes at the hash's frontier are hashed from b, sparing a read.
		if h := p.hashed.Load(); off <= h && h < off+int64(n) && p.hashMu.TryLock() {
			if h := p.hashed.Load(); off <= h && h < off+int64(n) {
				p.hasher.Write(b[h-off : n])
				p.hashed.Store(off + int64(n))
			}
			p.hashMu.Unlock()
		}

		p.mu.Lock()
		p.done.add(off, off+int64(n))
		p.notifyLocked()
		p.mu.Unlock()

		if err == nil {
			err = p.catchUpHash()
		}
		if err == nil {
			p.maybeCheckpoint(n)
		}
	}
	if err != nil {
		return fmt.Errorf("writing %s at %d: %w", p.digest, off, err)
	}
	return nil
}

// catchUpHash hashes bytes that were written ahead of the hashed prefix and
// have since become contiguous with it, reading them back from the file. A
// writer that finds another at it goes on: the other re-checks for new
// bytes after letting go, so none is left unhashed.
func (p *Partial) catchUpHash() error {
	for p.hashed.Load() < p.Written() {
		if !p.hashMu.TryLock() {
			return nil
		}
		err := p.hashToLocked(p.Written())
		p.hashMu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

// hashToLocked hashes the file from the hashed prefix up to prefix.
func (p *Partial) hashToLocked(prefix int64) error {
	for h := p.hashed.Load(); h < prefix; h = p.hashed.Load() {
		if p.buf == nil {
			p.buf = make([]byte, 256<<10)
		}
		n := min(int64(len(p.buf)), prefix-h)
		if _, err := p.f.ReadAt(p.buf[:n], h); err != nil {
			return fmt.Errorf("hashing %s at %d: %w", p.digest, h, err)
		}
		p.hasher.Write(p.buf[:n])
		p.hashed.Store(h + n)
	}
	return nil
}

// Missing returns the first range at or after off not yet written, as
// [start, end); start == end when nothing is missing or the size is unknown.
func (p *Partial) Missing(off int64) (start, end int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.size < 0 {
		return off, off
	}
	return p.done.gap(off, p.size)
}

// Wanted returns the offsets readers are waiting at, ascending, so that a
// fetcher can get those bytes first.
func (p *Partial) Wanted() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.wanted) == 0 {
		return nil
	}
	out := slices.Clone(p.wanted)
	slices.Sort(out)
	return slices.Compact(out)
}

// Written returns the length of the contiguous prefix written so far.
func (p *Partial) Written() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done.contiguous(0)
}

// Commit verifies the download (every byte written, digest matching) and
// moves it into the store. On failure the download is failed with the reason.
func (p *Partial) Commit(ctx context.Context) error {
	p.background.Wait()
	if err := p.verify(); err != nil {
		p.Fail(err)
		return err
	}
	if err := p.store.commitFile(p.f, p.digest); err != nil {
		p.Fail(err)
		return err
	}
	size := p.Size()
	final := p.store.blobPath(p.digest)
	p.mu.Lock()
	p.committed = final
	p.notifyLocked()
	p.mu.Unlock()
	p.dropRecord()
	// The blob is in place; a lost record only costs its last-access time.
	if err := p.store.recordBlob(ctx, p.digest, size); err != nil {
		p.store.log.Warn("recording committed blob", "digest", p.digest, "err", err)
	}
	return nil
}

func (p *Partial) verify() error {
	p.mu.Lock()
	size, prefix := p.size, p.done.contiguous(0)
	p.mu.Unlock()
	if size < 0 || prefix != size {
		return fmt.Errorf("committing %s: %d of %d bytes written: %w", p.digest, prefix, size, ErrSizeMismatch)
	}
	p.hashMu.Lock()
	err := p.hashToLocked(prefix)
	p.hashMu.Unlock()
	if err != nil {
		return err
	}
	// The running hash vouches for the bytes written, not for the file: check
	// that nothing else truncated or extended it.
	if fi, err := p.f.Stat(); err != nil {
		return fmt.Errorf("committing %s: %w", p.digest, err)
	} else if fi.Size() != size {
		return fmt.Errorf("committing %s: file holds %d bytes, not %d: %w", p.digest, fi.Size(), size, ErrSizeMismatch)
	}
	p.hashMu.Lock()
	got := digest.NewDigest(p.digest.Algorithm(), p.hasher)
	p.hashMu.Unlock()
	if got != p.digest {
		return fmt.Errorf("committing %s: the %d bytes received hash to %s: %w", p.digest, size, got, ErrDigestMismatch)
	}
	return nil
}

// Fail ends the download and discards its bytes: waiting readers get err,
// the partial file and its progress record are removed. Failing a committed
// or already ended download does nothing.
func (p *Partial) Fail(err error) {
	if !p.end(err) {
		return
	}
	p.background.Wait()
	p.mu.Lock()
	p.discarded = true
	p.mu.Unlock()
	p.f.Close()
	p.dropRecord()
	if rmErr := os.Remove(p.path); rmErr != nil && !errors.Is(rmErr, fs.ErrNotExist) {
		p.store.log.Warn("removing failed download", "path", p.path, "err", rmErr)
	}
}

// Abandon ends the download but keeps its bytes for the next one: waiting
// readers get err, and the progress is recorded so that a later NewPartial
// of the same digest resumes where this one stopped.
func (p *Partial) Abandon(err error) {
	if !p.end(err) {
		return
	}
	p.background.Wait()
	if err := p.checkpoint(); err != nil {
		p.store.log.Warn("recording download progress", "digest", p.digest, "err", err)
	}
	p.f.Close()
}

// end marks the download ended with err, and reports whether it was running.
func (p *Partial) end(err error) bool {
	if err == nil {
		err = errors.New("download abandoned")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.committed != "" || p.err != nil {
		return false
	}
	p.err = err
	p.notifyLocked()
	return true
}

// Err returns why the download failed, or nil.
func (p *Partial) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Committed reports whether the download was verified and stored.
func (p *Partial) Committed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.committed != ""
}

// WaitSize blocks until the blob's size is known and returns it, or returns
// the download's error or ctx's.
func (p *Partial) WaitSize(ctx context.Context) (int64, error) {
	for {
		p.mu.Lock()
		size, err, changed := p.size, p.err, p.watch()
		p.mu.Unlock()
		if size >= 0 {
			return size, nil
		}
		if err != nil {
			return 0, err
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// WaitAvailable blocks until bytes from off on may be read, and returns how
// many may be read from off. Until the digest is verified the last HoldBack
// bytes are withheld. It returns io.EOF for an offset at or past the end, the
// download's error if it fails first, or ctx's error.
func (p *Partial) WaitAvailable(ctx context.Context, off int64) (int64, error) {
	for {
		p.mu.Lock()
		n := p.availableLocked(off)
		size, err := p.size, p.err
		if n > 0 || err != nil || (size >= 0 && off >= size) {
			p.mu.Unlock()
			switch {
			case n > 0:
				return n, nil
			case err != nil:
				return 0, err
			}
			return 0, io.EOF
		}
		changed := p.watch()
		p.wanted = append(p.wanted, off)
		p.mu.Unlock()

		waitErr := p.wait(ctx, changed)

		p.mu.Lock()
		if i := slices.Index(p.wanted, off); i >= 0 {
			p.wanted = slices.Delete(p.wanted, i, i+1)
		}
		p.mu.Unlock()
		if waitErr != nil {
			return 0, waitErr
		}
	}
}

func (p *Partial) availableLocked(off int64) int64 {
	if p.size < 0 || off >= p.size || p.discarded {
		return 0
	}
	if p.committed != "" {
		return p.size - off
	}
	limit := p.size - HoldBack
	end := min(p.done.contiguous(off), limit)
	return max(end-off, 0)
}

// Open returns a read-only handle on the download's bytes, valid across the
// commit (which renames the file) and after it. The caller closes it.
func (p *Partial) Open() (*os.File, error) {
	// The rename is atomic, so the file is always at one of the two paths;
	// looking at the partial path first cannot miss a rename in between. A
	// file at either path that is not this download's (a later download of
	// the same digest) is not opened.
	for _, path := range []string{p.path, p.store.blobPath(p.digest)} {
		f, err := os.Open(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("opening download of %s: %w", p.digest, err)
		}
		if fi, err := f.Stat(); err == nil && os.SameFile(fi, p.fi) {
			return f, nil
		}
		f.Close()
	}
	if err := p.Err(); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("opening download of %s: %w", p.digest, ErrNotFound)
}

func (p *Partial) wait(ctx context.Context, changed <-chan struct{}) error {
	select {
	case <-changed:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// watch returns the channel the next change closes. Called with mu held.
func (p *Partial) watch() <-chan struct{} {
	p.watched = true
	return p.changed
}

// notifyLocked wakes the waiters. Writes with nobody waiting, the common
// case on the blob path, allocate nothing.
func (p *Partial) notifyLocked() {
	if !p.watched {
		return
	}
	close(p.changed)
	p.changed = make(chan struct{})
	p.watched = false
}
