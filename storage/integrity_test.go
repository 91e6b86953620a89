package storage

import (
	"bytes"
	"encoding"
	"errors"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/spans"
)

// openDir opens the store in dir; the caller closes it.
func openDir(t *testing.T, dir string) *Store {
	t.Helper()
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatalf("Open(%s): %v", dir, err)
	}
	return s
}

// drop drops p as a killed process would: no Fail, no Abandon, so its record
// stays as the last checkpoint left it and its file holds what was written.
func drop(p *Partial) {
	p.background.Wait()
	p.f.Close()
}

// crash drops p, closes s and opens its directory again, as a restarted
// process would. The caller closes the new store.
func crash(t *testing.T, s *Store, p *Partial) *Store {
	t.Helper()
	drop(p)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return openDir(t, s.Dir())
}

// inverted returns b with every bit flipped: a copy that differs in every byte.
func inverted(b []byte) []byte {
	out := bytes.Clone(b)
	for i := range out {
		out[i] ^= 0xff
	}
	return out
}

// order returns the chunks of [0, size) in order, reversed or shuffled, for
// kind 0, 1 or 2.
func order(rng *rand.Rand, kind int, size, chunk int64) []span {
	c := chunks(size, chunk)
	switch kind {
	case 1:
		for i, j := 0, len(c)-1; i < j; i, j = i+1, j-1 {
			c[i], c[j] = c[j], c[i]
		}
	case 2:
		rng.Shuffle(len(c), func(i, j int) { c[i], c[j] = c[j], c[i] })
	}
	return c
}

// fileDigest returns the digest of the file at path.
func fileDigest(t *testing.T, path string) digest.Digest {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	return digest.FromBytes(b)
}

// checkHashMatchesFile checks that p's running hash is the hash of the bytes
// its file holds up to the hashed cursor.
func checkHashMatchesFile(t *testing.T, p *Partial) {
	t.Helper()
	p.hashMu.Lock()
	want, err := p.hasher.(encoding.BinaryMarshaler).MarshalBinary()
	hashed := p.hashed.Load()
	p.hashMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p.path)
	if err != nil {
		t.Fatal(err)
	}
	h := p.digest.Algorithm().Hash()
	h.Write(b[:hashed])
	got, _ := h.(encoding.BinaryMarshaler).MarshalBinary()
	if !bytes.Equal(got, want) {
		t.Errorf("running hash over %d bytes: got the hash of other bytes than the file holds, want the file's", hashed)
	}
}

// TestPartialWritersDisagree: two writers of the same range with different
// bytes (an upstream that ignored Range racing chunks in flight) never leave
// the file holding bytes other than those hashed: Commit succeeds exactly
// when the file on disk matches the digest.
func TestPartialWritersDisagree(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const size = 32 << 10
	for round := range 200 {
		data := randomBytes(uint64(2000+round), size)
		d := digest.FromBytes(data)
		p := newTestPartial(t, s, d, size)
		rng := rand.New(rand.NewPCG(uint64(round), 2000))
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i, src := range [][]byte{data, inverted(data)} {
			// Mostly in order, where both writers meet at the hash's frontier.
			spans := order(rng, max(0, rng.IntN(6)-3), size, 8192-int64(i)*2000)
			wg.Go(func() {
				<-start
				for _, sp := range spans {
					if _, err := p.WriteAt(src[sp.start:sp.end], sp.start); err != nil {
						t.Errorf("round %d: WriteAt at %d: got %v, want nil", round, sp.start, err)
						return
					}
				}
			})
		}
		close(start)
		wg.Wait()
		checkHashMatchesFile(t, p)
		fileOK := fileDigest(t, p.path) == d
		err := p.Commit(t.Context())
		if (err == nil) != fileOK {
			t.Fatalf("round %d: Commit: got %v, want success %v (the file on disk matches the digest: %v)", round, err, fileOK, fileOK)
		}
		if err == nil {
			if got := fileDigest(t, s.blobPath(d)); got != d {
				t.Fatalf("round %d: committed blob hashes to %v, want %v", round, got, d)
			}
		}
		if t.Failed() {
			return
		}
	}
}

// TestPartialCrashDuringCheckpoints: a process killed at a random point while
// writers write a blob out of order and checkpoints are taken concurrently
// leaves a record that resumes safely: every checkpoint's hash covers only
// bytes it records as written, and a resumed download that gets different
// bytes for what was missing does not commit them under the digest.
func TestPartialCrashDuringCheckpoints(t *testing.T) {
	t.Parallel()
	const size, chunk = 200_000, 1000
	s := openDir(t, t.TempDir())
	defer func() { s.Close() }()
	for round := range 50 {
		rng := rand.New(rand.NewPCG(uint64(round), 3000))
		data := randomBytes(uint64(3000+round), size)
		d := digest.FromBytes(data)
		p, err := s.NewPartial(t.Context(), d, size)
		if err != nil {
			t.Fatal(err)
		}
		// Mostly in order, where bytes are hashed as they are written.
		c := order(rng, max(0, rng.IntN(6)-3), size, chunk)
		cut := rng.IntN(len(c) + 1)        // chunks written before the crash
		stopAt := int64(rng.IntN(cut + 1)) // chunks written before the last checkpoint
		writeAndCheckpoint(t, s, p, data, c[:cut], stopAt)
		// A resume reads the same record with or without a restart; reopening
		// the database costs 100 ms, so one round in five does.
		if round%5 == 0 {
			s = crash(t, s, p)
		} else {
			drop(p)
		}

		// True bytes; every missing byte different; or only the first missing
		// chunk different (another endpoint served it), the case where bytes
		// hashed but not recorded as written would go unnoticed.
		mode := round % 3
		err = resumeAndCommit(t, s, d, data, mode, chunk)
		switch {
		case err == nil:
			if got := fileDigest(t, s.blobPath(d)); got != d {
				t.Errorf("round %d (cut after %d chunks): committed blob hashes to %v, want %v", round, cut, got, d)
			}
		case mode == 0:
			t.Errorf("round %d (cut after %d chunks): Commit with the true bytes: got %v, want nil", round, cut, err)
		}
		if t.Failed() {
			return
		}
	}
}

