package storage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/dgraph-io/badger/v4"
	"github.com/opencontainers/go-digest"
)

// Eviction keeps the store within a bound: the blobs' bytes (max_size), or
// how full the data dir's file system may get. Past the high watermark the
// least recently used blobs are removed until the low one is reached: when
// a commit takes the store past it, and every interval. A size declared
// before the bytes are verified is a claim: a blob that could never fit is
// refused before anything is evicted, and a download is given up front
// only what the file system needs to take its bytes, never more, and
// nothing when evicting all that may go would not be enough. A blob open
// for reading (a client being served, a download's readers; known by the
// file's identity) or pinned is never removed; manifests are kept (a few
// KiB each, and what lets a site answer tags offline). What remains is
// consistent: an evicted layer is fetched again when a manifest that names
// it is pulled.
//
// An eviction is crash-safe: the blobs to go are first marked in their
// records, then their files removed, then their records; Open finishes
// what a crash interrupted, so a store never keeps a record without its
// file, nor a file without its record.

// EvictionPolicy bounds the store.
type EvictionPolicy struct {
	// MaxBytes bounds the bytes of the blobs stored; 0: no such bound.
	MaxBytes int64
	// MaxPercent bounds how full (percent of its size) the data dir's
	// file system may get, when MaxBytes is 0; 0: no bound at all.
	MaxPercent float64
	// Pinned, when set, lists blobs never to evict (the images of the
	// pin list).
	Pinned func(ctx context.Context) (map[digest.Digest]bool, error)
}

// DefaultMaxPercent is the bound without configuration: kubelet's image
// garbage collection defaults (evict above 85% full, down to 80%).
const DefaultMaxPercent = 85

// Watermarks below the bound: MaxBytes is evicted down to 90% of it,
// MaxPercent down to 5 points below it.
const (
	lowBytesFraction = 0.9
	lowPercentPoints = 5
)

// EvictionRound is what one round of eviction did.
type EvictionRound struct {
	Blobs   int
	Bytes   int64
	Skipped int // candidates kept because they were open or pinned
}

// SetEviction sets the bound the store keeps to. It is to be called once,
// before the store is used.
func (s *Store) SetEviction(p EvictionPolicy) { s.eviction = p }

// Usage returns the bytes and number of the blobs stored (manifests
// included), as the records count them.
func (s *Store) Usage() (bytes, blobs int64) { return s.storedBytes.Load(), s.storedBlobs.Load() }

// FileSystem returns the free (to unprivileged users) and total bytes of
// the data dir's file system; zeros when it cannot tell.
func (s *Store) FileSystem() (free, total int64) {
	free, total, err := s.space(s.root)
	if err != nil {
		return 0, 0
	}
	return free, total
}

// Evictions returns the blobs and bytes evicted since Open.
func (s *Store) Evictions() (blobs, bytes int64) { return s.evictedBlobs.Load(), s.evictedBytes.Load() }

// overBound returns how many bytes are to go to bring the store down to
// its low watermark once extra more are stored, or 0 if it stays under
// the high one.
func (s *Store) overBound(extra int64) int64 {
	p := s.eviction
	switch {
	case p.MaxBytes > 0:
		used := s.storedBytes.Load() + extra
		if used <= p.MaxBytes {
			return 0
		}
		return used - int64(float64(p.MaxBytes)*lowBytesFraction)
	case p.MaxPercent > 0:
		free, total, err := s.space(s.root)
		if err != nil || total <= 0 {
			return 0
		}
		used := total - free + extra
		if float64(used) <= float64(total)*p.MaxPercent/100 {
			return 0
		}
		return used - int64(float64(total)*max(p.MaxPercent-lowPercentPoints, 0)/100)
	}
	return 0
}

