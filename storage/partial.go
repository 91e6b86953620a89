package storage

import (
	"bytes"
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

	"github.com/pullproxy/pullproxy/internal/spans"
	"github.com/pullproxy/pullproxy/storage/content"
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
	size      int64         // -1 until known
	done      spans.Set     // in the file; never written again
	writing   spans.Set     // claimed by a WriteAt under way, not yet done
	started   bool          // a WriteAt of this Partial has put or found its bytes in the file
	changed   chan struct{} // closed and replaced on a change, if watched
	watched   bool          // a waiter holds changed
	wanted    []int64       // offsets readers wait at, one entry per waiting reader
	verified  bool          // every byte is in and the digest matched: the held-back end may be read
	committed string        // path of the verified blob, once committed
	err       error         // why the download failed, once it has
	discarded bool          // failed with bytes not to be trusted: none is handed out any more

	// The running hash is the writers' alone; readers never take hashMu,
	// and writers only try it: whoever holds it hashes for everyone. It
	// covers only bytes already in done (hashed <= done's contiguous prefix),
	// and hashMu is taken before mu, never after.
	hashMu sync.Mutex
	hasher hash.Hash
	hashed atomic.Int64 // written under hashMu; read without it
	buf    []byte       // catch-up buffer for hashing bytes written out of order (see hashFile)

	// A resumed download's hash of [0, resumedHashed) comes from the record,
	// not from the file; Commit checks the file still holds those bytes.
	resumedHashed int64
	resumedSum    []byte // the recorded hash state's sum over that prefix

	// Progress checkpoints (see checkpoint.go).
	checkpointBytes int64       // bytes written between checkpoints, at most: checkpointBytes but in tests
	durableBytes    int64       // bytes written between durable checkpoints, at most: durableBytes but in tests
	unsaved         int64       // bytes written since the last checkpoint; under mu
	savedAt         time.Time   // time of the last checkpoint; under mu
	unsynced        int64       // bytes written since the last durable checkpoint; under mu
	syncedAt        time.Time   // time of the last durable checkpoint; under mu
	seq             uint64      // number of the last checkpoint; under mu
	attr            atomic.Bool // the file has a progress attribute
	recorded        atomic.Bool // a progress record exists
	checkpointing   atomic.Bool
	background      sync.WaitGroup // a checkpoint running; ended before the file is closed
}

