package storage

import (
	"context"
	"encoding"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/dgraph-io/badger/v4"
	"github.com/opencontainers/go-digest"
)

// A download's progress is recorded durably, so that after a crash or a
// restart it resumes instead of starting over: which ranges of the partial
// file are written, and the running hash of its prefix (sha256's state is a
// few hundred bytes, and saves re-reading hundreds of MiB).
//
// A checkpoint syncs the file before recording, so the record never claims
// bytes the disk may not hold. Checkpoints are taken every checkpointBytes
// written or checkpointInterval, whichever comes first: a crash costs at most
// that much work again (per blob being fetched), plus what arrived while
// the last one synced. Each costs a sync of the file, which the writeback
// started every writebackBytes keeps short, and a synced database write:
// at 2 MiB, a 600 MiB image costs some 300 of them, under 0.05 s of CPU
// (cpubench's profile), and a crash mid-layer costs about 2 MiB again.
const (
	checkpointBytes    = 2 << 20
	checkpointInterval = time.Second
	writebackBytes     = 1 << 20
	partialPrefix      = "partial/"
)

// partialRecord is the durable state of a download.
type partialRecord struct {
	Size      int64      `json:"size"`
	Done      [][2]int64 `json:"done"`
	Hashed    int64      `json:"hashed"`
	HashState []byte     `json:"hashState"`
}

func partialKey(d digest.Digest) []byte { return []byte(partialPrefix + d.String()) }

// maybeCheckpoint starts a checkpoint in the background when one is due
// and none is running: the sync and the database write stay off the
// writer's path. n is the number of bytes just written.
//
// Every writebackBytes it also starts the kernel writing the file out, so a
// checkpoint's sync waits for a few MiB at most, not for everything written
// since the last one: bytes that arrive during a slow sync are bytes a crash
// would cost again.
func (p *Partial) maybeCheckpoint(n int) {
	p.mu.Lock()
	before := p.unsaved
	p.unsaved += int64(n)
	writeback := before/writebackBytes != p.unsaved/writebackBytes
	due := p.dueLocked()
	p.mu.Unlock()
	if writeback {
		startWriteback(p.f)
	}
	if !due || !p.checkpointing.CompareAndSwap(false, true) {
		return
	}
	p.background.Add(1)
	go func() {
		defer p.background.Done()
		// Bytes written while a checkpoint ran may make another due at once,
		// with no later write to notice: the last MiB of a blob would wait
		// for its commit, and a crash before that would lose them.
		for {
			if err := p.checkpoint(); err != nil {
				// Not fatal: the download goes on, a crash would just cost more.
				p.store.log.Warn("recording download progress", "digest", p.digest, "err", err)
				p.checkpointing.Store(false)
				return
			}
			if p.checkpointDue() {
				continue
			}
			p.checkpointing.Store(false)
			// A write that found this checkpoint still running after the
			// check above left its own to it: look again, now that it
			// could have started one.
			if !p.checkpointDue() || !p.checkpointing.CompareAndSwap(false, true) {
				return
			}
		}
	}()
}

// checkpointDue reports whether another checkpoint is due for a download
// still under way.
func (p *Partial) checkpointDue() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dueLocked() && p.committed == "" && p.err == nil
}

// unsavedBytes returns how many bytes were written since the last
// checkpoint.
func (p *Partial) unsavedBytes() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.unsaved
}

// dueLocked reports whether enough was written since the last checkpoint,
// or long enough ago, for another.
func (p *Partial) dueLocked() bool {
	return p.size >= 0 && p.unsaved > 0 &&
		(p.unsaved >= p.checkpointBytes || time.Since(p.savedAt) >= checkpointInterval)
}

// checkpoint records the download's progress durably.
func (p *Partial) checkpoint() error {
	rec, committed, err := p.progress()
	if err != nil {
		return err
	}
	if committed || rec.Size < 0 {
		return nil
	}
	// Every byte the record claims was written before the snapshot, so the
	// sync covers it.
	if err := p.f.Sync(); err != nil {
		return fmt.Errorf("syncing download of %s: %w", p.digest, err)
	}
	if err := p.store.put(partialKey(p.digest), rec); err != nil {
		return err
	}
	p.recorded.Store(true)
	return nil
}

