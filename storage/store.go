package storage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/dgraph-io/badger/v4"
	"github.com/opencontainers/go-digest"
)

// Errors callers check with errors.Is. They are wrapped with the subject.
var (
	// ErrNotFound: the store holds no such blob, tag or record.
	ErrNotFound = errors.New("not found")
	// ErrDigestMismatch: bytes did not hash to the digest they were stored under.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrSizeMismatch: a blob's bytes disagree with the size it was declared to have.
	ErrSizeMismatch = errors.New("size mismatch")
	// ErrChangedOnDisk: bytes on local disk are not the ones written, for
	// example a partial file edited or damaged while pullproxy was down.
	// It comes with ErrDigestMismatch; the upstream is not to blame.
	ErrChangedOnDisk = errors.New("changed on disk")
	// ErrInUse: another process holds the data dir's metadata database.
	ErrInUse = errors.New("data dir in use")
	// ErrMetadataDamaged: the metadata database cannot be opened although
	// no other process holds it.
	ErrMetadataDamaged = errors.New("metadata database damaged")
)

// Store is pullproxy's local cache: blob files plus a Badger metadata database,
// both under one data directory. It is safe for concurrent use.
type Store struct {
	root  string
	blobs string // root/blobs, joined once: blobPath runs on every blob served
	db    *badger.DB
	log   *slog.Logger

	sizes   sync.Map     // digest.Digest → int64: committed sizes read so far, -1 for none recorded (see recordedSize)
	damaged atomic.Int64 // blobs found damaged and quarantined
	members memberCache  // which repositories digests belong to, as found so far (see IsMember)

	// Eviction (evict.go): the bound, the round in progress, and what the
	// store holds, kept as records are written and deleted.
	eviction     EvictionPolicy
	evictMu      sync.Mutex
	storedBytes  atomic.Int64
	storedBlobs  atomic.Int64
	evictedBlobs atomic.Int64
	evictedBytes atomic.Int64

	fds *fdCache // descriptors of blobs served lately

	// Download checkpoints (checkpoint.go): the boot they are taken in, ""
	// when unknown, and whether the data dir keeps no progress attributes.
	boot           string
	noProgressAttr atomic.Bool

	space    func(path string) (free, total int64, err error) // diskSpace; tests replace it
	spaceMu  sync.Mutex
	reserved map[*Partial]struct{} // downloads whose bytes to come are reserved (see reserve)
}

// Option configures Open.
type Option func(*config) error

type config struct {
	log *slog.Logger
}

// WithLogger sets the logger. Default (and for nil): slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l != nil {
			c.log = l
		}
		return nil
	}
}

// Open opens (creating if needed) the store under dir and reconciles what a
// crash may have left behind.
func Open(ctx context.Context, dir string, opts ...Option) (*Store, error) {
	cfg := config{log: slog.Default()}
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return nil, fmt.Errorf("opening store %s: %w", dir, err)
		}
	}
	for _, sub := range []string{"blobs", "partial", "meta"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return nil, fmt.Errorf("opening store: %w (is the data dir writable?)", err)
		}
	}
	db, err := openMeta(filepath.Join(dir, "meta"), cfg.log)
	if err != nil {
		return nil, err
	}
	s := &Store{root: dir, blobs: filepath.Join(dir, "blobs"), db: db, log: cfg.log, space: diskSpace,
		reserved: map[*Partial]struct{}{}, fds: newFDCache(), boot: bootID()}
	if err := s.reconcilePartials(ctx); err != nil {
		db.Close()
		return nil, err
	}
	if err := s.finishEvictions(ctx); err != nil {
		db.Close()
		return nil, err
	}
	if err := s.migrateMembers(ctx); err != nil {
		db.Close()
		return nil, err
	}
	if err := s.abandonIngests(ctx); err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

// Close releases the metadata database. Partials still open are not committed.
func (s *Store) Close() error {
	s.fds.close()
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("closing metadata database: %w", err)
	}
	return nil
}

// Dir returns the data directory.
func (s *Store) Dir() string { return s.root }

func (s *Store) blobPath(d digest.Digest) string {
	hex := d.Encoded()
	if isSHA256(d) {
		// What filepath.Join gives, without cleaning a path that is
		// already clean: blobs is, and a valid digest adds no dots.
		return s.blobs + "/sha256/" + hex[:2] + "/" + hex
	}
	return filepath.Join(s.blobs, string(d.Algorithm()), hex[:2], hex)
}