// A download is one thing to the code around it: the fetchers write
// through content.Writer, the requests serving it read through
// content.Reader.
var _ content.Download = (*Partial)(nil)

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
		if err := s.reserve(p, p.size); err != nil {
			p.f.Close() // its bytes and progress stay for a later attempt
			return nil, err
		}
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

		checkpointBytes: checkpointBytes,
		durableBytes:    durableBytes,
		syncedAt:        time.Now(),
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
	if size := p.Size(); size == n {
		return nil
	} else if size >= 0 {
		return fmt.Errorf("%s is %d bytes, not %d: %w", p.digest, size, n, ErrSizeMismatch)
	}
	// Checked before the size is known to readers, and outside p's lock:
	// reserve reads every download's progress.
	if err := p.store.reserve(p, n); err != nil {
		return err
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

// WriteAt writes b at off and marks it done. No byte of the file is
// written twice: bytes already written, or being written by a concurrent
// call, are left to that write, whatever b holds there. The running hash
// covers the bytes in the file, so the file must keep them (a stream
// restarted from byte 0, or another endpoint, cannot slip different bytes
// under a verified hash). Bytes beyond the blob's size are refused with
// ErrSizeMismatch.
//
// It returns len(b) when every byte of b is in the file or claimed by
// another call; if that call fails, its bytes are missing again (see
// Missing). On an error it returns how many bytes from the start of b were
// dealt with that way.
func (p *Partial) WriteAt(b []byte, off int64) (int, error) {
	end := off + int64(len(b))
	var buf [4]spans.Span // gaps without an allocation, in the usual case of one
	p.mu.Lock()
	size := p.size
	if size >= 0 && end > size {
		p.mu.Unlock()
		return 0, fmt.Errorf("writing %s at %d-%d: past its %d bytes: %w", p.digest, off, end-1, size, ErrSizeMismatch)
	}
	gaps := p.claimLocked(buf[:0], off, end)
	p.mu.Unlock()
	for i, g := range gaps {
		n, err := p.writeSpan(b[g.Start-off:g.End-off], g.Start)
		if err != nil {
			p.release(gaps[i+1:])
			return int(g.Start-off) + n, err
		}
	}
	return len(b), nil
}

// claimLocked appends to dst the parts of [start, end) neither done nor
// being written, and marks them as being written by the caller. Called with
// mu held.
func (p *Partial) claimLocked(dst []spans.Span, start, end int64) []spans.Span {
	from := len(dst)
	for off := start; off < end; {
		a, z := p.done.Gap(off, end)
		if a >= z {
			break
		}
		dst = p.writing.Gaps(dst, a, z)
		off = z
	}
	for _, g := range dst[from:] {
		p.writing.Add(g.Start, g.End)
	}
	if len(dst) == from && start < end && !p.started {
		// Nothing to write: if it is all in the file already (a resumed
		// download's upstream sending bytes it has), the upstream answered.
		if a, z := p.done.Gap(start, end); a >= z {
			p.started = true
			p.notifyLocked()
		}
	}
	return dst
}

// release gives up claims on spans that were not written, so they are
// missing again.
func (p *Partial) release(gaps []spans.Span) {
	if len(gaps) == 0 {
		return
	}
	p.mu.Lock()
	for _, g := range gaps {
		p.writing.Remove(g.Start, g.End)
	}
	p.mu.Unlock()
}

// writeSpan writes b, a span the caller claimed, at off. It marks the bytes
// written done before hashing them, so the hash never covers bytes a
// checkpoint does not record, and releases the claim on the rest. It returns
// how many bytes it wrote.
func (p *Partial) writeSpan(b []byte, off int64) (int, error) {
	n, err := p.f.WriteAt(b, off)
	p.mu.Lock()
	p.writing.Remove(off, off+int64(len(b)))
	if n > 0 {
		p.done.Add(off, off+int64(n))
		if !p.started || p.feedsWaiterLocked(off) {
			p.notifyLocked()
		}
		p.started = true
	}
	p.mu.Unlock()
	if n > 0 {
		p.hashWritten(b[:n], off)
		if err == nil {
			err = p.catchUpHash()
		}
		if err == nil {
			p.maybeCheckpoint(n)
		}
	}
	if err != nil {
		return n, fmt.Errorf("writing %s at %d: %w", p.digest, off, err)
	}
	return n, nil
}

// hashWritten hashes b, just written at off and marked done, if it extends
// the hashed prefix: the bytes are in hand, sparing a read.
func (p *Partial) hashWritten(b []byte, off int64) {
	end := off + int64(len(b))
	if h := p.hashed.Load(); off <= h && h < end && p.hashMu.TryLock() {
		if h := p.hashed.Load(); off <= h && h < end {
			p.hasher.Write(b[h-off:])
			p.hashed.Store(end)
		}
		p.hashMu.Unlock()
	}
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

// hashToLocked hashes the file from the hashed prefix up to prefix, a
// window at a time, so that the prefix others see advances as it goes.
func (p *Partial) hashToLocked(prefix int64) error {
	for h := p.hashed.Load(); h < prefix; h = p.hashed.Load() {
		n := min(hashWindow, prefix-h)
		if err := hashFile(p.hasher, p.f, h, n, &p.buf); err != nil {
			return fmt.Errorf("hashing %s at %d: %w", p.digest, h, err)
		}
		p.hashed.Store(h + n)
	}
	return nil
}

// hashWindow is the most hashToLocked hashes before it moves the prefix.
const hashWindow = 4 << 20

// Missing returns the first range at or after off not yet written, as
// [start, end); start == end when nothing is missing or the size is unknown.
// Bytes a WriteAt is writing count as missing until they are done.
func (p *Partial) Missing(off int64) (start, end int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.size < 0 {
		return off, off
	}
	return p.done.Gap(off, p.size)
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
	return p.done.Contiguous(0)
}

// Commit verifies the download (every byte written, digest matching) and
// moves it into the store. On failure the download is failed with the reason.
//
// Readers waiting for the held-back end get it as soon as the digest
// matches: the sync and rename that put the blob in place (the sync of a
// large blob takes a while, and would be the last wait of a pull) go on
// while they read, from the page cache the digest was computed over. A
// checkpoint still running in the background (a sync and a database
// write, tens of milliseconds on a busy disk) is waited for only after
// that, before the file is closed and the progress record dropped.
func (p *Partial) Commit(ctx context.Context) error {
	if p.unhashed() > hashWindow {
		// Every byte is in: record that before hashing the rest and syncing
		// the whole file, which take a while, so that a crash meanwhile
		// costs nothing of the download.
		p.background.Wait()
		if p.unsavedBytes() > 0 {
			if err := p.checkpoint(false); err != nil {
				p.store.log.Warn("recording download progress", "digest", p.digest, "err", err)
			}
		}
	}
	if err := p.verify(); err != nil {
		p.Fail(err)
		return err
	}
	p.mu.Lock()
	p.verified = true
	p.notifyLocked()
	p.mu.Unlock()
	size := p.Size()
	if err := p.store.placeFile(p.f, p.digest, size); err != nil {
		p.Fail(err)
		return err
	}
	final := p.store.blobPath(p.digest)
	p.mu.Lock()
	p.committed = final
	p.notifyLocked() // WaitStarted's waiters on a download resumed whole
	p.mu.Unlock()
	p.store.unreserve(p)
	p.background.Wait() // a checkpoint under way sees the commit and records nothing more
	if p.attr.Load() {
		clearProgress(p.f) // best effort: left on the blob, it is never read
	}
	p.f.Close()
	p.dropRecord()
	// The blob is in place; a lost record only costs its last-access time.
	if err := p.store.recordBlob(ctx, p.digest, size); err != nil {
		p.store.log.Warn("recording committed blob", "digest", p.digest, "err", err)
	}
	return nil
}

// unhashed returns how many bytes of the written prefix the running hash
// has yet to cover.
func (p *Partial) unhashed() int64 {
	return p.Written() - p.hashed.Load()
}

// Verify checks, without committing, that every byte is in and that they
// hash to the digest. A mismatch leaves the download as it is, for its
// owner to Retract the bytes it suspects, or Fail it; Commit verifies
// again, at no cost beyond a stat when nothing changed.
func (p *Partial) Verify() error { return p.verify() }

func (p *Partial) verify() error {
	p.mu.Lock()
	size, prefix := p.size, p.done.Contiguous(0)
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
	if err := p.checkResumedPrefix(); err != nil {
		return err
	}
	p.hashMu.Lock()
	got := digest.NewDigest(p.digest.Algorithm(), p.hasher)
	p.hashMu.Unlock()
	if got != p.digest {
		return fmt.Errorf("committing %s: the %d bytes received hash to %s: %w", p.digest, size, got, ErrDigestMismatch)
	}
	return nil
}

// checkResumedPrefix re-reads the prefix a resumed download's hash took from
// its record: that state vouches for the bytes written before the restart,
// not for what the file holds now (an edit, a bad sector while the server was
// down). Only that prefix is read: every byte after it was hashed in this run
// as written, or read back from the file, so the digest check covers it, and
// a download that never resumed reads nothing.
func (p *Partial) checkResumedPrefix() error {
	if p.resumedHashed == 0 {
		return nil
	}
	h := p.digest.Algorithm().Hash()
	r := io.NewSectionReader(p.f, 0, p.resumedHashed)
	n, err := io.CopyBuffer(h, r, make([]byte, 256<<10))
	if err != nil {
		return fmt.Errorf("committing %s: re-reading the resumed prefix: %w", p.digest, err)
	}
	if n != p.resumedHashed || !bytes.Equal(h.Sum(nil), p.resumedSum) {
		return fmt.Errorf("committing %s: bytes 0-%d changed on disk since they were hashed before the restart (%d bytes read back): %w: %w",
			p.digest, p.resumedHashed-1, n, ErrDigestMismatch, ErrChangedOnDisk)
	}
	p.resumedHashed = 0 // checked: Commit after Verify reads it no more
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
	p.discard()
}

// discard removes an ended download's bytes and progress: none is handed
// out any more.
func (p *Partial) discard() {
	p.mu.Lock()
	p.discarded = true
	p.mu.Unlock()
	p.f.Close()
	p.dropRecord()
	if rmErr := os.Remove(p.path); rmErr != nil && !errors.Is(rmErr, fs.ErrNotExist) {
		p.store.log.Warn("removing failed download", "path", p.path, "err", rmErr)
	}
}

// Retract ends the download as Abandon does, but without the bytes in drop:
// they failed verification, or may have (the digest did not match, and
// they came from the endpoint suspected). Waiting readers get cause, since
// they may hold bytes from drop. The next NewPartial of the digest resumes
// from the rest and fetches drop again; its hash starts over, as the
// running hash covers bytes dropped, and Commit hashes the file anew. When
// the progress cannot be recorded the download is failed instead, and the
// error says why.
func (p *Partial) Retract(drop []spans.Span, cause error) error {
	if !p.end(cause) {
		return fmt.Errorf("retracting bytes of %s: the download has ended", p.digest)
	}
	p.background.Wait()
	p.hashMu.Lock()
	p.mu.Lock()
	for _, s := range drop {
		p.done.Remove(s.Start, s.End)
	}
	p.hasher = p.digest.Algorithm().Hash()
	p.hashed.Store(0)
	p.resumedHashed, p.resumedSum = 0, nil
	p.mu.Unlock()
	p.hashMu.Unlock()
	if err := p.checkpoint(true); err != nil {
		p.discard()
		return fmt.Errorf("retracting bytes of %s: recording what is kept: %w", p.digest, err)
	}
	p.f.Close()
	return nil
}

// Abandon ends the download but keeps its bytes for the next one: waiting
// readers get err, and the progress is recorded so that a later NewPartial
// of the same digest resumes where this one stopped.
func (p *Partial) Abandon(err error) {
	if !p.end(err) {
		return
	}
	p.background.Wait()
	if err := p.checkpoint(true); err != nil {
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
	if p.committed != "" || p.err != nil {
		p.mu.Unlock()
		return false
	}
	p.err = err
	p.notifyLocked()
	p.mu.Unlock()
	p.store.unreserve(p) // not under p.mu: reserve takes the two the other way round
	return true
}

// Err returns why the download failed, or nil.
func (p *Partial) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Verified reports whether every byte is in and the digest matched: the
// download is committing, or committed.
func (p *Partial) Verified() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.verified
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

// WaitStarted blocks until this download has written its first byte (the
// upstream accepted the request and is sending), or was committed, and
// returns the blob's size. It returns the download's error if it fails
// first, or ctx's error.
//
// The first byte is one a WriteAt of this Partial put in the file, or a
// WriteAt whose bytes were all in it already; bytes a resume found on disk
// do not count. When the size is not known yet, it waits for that too.
func (p *Partial) WaitStarted(ctx context.Context) (int64, error) {
	for {
		p.mu.Lock()
		size, err := p.size, p.err
		if size >= 0 && (p.started || p.committed != "") {
			p.mu.Unlock()
			return size, nil
		}
		if err != nil {
			p.mu.Unlock()
			return 0, err
		}
		changed := p.watch()
		p.mu.Unlock()
		if err := p.wait(ctx, changed); err != nil {
			return 0, err
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

// feedsWaiterLocked reports whether bytes just marked done at off make
// bytes available to a reader waiting in WaitAvailable. Other writes leave
// every waiter where it was (a waiter's bytes are the written run starting at
// its offset), so they wake nobody: with several chunks written at once, most
// writes land ahead of where readers wait. Called with mu held.
func (p *Partial) feedsWaiterLocked(off int64) bool {
	if len(p.wanted) == 0 || p.size < 0 {
		return false
	}
	start, end := p.done.Covering(off)
	end = min(end, p.size-HoldBack)
	for _, w := range p.wanted {
		if start <= w && w < end {
			return true
		}
	}
	return false
}

func (p *Partial) availableLocked(off int64) int64 {
	if p.size < 0 || off >= p.size || p.discarded {
		return 0
	}
	if p.verified {
		return p.size - off
	}
	limit := p.size - HoldBack
	end := min(p.done.Contiguous(off), limit)
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
