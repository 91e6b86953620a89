package storage

import (
	"context"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/dgraph-io/badger/v4"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/spans"
)

// A download's progress is recorded, so that after a crash or a restart it
// resumes instead of starting over: which ranges of the partial file are
// written, and the running hash of its prefix (sha256's state is a few
// hundred bytes, and saves re-reading hundreds of MiB).
//
// Checkpoints come in two strengths. A process that dies leaves the bytes
// it wrote in the page cache, where the next one finds them; only a reboot
// or power loss loses what was not synced. So most checkpoints, every
// checkpointBytes written or checkpointInterval, only set the partial
// file's progress attribute, unsynced, with the boot they were taken in: a
// restart in the same boot resumes from it, at most that much work again
// per blob being fetched. Every durableBytes or durableInterval, and for a
// download's first checkpoint, the file is synced and the record written to
// the database (synced); after a reboot the download resumes from that
// record, never from bytes the disk may not hold. Where the file system
// keeps no extended attributes, or the boot is not known, every checkpoint
// is durable.
//
// A durable checkpoint costs two syncs (the file's and the database's),
// and the writes they issue to the disk: made every checkpointBytes, they
// would add a good share to a fetch's CPU, to guard against a reboot, far
// rarer than a restart. Made every durableBytes, a reboot costs a download
// at most that much again. Writeback is started every writebackBytes, so
// that a durable checkpoint's sync finds little left to do.
const (
	checkpointBytes    = 2 << 20
	checkpointInterval = time.Second
	durableBytes       = 16 << 20
	durableInterval    = 10 * time.Second
	writebackBytes     = 8 << 20
	partialPrefix      = "partial/"
)

// partialRecord is the durable state of a download.
type partialRecord struct {
	Size      int64      `json:"size"`
	Done      [][2]int64 `json:"done"`
	Hashed    int64      `json:"hashed"`
	HashState []byte     `json:"hashState"`
	Seq       uint64     `json:"seq,omitempty"`  // the checkpoint's number in the download: the later of two records wins
	Boot      string     `json:"boot,omitempty"` // a progress attribute's boot: it is good only in that one
}

func partialKey(d digest.Digest) []byte { return []byte(partialPrefix + d.String()) }