func (s *Store) partialPath(d digest.Digest) string {
	return filepath.Join(s.root, "partial", string(d.Algorithm())+"-"+d.Encoded())
}

// validate checks that d is a well-formed digest of an available algorithm.
// The common case, sha256, is checked without d.Validate's regular
// expressions: this runs on every blob served.
func validate(d digest.Digest) error {
	if isSHA256(d) {
		return nil
	}
	if err := d.Validate(); err != nil {
		return fmt.Errorf("digest %q: %w", d, err)
	}
	return nil
}

// isSHA256 reports whether d is sha256: followed by 64 lowercase hex digits.
func isSHA256(d digest.Digest) bool {
	hex, ok := strings.CutPrefix(string(d), "sha256:")
	if !ok || len(hex) != 64 {
		return false
	}
	for i := range len(hex) {
		if c := hex[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// OpenBlob opens a verified blob for reading. The caller closes the file.
// It returns ErrNotFound when the store does not hold d.
func (s *Store) OpenBlob(ctx context.Context, d digest.Digest) (*os.File, int64, error) {
	if err := validate(d); err != nil {
		return nil, 0, err
	}
	fd, size, err := s.openChecked(d)
	if err != nil {
		return nil, 0, err
	}
	return os.NewFile(uintptr(fd), s.blobPath(d)), size, nil
}

// OpenBlobFD is OpenBlob for a caller that sends the file with sendfile
// itself: it returns a bare descriptor, which may be shared (see BlobFD).
// An *os.File's set-up and tear-down (a fcntl, a finalizer, the poller's
// bookkeeping), and the open and close themselves (see fdCache), are work
// every request would pay, a sizeable share of serving a small blob.
func (s *Store) OpenBlobFD(ctx context.Context, d digest.Digest) (BlobFD, error) {
	if err := validate(d); err != nil {
		return BlobFD{}, err
	}
	if c := s.fds.get(d); c != nil {
		var st syscall.Stat_t
		err := fstatCached(c.fd, &st)
		if err == nil {
			err = s.checkSize(d, c.fd, st.Size)
		} else {
			err = fmt.Errorf("stat blob %s: %w", d, err)
		}
		if err != nil {
			s.fds.forget(d)
			s.fds.release(c)
			return BlobFD{}, err
		}
		return BlobFD{FD: c.fd, Size: st.Size, c: s.fds, s: c}, nil
	}
	fd, size, err := s.openChecked(d)
	if err != nil {
		return BlobFD{}, err
	}
	return BlobFD{FD: fd, Size: size, c: s.fds, s: s.fds.add(d, fd)}, nil
}

// openChecked opens blob d's file and checks its size against the one
// committed (see checkSize). The caller closes the descriptor.
func (s *Store) openChecked(d digest.Digest) (fd int, size int64, err error) {
	fd, size, err = openFD(s.blobPath(d))
	if errors.Is(err, fs.ErrNotExist) {
		return -1, 0, fmt.Errorf("blob %s: %w", d, ErrNotFound)
	}
	if err != nil {
		return -1, 0, fmt.Errorf("opening blob %s: %w", d, err)
	}
	if err := s.checkSize(d, fd, size); err != nil {
		syscall.Close(fd)
		return -1, 0, err
	}
	return fd, size, nil
}

// openFD opens a file for reading and returns its descriptor and size,
// with two system calls where os.Open and Stat make seven on Linux:
// os.Open makes the descriptor non-blocking, offers it to the network
// poller, which refuses regular files, and makes it blocking again; Stat
// allocates what it returns. The file served is the same; this runs on
// every blob served.
func openFD(name string) (int, int64, error) {
	var fd int
	var err error
	for {
		if fd, err = syscall.Open(name, syscall.O_RDONLY|syscall.O_CLOEXEC, 0); err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		return -1, 0, &fs.PathError{Op: "open", Path: name, Err: err}
	}
	var st syscall.Stat_t
	for {
		if err = syscall.Fstat(fd, &st); err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		syscall.Close(fd)
		return -1, 0, &fs.PathError{Op: "stat", Path: name, Err: err}
	}
	return fd, st.Size, nil
}

// StatBlob returns a verified blob's size, or ErrNotFound.
func (s *Store) StatBlob(ctx context.Context, d digest.Digest) (int64, error) {
	if err := validate(d); err != nil {
		return 0, err
	}
	fi, err := os.Stat(s.blobPath(d))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, fmt.Errorf("blob %s: %w", d, ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("stat blob %s: %w", d, err)
	}
	if want, ok := s.recordedSize(d); ok && want != fi.Size() {
		// Opened, it is checked and quarantined as any read would.
		b, err := s.OpenBlobFD(ctx, d)
		if err != nil {
			return 0, err
		}
		b.Release()
		return b.Size, nil
	}
	return fi.Size(), nil
}

// ReadBlob returns a verified blob's bytes, refusing blobs over limit bytes.
// It is meant for manifests, which are small.
func (s *Store) ReadBlob(ctx context.Context, d digest.Digest, limit int64) ([]byte, error) {
	f, size, err := s.OpenBlob(ctx, d)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if size > limit {
		return nil, fmt.Errorf("reading blob %s: %d bytes is over the %d-byte limit", d, size, limit)
	}
	b := make([]byte, size)
	if _, err := io.ReadFull(f, b); err != nil {
		return nil, fmt.Errorf("reading blob %s: %w", d, err)
	}
	// Small and read whole: checked on every read.
	if got := d.Algorithm().FromBytes(b); got != d {
		why := "its content hashes to " + got.String()
		s.quarantine(d, int(f.Fd()), why)
		return nil, fmt.Errorf("blob %s: %w: %w: %s", d, ErrNotFound, ErrDamaged, why)
	}
	return b, nil
}

// PutBlob stores small content already in memory (manifests) after checking
// that it hashes to d.
func (s *Store) PutBlob(ctx context.Context, d digest.Digest, b []byte) error {
	if err := validate(d); err != nil {
		return err
	}
	if got := d.Algorithm().FromBytes(b); got != d {
		return fmt.Errorf("storing %s: content hashes to %s: %w", d, got, ErrDigestMismatch)
	}
	tmp, err := os.CreateTemp(filepath.Join(s.root, "partial"), "put-*")
	if err != nil {
		return fmt.Errorf("storing %s: %w", d, err)
	}
	defer os.Remove(tmp.Name()) // a no-op once renamed
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return fmt.Errorf("storing %s: %w", d, err)
	}
	if err := s.commitFile(tmp, d, int64(len(b))); err != nil {
		return err
	}
	return s.recordBlob(ctx, d, int64(len(b)))
}

// commitFile syncs and closes f, then renames it into place as blob d (see
// placeFile).
func (s *Store) commitFile(f *os.File, d digest.Digest, size int64) error {
	err := s.placeFile(f, d, size)
	if cerr := f.Close(); err == nil && cerr != nil {
		return fmt.Errorf("committing %s: %w", d, cerr)
	}
	return err
}

// placeFile syncs f and renames it into place as blob d, leaving f open.
// The rename is the only step that makes content visible. The size is known
// in memory before it: a reader that finds the file finds its size too, and
// never caches its absence while the record is being written.
func (s *Store) placeFile(f *os.File, d digest.Digest, size int64) error {
	if err := f.Sync(); err != nil {
		return fmt.Errorf("committing %s: sync: %w", d, err)
	}
	dst := s.blobPath(d)
	dir := filepath.Dir(dst)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("committing %s: %w", d, err)
	}
	s.sizes.Store(d, size)
	if err := os.Rename(f.Name(), dst); err != nil {
		return fmt.Errorf("committing %s: %w", d, err)
	}
	s.fds.forget(d) // a descriptor of a file this one replaced
	return syncDir(dir)
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("syncing %s: %w", dir, err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", dir, err)
	}
	return nil
}

// Ready reports whether the store can serve and store: the metadata
// database open and readable, and the data dir writable (a file created,
// synced and removed under partial/). /readyz asks it.
func (s *Store) Ready(ctx context.Context) error {
	if s.db.IsClosed() {
		return errors.New("the metadata database is closed")
	}
	if err := s.db.View(func(*badger.Txn) error { return nil }); err != nil {
		return fmt.Errorf("reading the metadata database: %w", err)
	}
	f, err := os.CreateTemp(filepath.Join(s.root, "partial"), "ready-*")
	if err != nil {
		return fmt.Errorf("the data dir is not writable: %w", pathless(err))
	}
	name := f.Name()
	err = f.Sync()
	f.Close()
	os.Remove(name)
	if err != nil {
		return fmt.Errorf("the data dir cannot sync a file: %w", pathless(err))
	}
	return ctx.Err()
}

// pathless drops the file name from a file system error: the message
// reaches whoever asks /readyz, and the data dir's layout is the
// operator's.
func pathless(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