// progress snapshots the hash state and the ranges done as one state: with
// hashMu held the hash cannot advance, and it only ever covers bytes already
// done, so the record never hashes a byte it does not record as written (a
// resume would fetch that byte again and never hash it). It also reports
// whether the download was committed.
func (p *Partial) progress() (partialRecord, bool, error) {
	p.hashMu.Lock()
	defer p.hashMu.Unlock()
	m, ok := p.hasher.(encoding.BinaryMarshaler)
	if !ok {
		return partialRecord{}, false, fmt.Errorf("%s: hash state cannot be saved", p.digest.Algorithm())
	}
	state, err := m.MarshalBinary()
	if err != nil {
		return partialRecord{}, false, err
	}
	rec := partialRecord{Hashed: p.hashed.Load(), HashState: state}
	p.mu.Lock()
	defer p.mu.Unlock()
	rec.Size = p.size
	rec.Done = make([][2]int64, 0, len(p.done))
	for _, s := range p.done {
		rec.Done = append(rec.Done, [2]int64{s.start, s.end})
	}
	p.unsaved, p.savedAt = 0, time.Now()
	return rec, p.committed != "", nil
}

// dropRecord removes the progress record, if one was written.
func (p *Partial) dropRecord() {
	if p.recorded.Load() {
		p.store.dropPartialRecord(p.digest)
	}
}

// resume reopens the download of d left by an earlier run, if its record
// and file are there and agree with size (-1: any).
func (s *Store) resume(ctx context.Context, d digest.Digest, size int64) (*Partial, bool) {
	var rec partialRecord
	if err := s.get(partialKey(d), &rec); err != nil {
		return nil, false
	}
	discard := func(why string) (*Partial, bool) {
		s.log.Info("discarding an earlier partial download", "digest", d, "reason", why)
		s.dropPartialRecord(d)
		return nil, false
	}
	if size >= 0 && rec.Size != size {
		return discard(fmt.Sprintf("it was for %d bytes, %d are expected now", rec.Size, size))
	}
	h := d.Algorithm().Hash()
	u, ok := h.(encoding.BinaryUnmarshaler)
	if !ok || u.UnmarshalBinary(rec.HashState) != nil {
		return discard("its hash state cannot be restored")
	}
	var done spans
	for _, r := range rec.Done {
		done.add(r[0], r[1])
	}
	if rec.Hashed < 0 || rec.Hashed > done.contiguous(0) {
		return discard(fmt.Sprintf("its hash covers %d bytes, only %d are recorded as written", rec.Hashed, done.contiguous(0)))
	}
	f, err := os.OpenFile(s.partialPath(d), os.O_RDWR, 0)
	if err != nil {
		return discard(err.Error())
	}
	p := newPartial(s, d, f)
	p.size, p.hasher, p.done = rec.Size, h, done
	p.hashed.Store(rec.Hashed)
	// The sum of the restored state commits to exactly the bytes it hashed,
	// and their count; Commit compares it with a hash of the file's prefix.
	p.resumedHashed, p.resumedSum = rec.Hashed, h.Sum(nil)
	p.recorded.Store(true)
	s.log.Info("resuming a partial download", "digest", d, "size", rec.Size, "have", p.done.total())
	return p, true
}

func (s *Store) dropPartialRecord(d digest.Digest) {
	err := s.db.Update(func(txn *badger.Txn) error { return txn.Delete(partialKey(d)) })
	if err != nil {
		s.log.Warn("removing a download's progress record", "digest", d, "err", err)
	}
}

// reconcilePartials keeps the partial files that have a progress record,
// removes those that do not (nothing says which of their bytes are good),
// and drops records whose file is gone.
func (s *Store) reconcilePartials(ctx context.Context) error {
	dir := filepath.Join(s.root, "partial")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("reading %s: %w", dir, err)
	}
	recorded := map[string]bool{}
	err = s.db.View(func(txn *badger.Txn) error {
		it := txn.NewIterator(badger.IteratorOptions{Prefix: []byte(partialPrefix)})
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			recorded[strings.TrimPrefix(string(it.Item().Key()), partialPrefix)] = true
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("listing partial downloads: %w", err)
	}
	kept, removed := 0, 0
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return err
		}
		name := e.Name()
		d := digest.Digest(strings.Replace(name, "-", ":", 1))
		if d.Validate() == nil && recorded[d.String()] {
			delete(recorded, d.String())
			kept++
			continue
		}
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("removing stale partial download %s: %w", name, err)
		}
		removed++
	}
	for d := range recorded {
		s.dropPartialRecord(digest.Digest(d))
	}
	if kept+removed > 0 {
		s.log.Info("partial downloads from an earlier run", "resumable", kept, "removed", removed)
	}
	return nil
}