// maybeCheckpoint starts a checkpoint in the background when one is due
// and none is running: the sync and the database write stay off the
// writer's path. n is the number of bytes just written.
//
// Every writebackBytes it also starts the kernel writing the file out, so a
// durable checkpoint's sync waits for a few MiB at most, not for everything
// written since the last one: bytes that arrive during a slow sync are
// bytes a reboot would cost again.
func (p *Partial) maybeCheckpoint(n int) {
	p.mu.Lock()
	before := p.unsynced
	p.unsaved += int64(n)
	p.unsynced += int64(n)
	writeback := before/writebackBytes != p.unsynced/writebackBytes
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
			if err := p.checkpoint(false); err != nil {
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

// durableDueLocked reports whether the next checkpoint is to be durable.
func (p *Partial) durableDueLocked() bool {
	return !p.recorded.Load() || p.store.boot == "" || p.store.noProgressAttr.Load() ||
		p.unsynced >= p.durableBytes || time.Since(p.syncedAt) >= durableInterval
}

// checkpoint records the download's progress: durably when durable is set
// or a durable checkpoint is due, else as the file's progress attribute.
func (p *Partial) checkpoint(durable bool) error {
	snap, err := p.progress(durable)
	if err != nil {
		return err
	}
	rec := snap.rec
	if snap.committed || rec.Size < 0 {
		return nil
	}
	if !snap.durable {
		rec.Boot = p.store.boot
		b, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		err = setProgress(p.f, b)
		if err == nil {
			p.attr.Store(true)
			return nil
		}
		// This one is durable instead; where the file system has no
		// extended attributes at all, every one from now on.
		if errors.Is(err, errors.ErrUnsupported) && p.store.noProgressAttr.CompareAndSwap(false, true) {
			p.store.log.Info("every download checkpoint syncs: the data dir's file system keeps no extended attributes",
				"dir", p.store.root, "err", err)
		}
		rec.Boot = ""
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
	p.mu.Lock()
	p.unsynced -= snap.unsynced
	p.syncedAt = time.Now()
	p.mu.Unlock()
	return nil
}

// snapshot is a download's state as a checkpoint takes it (see progress).
type snapshot struct {
	rec       partialRecord
	unsynced  int64 // bytes written since the last durable checkpoint
	committed bool  // the download was committed: nothing to record
	durable   bool  // the checkpoint is to be durable
}

// progress snapshots the hash state and the ranges done as one state: with
// hashMu held the hash cannot advance, and it only ever covers bytes already
// done, so the record never hashes a byte it does not record as written (a
// resume would fetch that byte again and never hash it). The checkpoint is
// durable when durable is set or one is due.
func (p *Partial) progress(durable bool) (snapshot, error) {
	p.hashMu.Lock()
	defer p.hashMu.Unlock()
	m, ok := p.hasher.(encoding.BinaryMarshaler)
	if !ok {
		return snapshot{}, fmt.Errorf("%s: hash state cannot be saved", p.digest.Algorithm())
	}
	state, err := m.MarshalBinary()
	if err != nil {
		return snapshot{}, err
	}
	rec := partialRecord{Hashed: p.hashed.Load(), HashState: state}
	p.mu.Lock()
	defer p.mu.Unlock()
	rec.Size = p.size
	rec.Done = make([][2]int64, 0, len(p.done))
	for _, s := range p.done {
		rec.Done = append(rec.Done, [2]int64{s.Start, s.End})
	}
	p.seq++
	rec.Seq = p.seq
	p.unsaved, p.savedAt = 0, time.Now()
	return snapshot{rec: rec, unsynced: p.unsynced, committed: p.committed != "", durable: durable || p.durableDueLocked()}, nil
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
	f, err := os.OpenFile(s.partialPath(d), os.O_RDWR, 0)
	if err != nil {
		return discard(err.Error())
	}
	rec, attr := s.laterProgress(f, rec)
	fail := func(why string) (*Partial, bool) {
		f.Close()
		return discard(why)
	}
	if size >= 0 && rec.Size != size {
		return fail(fmt.Sprintf("it was for %d bytes, %d are expected now", rec.Size, size))
	}
	h := d.Algorithm().Hash()
	u, ok := h.(encoding.BinaryUnmarshaler)
	if !ok || u.UnmarshalBinary(rec.HashState) != nil {
		return fail("its hash state cannot be restored")
	}
	var done spans.Set
	for _, r := range rec.Done {
		done.Add(r[0], r[1])
	}
	if rec.Hashed < 0 || rec.Hashed > done.Contiguous(0) {
		return fail(fmt.Sprintf("its hash covers %d bytes, only %d are recorded as written", rec.Hashed, done.Contiguous(0)))
	}
	p := newPartial(s, d, f)
	p.size, p.hasher, p.done = rec.Size, h, done
	p.hashed.Store(rec.Hashed)
	// The sum of the restored state commits to exactly the bytes it hashed,
	// and their count; Commit compares it with a hash of the file's prefix.
	p.resumedHashed, p.resumedSum = rec.Hashed, h.Sum(nil)
	p.recorded.Store(true)
	p.seq = rec.Seq
	p.attr.Store(attr != nil)
	if rec.Boot != "" {
		// Bytes it claims are not synced: the first checkpoint syncs them.
		p.syncedAt = time.Time{}
	}
	from := "the synced record"
	if rec.Boot != "" {
		from = "this boot's progress"
	}
	s.log.Info("resuming a partial download", "digest", d, "size", rec.Size, "have", p.done.Total(), "from", from)
	return p, true
}

// laterProgress returns the progress recorded in f's attribute in place of
// rec, the synced record, when it is the later of the two and was taken in
// this boot: the bytes it claims were written without a sync, and are in
// the file as long as the machine has not restarted since. It also returns
// the attribute, if f has one.
func (s *Store) laterProgress(f *os.File, rec partialRecord) (partialRecord, []byte) {
	b, err := getProgress(f)
	if err != nil || b == nil {
		return rec, nil
	}
	var later partialRecord
	if s.boot == "" || json.Unmarshal(b, &later) != nil || later.Boot != s.boot || later.Seq <= rec.Seq || later.Size != rec.Size {
		return rec, b
	}
	return later, b
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
