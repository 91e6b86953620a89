package storage

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"

	"github.com/opencontainers/go-digest"
)

// reopen closes s and opens its directory again, as a restarted process
// would. The test's cleanup closes the new store.
func reopen(t *testing.T, s *Store) *Store {
	t.Helper()
	dir := s.Dir()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s2.Close() })
	return s2
}

// TestPartialResumesAfterCrash: a download killed without any goodbye (no
// Fail, no Abandon, as with kill -9) resumes from its last checkpoint, which
// a checkpoint every few MiB keeps close to where it stopped; the
// resumed download verifies.
func TestPartialResumesAfterCrash(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	const every = 4 << 20 // checkpointBytes, lowered to keep the test small
	data := randomBytes(7, 3*every+12345)
	d := digest.FromBytes(data)
	p, err := s.NewPartial(t.Context(), d, int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	p.checkpointBytes = every
	half := len(data) / 2
	for off := 0; off < half; off += 1 << 20 {
		if _, err := p.WriteAt(data[off:min(off+1<<20, half)], int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	p.background.Wait() // checkpoints taken so far have landed; then a crash
	s = reopen(t, s)    // p is simply dropped

	q, err := s.NewPartial(t.Context(), d, int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	start, _ := q.Missing(0)
	if start < int64(half)-every || start > int64(half) {
		t.Errorf("resumed at %d, want within one checkpoint (%d bytes) below %d", start, every, half)
	}
	if _, err := q.WriteAt(data[start:], start); err != nil {
		t.Fatal(err)
	}
	if err := q.Commit(t.Context()); err != nil {
		t.Fatalf("Commit after resuming: %v", err)
	}
	got, err := s.ReadBlob(t.Context(), d, int64(len(data)))
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("blob after resume: %d bytes, err %v", len(got), err)
	}
	if err := s.get(partialKey(d), &partialRecord{}); err == nil {
		t.Error("progress record left after commit")
	}
}

// TestPartialCheckpointsWhatArrivedDuringOne: bytes written while a
// checkpoint syncs are recorded by another as soon as it ends, even when
// no write follows to notice: the end of a blob often arrives during the
// sync, and a crash before the commit would cost all of it again.
func TestPartialCheckpointsWhatArrivedDuringOne(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	const every, piece = 256 << 10, 64 << 10
	data := randomBytes(11, 16<<20)
	d := digest.FromBytes(data)
	p, err := s.NewPartial(t.Context(), d, int64(len(data)+1)) // never complete
	if err != nil {
		t.Fatal(err)
	}
	p.checkpointBytes = every
	// Written faster than a sync takes, so that most land during one.
	for off := 0; off < len(data); off += piece {
		if _, err := p.WriteAt(data[off:off+piece], int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	p.background.Wait()
	s = reopen(t, s)

	q, err := s.NewPartial(t.Context(), d, int64(len(data)+1))
	if err != nil {
		t.Fatal(err)
	}
	if start, _ := q.Missing(0); start < int64(len(data))-every {
		t.Errorf("resumed at %d of the %d bytes written, want within one checkpoint (%d bytes)", start, len(data), every)
	}
}

// TestPartialResumeAfterReboot: a restart in the same boot resumes from
// the last checkpoint, unsynced; after a reboot the bytes it claims may not
// be on disk, and the download resumes from the last synced one instead.
// A committed blob keeps no progress attribute.
func TestPartialResumeAfterReboot(t *testing.T) {
	t.Parallel()
	const every, durable = 256 << 10, 4 << 20
	data := randomBytes(12, 10<<20)
	d := digest.FromBytes(data)
	size := int64(len(data))
	for _, tc := range []struct {
		name   string
		boot   string // the restarted store's
		synced bool   // resumes where the synced record says, else within a checkpoint of where it stopped
	}{
		{"same boot", "", false},
		{"after a reboot", "another boot", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := openDir(t, t.TempDir())
			if s.boot == "" {
				t.Fatal("no boot id: progress attributes are never trusted here")
			}
			p, err := s.NewPartial(t.Context(), d, size)
			if err != nil {
				t.Fatal(err)
			}
			p.checkpointBytes, p.durableBytes = every, durable
			for off := int64(0); off < size/2; off += every {
				if _, err := p.WriteAt(data[off:off+every], off); err != nil {
					t.Fatal(err)
				}
				p.background.Wait() // a checkpoint for every write
			}
			if s.noProgressAttr.Load() {
				t.Fatalf("the test's file system (%s) keeps no extended attributes", s.Dir())
			}
			var synced partialRecord
			if err := s.get(partialKey(d), &synced); err != nil {
				t.Fatal(err)
			}
			s = crash(t, s, p)
			defer s.Close()
			if tc.boot != "" {
				s.boot = tc.boot
			}

			q, err := s.NewPartial(t.Context(), d, size)
			if err != nil {
				t.Fatal(err)
			}
			start, _ := q.Missing(0)
			low, high := size/2-every, size/2
			if tc.synced {
				low, high = synced.Done[0][1], synced.Done[0][1]
				if high >= size/2-every {
					t.Fatalf("synced record covers %v of %d bytes written: too late to tell the two apart", synced.Done, size/2)
				}
			}
			if start < low || start > high {
				t.Errorf("resumed at %d of the %d bytes written (synced record: %v), want %d-%d", start, size/2, synced.Done, low, high)
			}
			if _, err := q.WriteAt(data[start:], start); err != nil {
				t.Fatal(err)
			}
			if err := q.Commit(t.Context()); err != nil {
				t.Fatalf("Commit after resuming: %v", err)
			}
			f, err := os.Open(s.blobPath(d))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if b, err := getProgress(f); err != nil || b != nil {
				t.Errorf("committed blob's progress attribute: %q, %v; want none", b, err)
			}
		})
	}
}

// TestPartialAbandonKeepsProgress: an abandoned download (upstream gone)
// records where it was; the next one starts there.
func TestPartialAbandonKeepsProgress(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	data := randomBytes(8, 300_000)
	d := digest.FromBytes(data)
	p, err := s.NewPartial(t.Context(), d, int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	p.WriteAt(data[:100_000], 0)
	p.WriteAt(data[200_000:250_000], 200_000)
	p.Abandon(nil)

	q, err := s.NewPartial(t.Context(), d, int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ off, start, end int64 }{{0, 100_000, 200_000}, {200_000, 250_000, 300_000}} {
		if start, end := q.Missing(tc.off); start != tc.start || end != tc.end {
			t.Errorf("Missing(%d): got %d-%d, want %d-%d", tc.off, start, end, tc.start, tc.end)
		}
	}
	q.WriteAt(data[100_000:200_000], 100_000)
	q.WriteAt(data[250_000:], 250_000)
	if err := q.Commit(t.Context()); err != nil {
		t.Fatalf("Commit: %v", err)
	}
}

// TestPartialResumeSizeDisagrees: a recorded download for another size is
// discarded, not resumed.
func TestPartialResumeSizeDisagrees(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	data := randomBytes(9, 1000)
	d := digest.FromBytes(data)
	p, _ := s.NewPartial(t.Context(), d, 2000)
	p.WriteAt(data[:500], 0)
	p.Abandon(nil)
	q, err := s.NewPartial(t.Context(), d, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if start, end := q.Missing(0); start != 0 || end != 1000 {
		t.Errorf("Missing(0): got %d-%d, want a fresh 0-1000", start, end)
	}
}

// TestReconcilePartials: at Open, a partial file without a record is
// removed, one with a record kept, and a record without a file dropped.
func TestReconcilePartials(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	kept := randomBytes(10, 1000)
	p, _ := s.NewPartial(t.Context(), digest.FromBytes(kept), 1000)
	p.WriteAt(kept[:10], 0)
	p.Abandon(nil)
	orphan := digest.FromString("orphan record")
	gone, _ := s.NewPartial(t.Context(), orphan, 10)
	gone.WriteAt([]byte("abc"), 0)
	gone.Abandon(nil)
	os.Remove(s.partialPath(orphan))
	stray := filepath.Join(s.Dir(), "partial", "sha256-"+digest.FromString("stray").Encoded())
	os.WriteFile(stray, []byte("junk"), 0o644)

	s = reopen(t, s)
	if _, err := os.Stat(s.partialPath(digest.FromBytes(kept))); err != nil {
		t.Errorf("recorded partial file: %v, want kept", err)
	}
	if _, err := os.Stat(stray); err == nil {
		t.Error("unrecorded partial file kept, want removed")
	}
	if err := s.get(partialKey(orphan), &partialRecord{}); err == nil {
		t.Error("record without a file kept, want dropped")
	}
}

// TestPartialWanted: the offsets readers wait at are reported, once each,
// while they wait.
func TestPartialWanted(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	p, err := s.NewPartial(t.Context(), digest.FromString("wanted"), 10*HoldBack)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Fail(nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	for _, off := range []int64{5 * HoldBack, HoldBack, 5 * HoldBack} {
		go func() {
			p.WaitAvailable(ctx, off)
			done <- struct{}{}
		}()
	}
	want := []int64{HoldBack, 5 * HoldBack}
	for !slices.Equal(p.Wanted(), want) || p.waiters() != 3 {
		runtime.Gosched()
	}
	cancel()
	for range 3 {
		<-done
	}
	if got := p.Wanted(); len(got) != 0 {
		t.Errorf("Wanted after the readers left: got %v, want none", got)
	}
}

// TestPartialWakesOnlyFedReaders: a write wakes the readers waiting in
// WaitAvailable only when it gives one of them bytes to read. Writes ahead of
// a reader (the other chunks of a blob fetched at once), or into the last
// HoldBack bytes, leave it asleep; the write that reaches it wakes it.
func TestPartialWakesOnlyFedReaders(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const size = 8 * HoldBack
	data := randomBytes(11, size)
	p, err := s.NewPartial(t.Context(), digest.FromBytes(data), size)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Fail(nil)
	write := func(start, end int64) {
		t.Helper()
		if _, err := p.WriteAt(data[start:end], start); err != nil {
			t.Fatal(err)
		}
	}
	write(0, HoldBack) // the first byte: WaitStarted's wake-up is spent

	type got struct {
		n   int64
		err error
	}
	woke := make(chan got, 1)
	go func() {
		n, err := p.WaitAvailable(t.Context(), HoldBack)
		woke <- got{n, err}
	}()
	for p.waiters() != 1 {
		runtime.Gosched()
	}
	p.mu.Lock()
	changed := p.changed
	p.mu.Unlock()
	asleep := func(after string) {
		t.Helper()
		select {
		case <-changed:
			t.Fatalf("after %s: the waiting reader was woken, want it left asleep", after)
		default:
		}
	}
	write(3*HoldBack, 4*HoldBack)
	asleep("a write ahead of the reader")
	write(size-HoldBack, size)
	asleep("a write of the held-back tail")
	write(2*HoldBack, 3*HoldBack)
	asleep("a write that joins the one ahead")

	write(HoldBack, 2*HoldBack)
	if g := <-woke; g.err != nil || g.n != 3*HoldBack {
		t.Errorf("WaitAvailable(%d) after the write that reaches it: got %d, %v; want %d, nil", HoldBack, g.n, g.err, 3*HoldBack)
	}
}

// waiters returns how many readers are waiting.
func (p *Partial) waiters() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.wanted)
}

// TestPartialKeepsWrittenBytes: bytes written twice, the second time
// different (a stream restarted from byte 0 at a corrupt replica), keep
// their first value, so the file always matches the verified hash.
func TestPartialKeepsWrittenBytes(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	data := randomBytes(11, 200_000)
	corrupt := bytes.Clone(data)
	for i := range 50_000 {
		corrupt[i] ^= 0xff
	}
	p, err := s.NewPartial(t.Context(), digest.FromBytes(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	p.WriteAt(data[:100_000], 0)
	if n, err := p.WriteAt(corrupt, 0); err != nil || n != len(corrupt) {
		t.Fatalf("WriteAt over written bytes: %d, %v", n, err)
	}
	if err := p.Commit(t.Context()); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	got, err := s.ReadBlob(t.Context(), digest.FromBytes(data), int64(len(data)))
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("stored blob differs from the verified bytes (err %v)", err)
	}
}