// RunEvictor evicts whenever the store is past its bound, every interval
// (other files may fill the file system; a commit evicts for itself), until
// ctx ends.
func (s *Store) RunEvictor(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if need := s.overBound(0); need > 0 {
			s.evictLogged(ctx, need, "", "over the bound")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// makeRoom makes extra more bytes fit, for a blob about to be written
// whose size is known (an import): it reports whether they do. It evicts
// only what the file system needs to take them, and nothing when evicting
// all it may would not be enough. Within the bound the store is brought
// back by the commit (see evictAfterCommit), once the bytes are verified.
func (s *Store) makeRoom(ctx context.Context, extra int64) bool {
	if err := s.boundAllows(ctx, "", extra); err != nil {
		return false
	}
	free, total, err := s.space(s.root)
	if err != nil {
		return true // nothing to tell by: the writes will say
	}
	short := extra + s.promised(nil) + spaceMargin(total) - free
	if short <= 0 {
		return true
	}
	return s.evictAtLeast(ctx, short, "", "making room on the file system")
}

// boundAllows returns an error wrapping ErrNoSpace when extra more bytes
// of blob d would keep the store past its bound even with every blob it
// may evict gone: what is left is open, pinned or manifests. Nothing is
// evicted; the commit evicts what the bytes need once they are verified.
func (s *Store) boundAllows(ctx context.Context, d digest.Digest, extra int64) error {
	excess := s.boundExcess(extra)
	if excess <= 0 {
		return nil
	}
	evictable, err := s.evictableBytes(ctx, d)
	if err != nil {
		return nil // the commit's eviction will say
	}
	if evictable >= excess {
		return nil
	}
	stored, _ := s.Usage()
	return fmt.Errorf("storing %s needs %d bytes: the store holds %d, of which only %d may be evicted "+
		"(the rest is open, pinned or manifests), and its bound allows %d more: %w",
		d, extra, stored, evictable, evictable-excess+extra, ErrNoSpace)
}

// boundExcess returns by how many bytes the store would be past its high
// watermark once extra more are stored, or 0.
func (s *Store) boundExcess(extra int64) int64 {
	p := s.eviction
	switch {
	case p.MaxBytes > 0:
		return max(0, s.storedBytes.Load()+extra-p.MaxBytes)
	case p.MaxPercent > 0:
		free, total, err := s.space(s.root)
		if err != nil || total <= 0 {
			return 0
		}
		return max(0, total-free+extra-int64(float64(total)*p.MaxPercent/100))
	}
	return 0
}

// evictAfterCommit brings the store back within its bound once blob d is
// committed, sparing d: its bytes are verified, unlike a size claimed
// before a download, which never makes the store evict beyond what the
// file system needs.
func (s *Store) evictAfterCommit(ctx context.Context, d digest.Digest) {
	need := s.overBound(0)
	if need <= 0 {
		return
	}
	s.evictLogged(ctx, need, d, "a commit took the store past its bound")
}

func (s *Store) evictLogged(ctx context.Context, need int64, spare digest.Digest, why string) {
	start := time.Now()
	round, err := s.evict(ctx, need, 0, spare)
	s.logRound(round, err, need, why, start)
}

func (s *Store) logRound(round EvictionRound, err error, need int64, why string, start time.Time) {
	bytes, blobs := s.Usage()
	attrs := []any{"why", why, "wanted_bytes", need, "evicted_blobs", round.Blobs, "evicted_bytes", round.Bytes,
		"kept_open_or_pinned", round.Skipped, "store_bytes", bytes, "store_blobs", blobs,
		"duration", time.Since(start).Round(time.Millisecond)}
	switch {
	case errors.Is(err, errCannotFree):
		s.log.Warn("nothing evicted: what may be evicted would not free enough", append(attrs,
			"fix", "raise max_size, unpin images, or give the data dir a larger disk")...)
	case err != nil:
		s.log.Warn("eviction round failed", append(attrs, "err", err)...)
	case round.Bytes < need:
		s.log.Warn("eviction round could not free enough: what is left is open, pinned or manifests", append(attrs,
			"fix", "raise max_size, unpin images, or give the data dir a larger disk")...)
	default:
		s.log.Info("eviction round", attrs...)
	}
}

// evictAtLeast evicts need bytes, or nothing when what may be evicted
// would free less: it reports whether need bytes were freed.
func (s *Store) evictAtLeast(ctx context.Context, need int64, spare digest.Digest, why string) bool {
	if s.eviction.MaxBytes == 0 && s.eviction.MaxPercent == 0 {
		return false
	}
	start := time.Now()
	round, err := s.evict(ctx, need, need, spare)
	s.logRound(round, err, need, why, start)
	return err == nil && round.Bytes >= need
}

// errCannotFree: an eviction that had to free a minimum found less than
// that to evict, and evicted nothing.
var errCannotFree = errors.New("what may be evicted would not free enough")

// evictionCandidate is a blob that may be evicted.
type evictionCandidate struct {
	d          digest.Digest
	size       int64
	lastAccess time.Time
	file       fileID // the file chosen, checked again when it is removed
}

// Evict removes least recently used blobs until need bytes are freed or
// nothing more may go.
func (s *Store) Evict(ctx context.Context, need int64) (EvictionRound, error) {
	return s.evict(ctx, need, 0, "")
}

// evict removes least recently used blobs, never spare, until need bytes
// are freed or nothing more may go; when fewer than minimum bytes could
// go, it removes none and returns errCannotFree.
func (s *Store) evict(ctx context.Context, need, minimum int64, spare digest.Digest) (EvictionRound, error) {
	s.evictMu.Lock() // one round at a time; the lock is the round's, not the store's
	defer s.evictMu.Unlock()
	chosen, round, err := s.chooseEvictions(ctx, need, spare)
	if err != nil {
		return round, err
	}
	var freed int64
	for _, c := range chosen {
		freed += c.size
	}
	if freed < minimum {
		return round, errCannotFree
	}
	// In batches: a batch is marked, its files removed, its records
	// deleted; a crash anywhere in between is finished by Open.
	for batch := range slices.Chunk(chosen, 256) {
		if err := ctx.Err(); err != nil {
			return round, err
		}
		n, bytes, err := s.evictBatch(batch)
		round.Blobs += n
		round.Bytes += bytes
		s.evictedBlobs.Add(int64(n))
		s.evictedBytes.Add(bytes)
		if err != nil {
			return round, err
		}
	}
	return round, nil
}

// evictableBytes returns how many bytes an eviction could free now, never
// taking spare.
func (s *Store) evictableBytes(ctx context.Context, spare digest.Digest) (int64, error) {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	chosen, _, err := s.chooseEvictions(ctx, math.MaxInt64, spare)
	var n int64
	for _, c := range chosen {
		n += c.size
	}
	return n, err
}

// chooseEvictions picks the least recently used blobs that may go, up to
// need bytes: not spare, not pinned, not open (by the file's identity, so
// that however the data dir was named, a blob being read is seen).
func (s *Store) chooseEvictions(ctx context.Context, need int64, spare digest.Digest) ([]evictionCandidate, EvictionRound, error) {
	var round EvictionRound
	var pinned map[digest.Digest]bool
	if s.eviction.Pinned != nil {
		var err error
		if pinned, err = s.eviction.Pinned(ctx); err != nil {
			return nil, round, fmt.Errorf("listing pinned images: %w", err)
		}
	}
	candidates, err := s.evictionCandidates(ctx)
	if err != nil {
		return nil, round, err
	}
	open := openFiles(s.fds.idleFDs()) // open only for the cache, which lets them go
	var chosen []evictionCandidate
	var freed int64
	for _, c := range candidates {
		if freed >= need {
			break
		}
		if c.d == spare {
			continue
		}
		id, err := statID(s.blobPath(c.d))
		if err != nil {
			continue // gone already, or unreadable: verify reports it
		}
		if pinned[c.d] || open[id] {
			round.Skipped++
			continue
		}
		c.file = id
		chosen = append(chosen, c)
		freed += c.size
	}
	return chosen, round, nil
}

// evictionCandidates lists the stored blobs that are not manifests,
// least recently used first.
func (s *Store) evictionCandidates(ctx context.Context) ([]evictionCandidate, error) {
	var out []evictionCandidate
	err := s.db.View(func(txn *badger.Txn) error {
		it := txn.NewIterator(badger.IteratorOptions{Prefix: []byte(blobPrefix), PrefetchValues: true, PrefetchSize: 100})
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			if err := ctx.Err(); err != nil {
				return err
			}
			item := it.Item()
			d := digest.Digest(item.Key()[len(blobPrefix):])
			var rec BlobRecord
			if err := item.Value(func(b []byte) error { return json.Unmarshal(b, &rec) }); err != nil {
				continue // verify reports it
			}
			if rec.MediaType != "" || rec.Evicting || validate(d) != nil {
				continue
			}
			out = append(out, evictionCandidate{d: d, size: rec.Size, lastAccess: rec.LastAccess})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("listing blobs to evict: %w", err)
	}
	slices.SortFunc(out, func(a, b evictionCandidate) int { return a.lastAccess.Compare(b.lastAccess) })
	return out, nil
}

// evictBatch evicts the blobs of batch: marks their records, removes their
// files, deletes their records. It returns what it evicted.
func (s *Store) evictBatch(batch []evictionCandidate) (int, int64, error) {
	err := s.db.Update(func(txn *badger.Txn) error {
		for _, c := range batch {
			var rec BlobRecord
			if err := getTxn(txn, blobKey(c.d), &rec); err != nil {
				continue
			}
			rec.Evicting = true
			b, err := json.Marshal(rec)
			if err != nil {
				return err
			}
			if err := txn.Set(blobKey(c.d), b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return 0, 0, fmt.Errorf("marking blobs to evict: %w", err)
	}
	for _, c := range batch {
		s.fds.forget(c.d)
		if err := s.removeBlobFile(c); err != nil {
			s.log.Warn("removing an evicted blob", "digest", c.d, "err", err)
		}
	}
	return s.dropEvicted(batch)
}

// dropEvicted deletes the records of evicted blobs that are still marked
// (a blob committed again meanwhile is not), and counts them out.
func (s *Store) dropEvicted(batch []evictionCandidate) (int, int64, error) {
	var n int
	var bytes int64
	var dropped []digest.Digest
	var err error
	// A touch or a commit of one of the records at once conflicts: the
	// transaction is run again on what it wrote (the files are gone).
	for range 5 {
		if err = s.dropEvictedOnce(batch, &n, &bytes, &dropped); !errors.Is(err, badger.ErrConflict) {
			break
		}
	}
	if err != nil {
		return 0, 0, fmt.Errorf("deleting the records of evicted blobs: %w", err)
	}
	for _, d := range dropped {
		s.sizes.Delete(d)
	}
	s.storedBytes.Add(-bytes)
	s.storedBlobs.Add(-int64(n))
	return n, bytes, nil
}

func (s *Store) dropEvictedOnce(batch []evictionCandidate, np *int, bytesp *int64, droppedp *[]digest.Digest) error {
	n, bytes, dropped := 0, int64(0), (*droppedp)[:0]
	err := s.db.Update(func(txn *badger.Txn) error {
		n, bytes, dropped = 0, 0, dropped[:0]
		for _, c := range batch {
			var rec BlobRecord
			if err := getTxn(txn, blobKey(c.d), &rec); err != nil || !rec.Evicting {
				continue
			}
			if err := txn.Delete(blobKey(c.d)); err != nil {
				return err
			}
			n++
			bytes += rec.Size
			dropped = append(dropped, c.d)
		}
		return nil
	})
	*np, *bytesp, *droppedp = n, bytes, dropped
	return err
}

// finishEvictions completes evictions a crash interrupted, and counts
// what the store holds: Open runs it.
func (s *Store) finishEvictions(ctx context.Context) error {
	var pending []evictionCandidate
	var bytes, blobs int64
	err := s.db.View(func(txn *badger.Txn) error {
		it := txn.NewIterator(badger.IteratorOptions{Prefix: []byte(blobPrefix), PrefetchValues: true, PrefetchSize: 100})
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			if err := ctx.Err(); err != nil {
				return err
			}
			var rec BlobRecord
			if err := it.Item().Value(func(b []byte) error { return json.Unmarshal(b, &rec) }); err != nil {
				continue
			}
			d := digest.Digest(it.Item().KeyCopy(nil)[len(blobPrefix):])
			bytes += rec.Size
			blobs++
			if rec.Evicting {
				pending = append(pending, evictionCandidate{d: d, size: rec.Size})
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("counting stored blobs: %w", err)
	}
	s.storedBytes.Store(bytes)
	s.storedBlobs.Store(blobs)
	if len(pending) == 0 {
		return nil
	}
	for _, c := range pending {
		if err := validate(c.d); err == nil {
			if err := os.Remove(s.blobPath(c.d)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("finishing an interrupted eviction of %s: %w", c.d, err)
			}
		}
	}
	n, freed, err := s.dropEvicted(pending)
	if err != nil {
		return err
	}
	s.log.Info("finished an eviction interrupted by a stop", "blobs", n, "bytes", freed)
	return nil
}

// removeBlobFile removes the file of c, the one it was chosen as: a commit
// of the same blob that put a new file in place meanwhile keeps it. The
// file is moved aside first, and put back when it is not the one chosen
// (the bytes are the same, but the new file's record is being written by
// its commit). A zero c.file removes whatever file is there.
func (s *Store) removeBlobFile(c evictionCandidate) error {
	path := s.blobPath(c.d)
	if c.file == (fileID{}) {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	}
	aside := filepath.Join(s.root, "partial", "evicting-"+c.d.Encoded())
	if err := os.Rename(path, aside); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	if id, err := statID(aside); err == nil && id != c.file {
		// Not the file chosen: a commit replaced it. Back in place,
		// unless yet another commit has put one there.
		if err := os.Link(aside, path); err != nil && !errors.Is(err, os.ErrExist) {
			s.log.Warn("putting back a blob committed during its eviction", "digest", c.d, "err", err)
		}
	}
	return os.Remove(aside)
}

// fileID is a file's identity: its device and inode.
type fileID struct{ dev, ino uint64 }

// statID returns the identity of the file at path, links not followed.
func statID(path string) (fileID, error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return fileID{}, err
	}
	return fileID{uint64(st.Dev), st.Ino}, nil
}

// openFiles returns the identities of the files this process holds open,
// from /proc/self/fd, but for the descriptors in except: eviction passes
// them by. Reading the descriptor table at each round costs nothing on the
// hot path, where counting readers would cost every request; identities,
// not paths, so that a data dir named relatively, through a link or bind
// mount, is seen for what it is. Where /proc is missing, it returns none:
// a blob removed while open is still read whole, its space freed when it
// is closed.
func openFiles(except map[int]bool) map[fileID]bool {
	out := map[fileID]bool{}
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return out
	}
	for _, e := range entries {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || except[fd] {
			continue
		}
		var st syscall.Stat_t
		if err := syscall.Fstat(fd, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
			continue
		}
		out[fileID{uint64(st.Dev), st.Ino}] = true
	}
	return out
}

// RemoveBlobs removes blobs from the store, files and records, as an
// eviction does (not counted as one): an import that failed half-way takes
// back what it added.
func (s *Store) RemoveBlobs(ctx context.Context, ds []digest.Digest) error {
	batch := make([]evictionCandidate, 0, len(ds))
	for _, d := range ds {
		if validate(d) == nil {
			batch = append(batch, evictionCandidate{d: d})
		}
	}
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	_, _, err := s.evictBatch(batch)
	return err
}