// writeAndCheckpoint writes spans of data to p in steps: in each, six
// writers write a chunk each while p is checkpointed, all let go at
// once so that the checkpoints race the writes. Checkpoints stop after
// stopAt chunks, a crash's random point; the writers go on. Every record left
// is checked as a crash would find it.
func writeAndCheckpoint(t *testing.T, s *Store, p *Partial, data []byte, spans []span, stopAt int64) {
	t.Helper()
	const writers = 6
	for step := 0; step < len(spans); step += writers {
		start := make(chan struct{})
		var wg sync.WaitGroup
		for _, sp := range spans[step:min(step+writers, len(spans))] {
			wg.Go(func() {
				<-start
				if _, err := p.WriteAt(data[sp.start:sp.end], sp.start); err != nil {
					t.Errorf("WriteAt at %d: got %v, want nil", sp.start, err)
				}
			})
		}
		if int64(step) < stopAt {
			durable := step%(2*writers) == 0 // the synced record and the progress attribute in turn
			wg.Go(func() {
				<-start
				if err := p.checkpoint(durable); err != nil {
					t.Errorf("checkpoint: got %v, want nil", err)
				}
				checkRecord(t, s, p)
			})
		}
		close(start)
		wg.Wait()
	}
}

// checkRecord checks that p's progress, as a restart would find it (the
// synced record, or the file's progress attribute when it is later), hashes
// no byte it does not record as written.
func checkRecord(t *testing.T, s *Store, p *Partial) {
	t.Helper()
	var rec partialRecord
	if err := s.get(partialKey(p.digest), &rec); err != nil {
		return
	}
	rec, _ = s.laterProgress(p.f, rec)
	var done spans.Set
	for _, r := range rec.Done {
		done.Add(r[0], r[1])
	}
	if prefix := done.Contiguous(0); rec.Hashed > prefix {
		t.Errorf("checkpoint %d of %s: hashed up to %d, want at most the %d contiguous bytes it records", rec.Seq, p.digest, rec.Hashed, prefix)
	}
}

// resumeAndCommit resumes the download of data (or starts it again), writes
// every missing range, and commits. Mode 0 writes the true bytes, mode 1
// different bytes everywhere, mode 2 different bytes in the first chunk it
// writes and the true bytes after it.
func resumeAndCommit(t *testing.T, s *Store, d digest.Digest, data []byte, mode int, chunk int64) error {
	t.Helper()
	size := int64(len(data))
	bad := inverted(data)
	q, err := s.NewPartial(t.Context(), d, size)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Fail(nil)
	for off := int64(0); off < size; {
		start, end := q.Missing(off)
		if start >= end {
			break
		}
		src := data
		if mode == 1 {
			src = bad
		} else if mode == 2 {
			src, end, mode = bad, min(end, start+chunk), 0
		}
		if _, err := q.WriteAt(src[start:end], start); err != nil {
			t.Fatalf("WriteAt at %d: got %v, want nil", start, err)
		}
		off = end
	}
	return q.Commit(t.Context())
}

// TestPartialResumeChangedPrefix: a byte of the partial file changed while
// the server was down, inside the prefix the saved hash state covers, is
// caught at Commit, and nothing is stored.
func TestPartialResumeChangedPrefix(t *testing.T) {
	t.Parallel()
	const size, flip = 300_000, 1234
	data := randomBytes(4000, size)
	d := digest.FromBytes(data)
	s := openDir(t, t.TempDir())
	p, err := s.NewPartial(t.Context(), d, size)
	if err != nil {
		t.Fatal(err)
	}
	writeSpans(t, p, data, chunks(size/2, 10_000))
	if err := p.checkpoint(true); err != nil {
		t.Fatalf("checkpoint: got %v, want nil", err)
	}
	if got := p.hashed.Load(); got <= flip {
		t.Fatalf("hashed before the crash: got %v, want more than %v", got, flip)
	}
	s = crash(t, s, p)
	defer s.Close()

	f, err := os.OpenFile(s.partialPath(d), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{data[flip] ^ 0x01}, flip); err != nil {
		t.Fatal(err)
	}
	f.Close()

	q, err := s.NewPartial(t.Context(), d, size)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Fail(nil)
	if start, _ := q.Missing(0); start != size/2 {
		t.Fatalf("resumed at: got %v, want %v", start, size/2)
	}
	writeSpans(t, q, data, []span{{size / 2, size}})
	if err := q.Commit(t.Context()); !errors.Is(err, ErrDigestMismatch) || !errors.Is(err, ErrChangedOnDisk) {
		t.Fatalf("Commit: got %v, want %v and %v (the disk, not the upstream, is to blame)", err, ErrDigestMismatch, ErrChangedOnDisk)
	}
	if _, err := os.Stat(s.blobPath(d)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("blob file after the failed Commit: got %v, want %v", err, fs.ErrNotExist)
	}
}
