package storage

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/spans"
)

// newPartial starts a download in s and abandons it when the test ends unless
// it was committed.
func newTestPartial(t *testing.T, s *Store, d digest.Digest, size int64) *Partial {
	t.Helper()
	p, err := s.NewPartial(t.Context(), d, size)
	if err != nil {
		t.Fatalf("NewPartial(%s, %d): %v", d, size, err)
	}
	t.Cleanup(func() { p.Fail(nil) })
	return p
}

// cancelledContext probes whether a wait would block: the wait returns the
// context's error instead of blocking.
func cancelledContext() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

// chunks splits [0, size) into consecutive spans of at most n bytes.
func chunks(size, n int64) []span {
	var out []span
	for off := int64(0); off < size; off += n {
		out = append(out, span{off, min(off+n, size)})
	}
	return out
}

func writeSpans(t *testing.T, p *Partial, data []byte, spans []span) {
	t.Helper()
	for _, sp := range spans {
		n, err := p.WriteAt(data[sp.start:sp.end], sp.start)
		if err != nil || n != int(sp.end-sp.start) {
			t.Fatalf("WriteAt(%d bytes at %d): got %v, %v, want %v, nil", sp.end-sp.start, sp.start, n, err, sp.end-sp.start)
		}
	}
}

// checkStored checks that d is in the store with exactly data.
func checkStored(t *testing.T, s *Store, d digest.Digest, data []byte) {
	t.Helper()
	ctx := t.Context()
	f, size, err := s.OpenBlob(ctx, d)
	if err != nil {
		t.Fatalf("OpenBlob: got %v, want nil", err)
	}
	defer f.Close()
	if size != int64(len(data)) {
		t.Errorf("OpenBlob size: got %v, want %v", size, len(data))
	}
	if got := readAll(t, f); !bytes.Equal(got, data) {
		t.Errorf("OpenBlob content: got %d bytes, want the %d bytes written", len(got), len(data))
	}
	rec, err := s.Blob(ctx, d)
	if err != nil {
		t.Fatalf("Blob: got %v, want nil", err)
	}
	if rec.Size != int64(len(data)) {
		t.Errorf("Blob().Size: got %v, want %v", rec.Size, len(data))
	}
	if rec.LastAccess.IsZero() {
		t.Errorf("Blob().LastAccess: got %v, want a time", rec.LastAccess)
	}
}

// checkDiscarded checks that a failed download left nothing behind.
func checkDiscarded(t *testing.T, s *Store, p *Partial) {
	t.Helper()
	if _, err := os.Stat(p.path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("partial file after failure: got %v, want %v", err, fs.ErrNotExist)
	}
	if _, err := s.StatBlob(t.Context(), p.Digest()); !errors.Is(err, ErrNotFound) {
		t.Errorf("StatBlob after failure: got %v, want %v", err, ErrNotFound)
	}
	if p.Committed() {
		t.Errorf("Committed(): got %v, want %v", true, false)
	}
}

func TestNewPartial(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	d := digest.FromString("new partial")
	// A file left by an earlier attempt is discarded.
	if err := os.WriteFile(s.partialPath(d), []byte("stale bytes"), 0o644); err != nil {
		t.Fatal(err)
	}
	p := newTestPartial(t, s, d, 123)
	if got := p.Digest(); got != d {
		t.Errorf("Digest(): got %v, want %v", got, d)
	}
	if got := p.Size(); got != 123 {
		t.Errorf("Size(): got %v, want %v", got, 123)
	}
	if got := p.Written(); got != 0 {
		t.Errorf("Written(): got %v, want %v", got, 0)
	}
	fi, err := os.Stat(s.partialPath(d))
	if err != nil || fi.Size() != 0 {
		t.Errorf("partial file: got %v, %v, want an empty file", fi, err)
	}
	if p.Committed() || p.Err() != nil {
		t.Errorf("new download: got committed %v err %v, want false, nil", p.Committed(), p.Err())
	}

	q := newTestPartial(t, s, digest.FromString("unknown size"), -1)
	if got := q.Size(); got != -1 {
		t.Errorf("Size() of unknown size: got %v, want %v", got, -1)
	}
}

func TestPartialInOrderCommit(t *testing.T) {
	t.Parallel()
	for i, tc := range []struct {
		name      string
		size      int64
		knownSize bool
	}{
		{"empty", 0, true},
		{"empty size learned late", 0, false},
		{"one byte", 1, true},
		{"under HoldBack", HoldBack - 1, true},
		{"HoldBack", HoldBack, true},
		{"three HoldBacks and a bit", 3*HoldBack + 5, true},
		{"1MiB size learned late", 1<<20 + 3, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := openStore(t) // the empty cases share a digest
			data := randomBytes(uint64(100+i), int(tc.size))
			d := digest.FromBytes(data)
			size := int64(-1)
			if tc.knownSize {
				size = tc.size
			}
			p := newTestPartial(t, s, d, size)
			for _, sp := range chunks(tc.size, 64<<10) {
				writeSpans(t, p, data, []span{sp})
				if got := p.Written(); got != sp.end {
					t.Fatalf("Written() after writing up to %d: got %v, want %v", sp.end, got, sp.end)
				}
			}
			if !tc.knownSize {
				if err := p.SetSize(tc.size); err != nil {
					t.Fatalf("SetSize: %v", err)
				}
			}
			if err := p.Commit(t.Context()); err != nil {
				t.Fatalf("Commit: got %v, want nil", err)
			}
			if !p.Committed() || p.Err() != nil {
				t.Errorf("after Commit: got committed %v err %v, want true, nil", p.Committed(), p.Err())
			}
			if got := p.Written(); got != tc.size {
				t.Errorf("Written() after Commit: got %v, want %v", got, tc.size)
			}
			if _, err := os.Stat(p.path); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("partial file after Commit: got %v, want %v", err, fs.ErrNotExist)
			}
			checkStored(t, s, d, data)
		})
	}
}

func TestPartialOutOfOrderCommit(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	// Larger than catchUpHash's 256 KiB buffer, and chunks that do not divide it.
	const size = 1<<20 + 1234
	const chunk = 10007
	shuffled := func(seed uint64) []span {
		c := chunks(size, chunk)
		rand.New(rand.NewPCG(seed, seed)).Shuffle(len(c), func(i, j int) { c[i], c[j] = c[j], c[i] })
		return c
	}
	reversed := chunks(size, chunk)
	for i, j := 0, len(reversed)-1; i < j; i, j = i+1, j-1 {
		reversed[i], reversed[j] = reversed[j], reversed[i]
	}
	var evenOdd []span
	for _, parity := range []int{0, 1} {
		for i, c := range chunks(size, chunk) {
			if i%2 == parity {
				evenOdd = append(evenOdd, c)
			}
		}
	}
	// Every byte written twice, each write overlapping the one before: front
	// to back, a write straddles the hashed prefix; back to front, it is ahead
	// of it.
	var overlapping, overlappingBack []span
	for i := range chunks(size, chunk) {
		overlapping = append(overlapping, span{int64(i) * chunk, min(int64(i+2)*chunk, size)})
	}
	for _, sp := range slices.Backward(overlapping) {
		overlappingBack = append(overlappingBack, sp)
	}
	for i, tc := range []struct {
		name    string
		order   []span
		writers int
	}{
		{"reversed", reversed, 1},
		{"shuffled", shuffled(1), 1},
		{"even then odd", evenOdd, 1},
		{"overlapping", overlapping, 1},
		{"overlapping back to front", overlappingBack, 1},
		{"overlapping by 4 goroutines", overlapping, 4},
		{"last chunk first", append(chunks(size, chunk)[len(chunks(size, chunk))-1:], chunks(size, chunk)[:len(chunks(size, chunk))-1]...), 1},
		{"shuffled by 4 goroutines", shuffled(2), 4},
		{"in order by 8 goroutines", chunks(size, chunk), 8},
		{"reversed by 3 goroutines", reversed, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			data := randomBytes(uint64(200+i), size)
			d := digest.FromBytes(data)
			p := newTestPartial(t, s, d, size)

			work := make(chan span, len(tc.order))
			for _, sp := range tc.order {
				work <- sp
			}
			close(work)
			errs := make(chan error, len(tc.order))
			var wg sync.WaitGroup
			for range tc.writers {
				wg.Go(func() {
					for sp := range work {
						if _, err := p.WriteAt(data[sp.start:sp.end], sp.start); err != nil {
							errs <- err
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatalf("WriteAt: got %v, want nil", err)
			}
			if got := p.Written(); got != size {
				t.Fatalf("Written(): got %v, want %v", got, size)
			}
			if err := p.Commit(t.Context()); err != nil {
				t.Fatalf("Commit: got %v, want nil", err)
			}
			checkStored(t, s, d, data)
		})
	}
}

func TestPartialCommitDigestMismatch(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const size = 3 * HoldBack
	for i, tc := range []struct {
		name  string
		order func([]span) []span
	}{
		{"in order", func(c []span) []span { return c }},
		{"reversed", func(c []span) []span {
			for i, j := 0, len(c)-1; i < j; i, j = i+1, j-1 {
				c[i], c[j] = c[j], c[i]
			}
			return c
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			want := randomBytes(uint64(300+i), size)
			d := digest.FromBytes(want)
			got := bytes.Clone(want)
			got[size-1] ^= 0xff // corrupted in the last byte, the one readers would see last
			p := newTestPartial(t, s, d, size)
			writeSpans(t, p, got, tc.order(chunks(size, 50000)))

			ctx := t.Context()
			waiter := make(chan error, 1)
			go func() {
				_, err := p.WaitAvailable(ctx, size-HoldBack)
				waiter <- err
			}()

			err := p.Commit(ctx)
			if !errors.Is(err, ErrDigestMismatch) {
				t.Fatalf("Commit: got %v, want %v", err, ErrDigestMismatch)
			}
			if err := <-waiter; !errors.Is(err, ErrDigestMismatch) {
				t.Errorf("waiter for the held-back bytes: got %v, want %v", err, ErrDigestMismatch)
			}
			if err := p.Err(); !errors.Is(err, ErrDigestMismatch) {
				t.Errorf("Err(): got %v, want %v", err, ErrDigestMismatch)
			}
			if _, err := p.WaitAvailable(ctx, size-HoldBack); !errors.Is(err, ErrDigestMismatch) {
				t.Errorf("WaitAvailable after the failure: got %v, want %v", err, ErrDigestMismatch)
			}
			if f, err := p.Open(); !errors.Is(err, ErrDigestMismatch) {
				if f != nil {
					f.Close()
				}
				t.Errorf("Open after the failure: got %v, want %v", err, ErrDigestMismatch)
			}
			checkDiscarded(t, s, p)
			if _, err := s.Blob(ctx, d); !errors.Is(err, ErrNotFound) {
				t.Errorf("Blob after the failure: got %v, want %v", err, ErrNotFound)
			}
		})
	}
}

// TestPartialRetract: a download whose digest failed keeps every byte but
// those retracted: its readers end with the cause (they may hold retracted
// bytes), and the next download of the digest resumes with exactly the
// retracted spans missing and commits once they are written right. The
// running hash starts over: the bytes it had covered included bad ones.
func TestPartialRetract(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const size = 5 * HoldBack
	for i, tc := range []struct {
		name string
		bad  span   // written wrong
		drop []span // retracted
		kept bool   // the retracted spans cover the bad bytes: the resumed download commits
	}{
		{"the bad span", span{HoldBack, 2 * HoldBack}, []span{{HoldBack, 2 * HoldBack}}, true},
		{"spans around the bad one", span{HoldBack + 10, HoldBack + 20}, []span{{0, 100}, {HoldBack, 2 * HoldBack}, {4 * HoldBack, size}}, true},
		{"the first byte", span{0, 1}, []span{{0, 1000}}, true},
		{"another span than the bad one", span{HoldBack, 2 * HoldBack}, []span{{3 * HoldBack, 4 * HoldBack}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			want := randomBytes(uint64(700+i), size)
			d := digest.FromBytes(want)
			got := bytes.Clone(want)
			for j := tc.bad.start; j < tc.bad.end; j++ {
				got[j] ^= 0xa5
			}
			p, err := s.NewPartial(ctx, d, size)
			if err != nil {
				t.Fatalf("NewPartial: %v", err)
			}
			writeSpans(t, p, got, chunks(size, 40000))
			waiter := make(chan error, 1)
			go func() {
				_, err := p.WaitAvailable(ctx, size-HoldBack)
				waiter <- err
			}()
			err = p.Verify()
			if !errors.Is(err, ErrDigestMismatch) {
				t.Fatalf("Verify: got %v, want %v", err, ErrDigestMismatch)
			}
			if err := p.Err(); err != nil {
				t.Fatalf("Err() after a failed Verify: got %v, want nil: the owner decides", err)
			}
			var drop []spans.Span
			for _, sp := range tc.drop {
				drop = append(drop, spans.Span{Start: sp.start, End: sp.end})
			}
			if err := p.Retract(drop, err); err != nil {
				t.Fatalf("Retract: %v", err)
			}
			if err := <-waiter; !errors.Is(err, ErrDigestMismatch) {
				t.Errorf("reader waiting for the held-back bytes: got %v, want %v", err, ErrDigestMismatch)
			}
			if err := p.Retract(drop, err); err == nil {
				t.Errorf("Retract of an ended download: got nil, want an error")
			}

			q, err := s.NewPartial(ctx, d, size)
			if err != nil {
				t.Fatalf("NewPartial after Retract: %v", err)
			}
			t.Cleanup(func() { q.Fail(nil) })
			var missing []span
			for off := int64(0); ; {
				a, z := q.Missing(off)
				if a >= z {
					break
				}
				missing = append(missing, span{a, z})
				off = z
			}
			var wantMissing spans.Set
			for _, sp := range tc.drop {
				wantMissing.Add(sp.start, sp.end)
			}
			if len(missing) != len(wantMissing) {
				t.Fatalf("missing after resuming: got %v, want %v", missing, wantMissing)
			}
			for j, m := range missing {
				if m.start != wantMissing[j].Start || m.end != wantMissing[j].End {
					t.Fatalf("missing after resuming: got %v, want %v", missing, wantMissing)
				}
			}
			writeSpans(t, q, want, missing)
			err = q.Commit(ctx)
			if !tc.kept {
				if !errors.Is(err, ErrDigestMismatch) {
					t.Fatalf("Commit with the bad bytes kept: got %v, want %v", err, ErrDigestMismatch)
				}
				return
			}
			if err != nil {
				t.Fatalf("Commit after writing the retracted spans again: %v", err)
			}
			checkStored(t, s, d, want)
		})
	}
}

func TestPartialCommitIncomplete(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const size = 1000
	for i, tc := range []struct {
		name    string
		setSize int64 // before writing; -1 for none
		writes  []span
		late    int64 // SetSize after writing; -1 for none
	}{
		{"size never learned", -1, []span{{0, size}}, -1},
		{"nothing written", size, nil, -1},
		{"gap in the middle", size, []span{{0, 400}, {500, size}}, -1},
		{"first byte missing", size, []span{{1, size}}, -1},
		{"last byte missing", size, []span{{0, size - 1}}, -1},
		{"more written than the size learned later", -1, []span{{0, size + 10}}, size},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			data := randomBytes(uint64(400+i), size+10)
			d := digest.FromBytes(data[:size])
			p := newTestPartial(t, s, d, tc.setSize)
			writeSpans(t, p, data, tc.writes)
			if tc.late >= 0 {
				if err := p.SetSize(tc.late); err != nil {
					t.Fatalf("SetSize: %v", err)
				}
			}
			if err := p.Commit(t.Context()); !errors.Is(err, ErrSizeMismatch) {
				t.Fatalf("Commit: got %v, want %v", err, ErrSizeMismatch)
			}
			if err := p.Err(); !errors.Is(err, ErrSizeMismatch) {
				t.Errorf("Err(): got %v, want %v", err, ErrSizeMismatch)
			}
			checkDiscarded(t, s, p)
		})
	}
}

func TestPartialWriteAtPastSize(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	for i, tc := range []struct {
		name    string
		size    int64
		off     int64
		n       int
		wantErr bool
	}{
		{"whole blob", 100, 0, 100, false},
		{"last byte", 100, 99, 1, false},
		{"empty write at the end", 100, 100, 0, false},
		{"one byte over", 100, 99, 2, true},
		{"at the end", 100, 100, 1, true},
		{"far past the end", 100, 1 << 30, 1, true},
		{"longer than the blob", 100, 0, 101, true},
		{"empty blob", 0, 0, 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newTestPartial(t, s, digest.FromString(tc.name), tc.size)
			n, err := p.WriteAt(randomBytes(uint64(500+i), tc.n), tc.off)
			if !tc.wantErr {
				if err != nil || n != tc.n {
					t.Fatalf("WriteAt: got %v, %v, want %v, nil", n, err, tc.n)
				}
				return
			}
			if !errors.Is(err, ErrSizeMismatch) {
				t.Errorf("WriteAt: got %v, want %v", err, ErrSizeMismatch)
			}
			if n != 0 {
				t.Errorf("WriteAt bytes written: got %v, want %v", n, 0)
			}
			if got := p.Written(); got != 0 {
				t.Errorf("Written(): got %v, want %v", got, 0)
			}
			fi, err := os.Stat(p.path)
			if err != nil || fi.Size() != 0 {
				t.Errorf("partial file: got %v, %v, want an empty file", fi, err)
			}
			if err := p.Err(); err != nil {
				t.Errorf("Err() after a refused write: got %v, want nil", err)
			}
		})
	}
}

func TestPartialSetSize(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	type call struct {
		n       int64
		wantErr error // nil, ErrSizeMismatch, or errAny
	}
	errAny := errors.New("any error")
	for _, tc := range []struct {
		name     string
		initial  int64
		calls    []call
		wantSize int64
	}{
		{"set once", -1, []call{{10, nil}}, 10},
		{"same twice", -1, []call{{10, nil}, {10, nil}}, 10},
		{"different", -1, []call{{10, nil}, {11, ErrSizeMismatch}, {9, ErrSizeMismatch}}, 10},
		{"same as given to NewPartial", 10, []call{{10, nil}}, 10},
		{"different from NewPartial's", 10, []call{{0, ErrSizeMismatch}}, 10},
		{"zero", -1, []call{{0, nil}, {0, nil}, {1, ErrSizeMismatch}}, 0},
		{"negative", -1, []call{{-1, errAny}}, -1},
		{"negative after set", 10, []call{{-5, errAny}}, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newTestPartial(t, s, digest.FromString(tc.name), tc.initial)
			for _, c := range tc.calls {
				err := p.SetSize(c.n)
				switch {
				case c.wantErr == nil && err != nil,
					c.wantErr == errAny && err == nil,
					c.wantErr == ErrSizeMismatch && !errors.Is(err, ErrSizeMismatch):
					t.Errorf("SetSize(%d): got %v, want %v", c.n, err, c.wantErr)
				}
			}
			if got := p.Size(); got != tc.wantSize {
				t.Errorf("Size(): got %v, want %v", got, tc.wantSize)
			}
			if err := p.Err(); err != nil {
				t.Errorf("Err(): got %v, want nil (a refused size does not fail the download)", err)
			}
		})
	}
}

// Tests in a synctest bubble open a store in the bubble: Badger closes
// channels a transaction makes from its own goroutines, and a channel made
// in a bubble and closed from outside it is a fatal error.
func TestPartialWaitSize(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	errUpstream := errors.New("upstream went away")
	for _, tc := range []struct {
		name    string
		act     func(p *Partial, cancel context.CancelFunc)
		want    int64
		wantErr error
	}{
		{"SetSize", func(p *Partial, _ context.CancelFunc) { p.SetSize(42) }, 42, nil},
		{"SetSize zero", func(p *Partial, _ context.CancelFunc) { p.SetSize(0) }, 0, nil},
		{"cancelled", func(_ *Partial, cancel context.CancelFunc) { cancel() }, 0, context.Canceled},
		{"failed", func(p *Partial, _ context.CancelFunc) { p.Fail(errUpstream) }, 0, errUpstream},
		{"write without size", func(p *Partial, cancel context.CancelFunc) {
			p.WriteAt([]byte("bytes"), 0)
			synctest.Wait() // still waiting: bytes are no size
			cancel()
		}, 0, context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				s := openStore(t) // its own: Badger's goroutines in the bubble (see TestPartialWaitSize)
				p, err := s.NewPartial(t.Context(), digest.FromString(tc.name), -1)
				if err != nil {
					t.Fatal(err)
				}
				defer p.Fail(nil)
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				type result struct {
					n   int64
					err error
				}
				done := make(chan result, 1)
				go func() {
					n, err := p.WaitSize(ctx)
					done <- result{n, err}
				}()
				synctest.Wait()
				select {
				case r := <-done:
					t.Fatalf("WaitSize before the size is known: got %v, %v, want it to block", r.n, r.err)
				default:
				}
				tc.act(p, cancel)
				synctest.Wait()
				select {
				case r := <-done:
					if r.n != tc.want || !errors.Is(r.err, tc.wantErr) || (tc.wantErr == nil && r.err != nil) {
						t.Errorf("WaitSize: got %v, %v, want %v, %v", r.n, r.err, tc.want, tc.wantErr)
					}
				default:
					t.Fatalf("WaitSize: still blocked, want %v, %v", tc.want, tc.wantErr)
				}
			})
		})
	}

	t.Run("deadline", func(t *testing.T) {
		t.Parallel()
		synctest.Test(t, func(t *testing.T) {
			s := openStore(t) // its own: Badger's goroutines in the bubble (see TestPartialWaitSize)
			p, err := s.NewPartial(t.Context(), digest.FromString("deadline"), -1)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Fail(nil)
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			start := time.Now()
			if _, err := p.WaitSize(ctx); !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("WaitSize: got %v, want %v", err, context.DeadlineExceeded)
			}
			if got := time.Since(start); got != time.Minute {
				t.Errorf("WaitSize waited: got %v, want %v", got, time.Minute)
			}
		})
	})

	t.Run("known", func(t *testing.T) {
		t.Parallel()
		p := newTestPartial(t, s, digest.FromString("known"), 7)
		if n, err := p.WaitSize(cancelledContext()); n != 7 || err != nil {
			t.Errorf("WaitSize of a known size: got %v, %v, want %v, nil", n, err, 7)
		}
		// A download that failed after its size was known still reports it.
		p.Fail(errUpstream)
		if n, err := p.WaitSize(cancelledContext()); n != 7 || err != nil {
			t.Errorf("WaitSize after Fail: got %v, %v, want %v, nil", n, err, 7)
		}
	})
}

// TestPartialWaitAvailable probes WaitAvailable with a cancelled context, so a
// wait that would block returns context.Canceled instead.
func TestPartialWaitAvailable(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const H = HoldBack
	const blocks, eof = -1, -2
	for i, tc := range []struct {
		name    string
		size    int64
		unknown bool // size not yet given to the Partial
		writes  []span
		commit  bool
		off     int64
		want    int64 // or blocks, or eof
	}{
		{"size unknown", 3 * H, true, []span{{0, 3 * H}}, false, 0, blocks},
		{"nothing written", 3 * H, false, nil, false, 0, blocks},
		{"prefix written", 3 * H, false, []span{{0, H}}, false, 0, H},
		{"at the end of the prefix", 3 * H, false, []span{{0, H}}, false, H, blocks},
		{"all written", 3 * H, false, []span{{0, 3 * H}}, false, 0, 2 * H},
		{"all written, from the middle", 3 * H, false, []span{{0, 3 * H}}, false, H, H},
		{"last byte before the hold-back", 3 * H, false, []span{{0, 3 * H}}, false, 2*H - 1, 1},
		{"start of the hold-back", 3 * H, false, []span{{0, 3 * H}}, false, 2 * H, blocks},
		{"last byte", 3 * H, false, []span{{0, 3 * H}}, false, 3*H - 1, blocks},
		{"at the size", 3 * H, false, []span{{0, 3 * H}}, false, 3 * H, eof},
		{"past the size", 3 * H, false, []span{{0, 3 * H}}, false, 4 * H, eof},
		{"committed, at the size", 3 * H, false, []span{{0, 3 * H}}, true, 3 * H, eof},
		{"before a gap", 3 * H, false, []span{{0, H}, {H + 1, 3 * H}}, false, 0, H},
		{"in a gap", 3 * H, false, []span{{0, H}, {H + 1, 3 * H}}, false, H, blocks},
		{"after a gap", 3 * H, false, []span{{0, H}, {H + 1, 3 * H}}, false, H + 1, H - 1},
		{"smaller than HoldBack", H - 1, false, []span{{0, H - 1}}, false, 0, blocks},
		{"exactly HoldBack", H, false, []span{{0, H}}, false, 0, blocks},
		{"one byte", 1, false, []span{{0, 1}}, false, 0, blocks},
		{"committed", 3 * H, false, []span{{0, 3 * H}}, true, 0, 3 * H},
		{"committed, start of the hold-back", 3 * H, false, []span{{0, 3 * H}}, true, 2 * H, H},
		{"committed, last byte", 3 * H, false, []span{{0, 3 * H}}, true, 3*H - 1, 1},
		{"committed, smaller than HoldBack", H - 1, false, []span{{0, H - 1}}, true, 0, H - 1},
		{"committed, one byte", 1, false, []span{{0, 1}}, true, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			data := randomBytes(uint64(600+i), int(tc.size))
			size := tc.size
			if tc.unknown {
				size = -1
			}
			p := newTestPartial(t, s, digest.FromBytes(data), size)
			writeSpans(t, p, data, tc.writes)
			if tc.commit {
				if err := p.Commit(t.Context()); err != nil {
					t.Fatalf("Commit: %v", err)
				}
			}
			n, err := p.WaitAvailable(cancelledContext(), tc.off)
			if tc.want == eof {
				if n != 0 || err != io.EOF {
					t.Errorf("WaitAvailable(%d): got %v, %v, want 0, EOF", tc.off, n, err)
				}
				return
			}
			if tc.want == blocks {
				if !errors.Is(err, context.Canceled) {
					t.Errorf("WaitAvailable(%d): got %v, %v, want it to block", tc.off, n, err)
				}
				return
			}
			if n != tc.want || err != nil {
				t.Errorf("WaitAvailable(%d): got %v, %v, want %v, nil", tc.off, n, err, tc.want)
			}
		})
	}
}

func TestPartialWaitAvailableBlocks(t *testing.T) {
	t.Parallel()
	const H = HoldBack
	const size = 3 * H
	errUpstream := errors.New("connection reset")
	synctest.Test(t, func(t *testing.T) {
		s := openStore(t) // its own: Badger's goroutines in the bubble (see TestPartialWaitSize)
		data := randomBytes(700, size)
		p, err := s.NewPartial(t.Context(), digest.FromBytes(data), size)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Fail(nil)
		ctx := t.Context()
		type result struct {
			n   int64
			err error
		}
		wait := func(off int64) chan result {
			c := make(chan result, 1)
			go func() {
				n, err := p.WaitAvailable(ctx, off)
				c <- result{n, err}
			}()
			return c
		}
		blocked := func(what string, c chan result) {
			t.Helper()
			synctest.Wait()
			select {
			case r := <-c:
				t.Fatalf("%s: got %v, %v, want it to block", what, r.n, r.err)
			default:
			}
		}
		returned := func(what string, c chan result, want int64, wantErr error) {
			t.Helper()
			synctest.Wait()
			select {
			case r := <-c:
				if r.n != want || !errors.Is(r.err, wantErr) || (wantErr == nil && r.err != nil) {
					t.Errorf("%s: got %v, %v, want %v, %v", what, r.n, r.err, want, wantErr)
				}
			default:
				t.Fatalf("%s: still blocked, want %v, %v", what, want, wantErr)
			}
		}

		first := wait(0)
		blocked("WaitAvailable(0) with nothing written", first)
		writeSpans(t, p, data, []span{{H, 2 * H}})
		blocked("WaitAvailable(0) with bytes written further on", first)
		writeSpans(t, p, data, []span{{0, H}})
		returned("WaitAvailable(0) once the prefix joins up", first, 2*H, nil)

		tail := wait(2 * H)
		blocked("WaitAvailable(size-HoldBack)", tail)
		writeSpans(t, p, data, []span{{2 * H, 3 * H}})
		blocked("WaitAvailable(size-HoldBack) with every byte written", tail)
		p.Fail(errUpstream)
		returned("WaitAvailable(size-HoldBack) when the download fails", tail, 0, errUpstream)
	})
}

// TestPartialHoldBackReleasedByCommit checks that the last HoldBack bytes (or
// all of a smaller blob) are withheld until Commit, and that Commit wakes the
// readers waiting for them.
func TestPartialHoldBackReleasedByCommit(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	for i, tc := range []struct {
		name string
		size int64
	}{
		{"three HoldBacks", 3 * HoldBack},
		{"three HoldBacks and a byte", 3*HoldBack + 1},
		{"HoldBack", HoldBack},
		{"under HoldBack", HoldBack - 1},
		{"one byte", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			data := randomBytes(uint64(800+i), int(tc.size))
			p := newTestPartial(t, s, digest.FromBytes(data), tc.size)
			writeSpans(t, p, data, chunks(tc.size, 64<<10))
			if got := p.Written(); got != tc.size {
				t.Fatalf("Written(): got %v, want %v", got, tc.size)
			}
			held := max(tc.size-HoldBack, 0)
			if n, err := p.WaitAvailable(cancelledContext(), held); !errors.Is(err, context.Canceled) {
				t.Fatalf("WaitAvailable(%d) before Commit: got %v, %v, want it to block", held, n, err)
			}
			ctx := t.Context()
			type result struct {
				n   int64
				err error
			}
			waiter := make(chan result, 1)
			go func() {
				n, err := p.WaitAvailable(ctx, held)
				waiter <- result{n, err}
			}()
			if err := p.Commit(ctx); err != nil {
				t.Fatalf("Commit: %v", err)
			}
			if r := <-waiter; r.n != tc.size-held || r.err != nil {
				t.Errorf("waiter for the held-back bytes: got %v, %v, want %v, nil", r.n, r.err, tc.size-held)
			}
			if n, err := p.WaitAvailable(cancelledContext(), held); n != tc.size-held || err != nil {
				t.Errorf("WaitAvailable(%d) after Commit: got %v, %v, want %v, nil", held, n, err, tc.size-held)
			}
		})
	}
}

func TestPartialOpenAcrossCommit(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const size = 2*HoldBack + 3
	data := randomBytes(900, size)
	d := digest.FromBytes(data)
	p := newTestPartial(t, s, d, -1)

	open := func(when string) *os.File {
		t.Helper()
		f, err := p.Open()
		if err != nil {
			t.Fatalf("Open %s: %v", when, err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	beforeWrites := open("before any write")
	if err := p.SetSize(size); err != nil {
		t.Fatal(err)
	}
	writeSpans(t, p, data, chunks(size, 50000))
	beforeCommit := open("before Commit")
	if err := p.Commit(t.Context()); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	afterCommit := open("after Commit")
	if got, want := afterCommit.Name(), s.blobPath(d); got != want {
		t.Errorf("handle opened after Commit reads: got %v, want %v", got, want)
	}
	for name, f := range map[string]*os.File{
		"opened before any write": beforeWrites,
		"opened before Commit":    beforeCommit,
		"opened after Commit":     afterCommit,
	} {
		if got := readAll(t, f); !bytes.Equal(got, data) {
			t.Errorf("handle %s: got %d bytes, want the %d written", name, len(got), len(data))
		}
	}
}

func TestPartialFail(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	errFirst := errors.New("first failure")
	errSecond := errors.New("second failure")

	t.Run("twice", func(t *testing.T) {
		t.Parallel()
		data := randomBytes(1000, 100)
		p := newTestPartial(t, s, digest.FromBytes(data), 100)
		writeSpans(t, p, data, []span{{0, 100}})
		p.Fail(errFirst)
		p.Fail(errSecond)
		if err := p.Err(); err != errFirst {
			t.Errorf("Err(): got %v, want %v", err, errFirst)
		}
		if f, err := p.Open(); err != errFirst {
			if f != nil {
				f.Close()
			}
			t.Errorf("Open(): got %v, want %v", err, errFirst)
		}
		if n, err := p.WaitAvailable(t.Context(), 0); err != errFirst {
			t.Errorf("WaitAvailable(0): got %v, %v, want 0, %v", n, err, errFirst)
		}
		// Every byte is there and hashes right, but a failed download stays failed.
		if err := p.Commit(t.Context()); err == nil {
			t.Errorf("Commit after Fail: got %v, want an error", err)
		}
		if err := p.Err(); err != errFirst {
			t.Errorf("Err() after Commit: got %v, want %v", err, errFirst)
		}
		checkDiscarded(t, s, p)
	})

	t.Run("nil error", func(t *testing.T) {
		t.Parallel()
		p := newTestPartial(t, s, digest.FromString("nil error"), -1)
		p.Fail(nil)
		if err := p.Err(); err == nil {
			t.Errorf("Err() after Fail(nil): got %v, want an error", err)
		}
		if _, err := p.WaitSize(t.Context()); err == nil {
			t.Errorf("WaitSize after Fail(nil): got %v, want an error", err)
		}
		checkDiscarded(t, s, p)
	})

	t.Run("after Commit", func(t *testing.T) {
		t.Parallel()
		data := randomBytes(1001, 3*HoldBack)
		d := digest.FromBytes(data)
		p := newTestPartial(t, s, d, int64(len(data)))
		writeSpans(t, p, data, chunks(int64(len(data)), 64<<10))
		if err := p.Commit(t.Context()); err != nil {
			t.Fatalf("Commit: %v", err)
		}
		p.Fail(errFirst)
		if err := p.Err(); err != nil {
			t.Errorf("Err(): got %v, want nil", err)
		}
		if !p.Committed() {
			t.Errorf("Committed(): got %v, want %v", false, true)
		}
		if n, err := p.WaitAvailable(t.Context(), 0); n != int64(len(data)) || err != nil {
			t.Errorf("WaitAvailable(0): got %v, %v, want %v, nil", n, err, len(data))
		}
		f, err := p.Open()
		if err != nil {
			t.Fatalf("Open(): got %v, want nil", err)
		}
		defer f.Close()
		if got := readAll(t, f); !bytes.Equal(got, data) {
			t.Errorf("Open() content: got %d bytes, want the %d written", len(got), len(data))
		}
		checkStored(t, s, d, data)
	})

	t.Run("writes after Fail", func(t *testing.T) {
		t.Parallel()
		p := newTestPartial(t, s, digest.FromString("writes after fail"), 10)
		p.Fail(errFirst)
		if _, err := p.WriteAt([]byte("x"), 0); err == nil {
			t.Errorf("WriteAt after Fail: got %v, want an error", err)
		}
	})
}

// TestPartialConcurrentReaders streams a download to several readers while it
// is written, as the proxy does; run it with -race.
func TestPartialConcurrentReaders(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	const size = 4<<20 + 12345
	const readers = 6
	data := randomBytes(1100, size)
	d := digest.FromBytes(data)
	p := newTestPartial(t, s, d, -1)
	// A safety net against a hang, not a wait.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()

	// Readers open their handle at the start or once the first bytes are in;
	// the writer commits only when all have one, because Open fails with "file
	// keeps moving" if called between Commit's rename and the point where
	// Commit records the new path.
	var opened sync.WaitGroup
	opened.Add(readers)
	read := func(openLate bool, opening *sync.WaitGroup) ([]byte, error) {
		signal := func() {}
		if opening != nil {
			signal = sync.OnceFunc(opening.Done)
		}
		defer signal() // even if the reader gives up before opening
		var f *os.File
		open := func() error {
			var err error
			f, err = p.Open()
			signal()
			return err
		}
		if !openLate {
			if err := open(); err != nil {
				return nil, err
			}
			defer f.Close()
		}
		n, err := p.WaitSize(ctx)
		if err != nil {
			return nil, err
		}
		got := make([]byte, n)
		for off := int64(0); off < n; {
			avail, err := p.WaitAvailable(ctx, off)
			if err != nil {
				return got[:off], err
			}
			if f == nil {
				if err := open(); err != nil {
					return got[:off], err
				}
				defer f.Close()
			}
			if _, err := f.ReadAt(got[off:off+avail], off); err != nil {
				return got[:off], err
			}
			off += avail
		}
		return got, nil
	}

	type result struct {
		b   []byte
		err error
	}
	results := make(chan result, readers+1)
	var wg sync.WaitGroup
	for i := range readers {
		wg.Go(func() {
			b, err := read(i%2 == 1, &opened)
			results <- result{b, err}
		})
	}

	writeErr := func() error {
		if err := p.SetSize(size); err != nil {
			return err
		}
		for _, sp := range chunks(size, 64<<10) {
			if _, err := p.WriteAt(data[sp.start:sp.end], sp.start); err != nil {
				return err
			}
		}
		opened.Wait()
		return p.Commit(ctx)
	}()
	if writeErr != nil {
		t.Errorf("writer: got %v, want nil", writeErr)
	}
	// One more reader that only arrives after the commit.
	wg.Go(func() {
		b, err := read(false, nil)
		results <- result{b, err}
	})
	wg.Wait()
	close(results)
	i := 0
	for r := range results {
		if r.err != nil {
			t.Errorf("reader %d: got %v after %d bytes, want nil", i, r.err, len(r.b))
		} else if !bytes.Equal(r.b, data) {
			t.Errorf("reader %d: got %d bytes differing from the %d written", i, len(r.b), len(data))
		}
		i++
	}
	checkStored(t, s, d, data)
}

// TestPartialWriteAtAllocs: writing a blob in order with nobody waiting, the
// hot path, allocates nothing per write. Not parallel: AllocsPerRun counts
// every goroutine's allocations.
func TestPartialWriteAtAllocs(t *testing.T) {
	s := openStore(t)
	const chunk, runs = 4096, 200
	data := randomBytes(1200, chunk*(runs+1))
	p := newTestPartial(t, s, digest.FromBytes(data), int64(len(data)))
	off := int64(0)
	allocs := testing.AllocsPerRun(runs, func() {
		if _, err := p.WriteAt(data[off:off+chunk], off); err != nil {
			t.Fatal(err)
		}
		off += chunk
	})
	if allocs != 0 {
		t.Errorf("allocations per WriteAt: got %v, want %v", allocs, 0)
	}
}

// TestPartialWaitStarted probes WaitStarted with a cancelled context, so a
// wait that would block returns context.Canceled instead.
func TestPartialWaitStarted(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	errUpstream := errors.New("upstream refused")
	const size = 3 * HoldBack
	data := randomBytes(1300, size)
	blocks := context.Canceled
	fresh := func(size int64) func(t *testing.T) *Partial {
		return func(t *testing.T) *Partial { return newTestPartial(t, s, digest.FromString(t.Name()), size) }
	}
	// A download left complete on disk by an earlier run, resumed.
	resumed := func(t *testing.T) *Partial {
		t.Helper()
		s := openStore(t)
		d := digest.FromBytes(data)
		p := newTestPartial(t, s, d, size)
		writeSpans(t, p, data, []span{{0, size}})
		p.Abandon(nil)
		q := newTestPartial(t, s, d, size)
		if got := q.Written(); got != size {
			t.Fatalf("resumed download's Written(): got %v, want %v", got, size)
		}
		return q
	}
	for _, tc := range []struct {
		name    string
		start   func(t *testing.T) *Partial
		act     func(p *Partial)
		want    int64
		wantErr error // nil, errUpstream, or blocks
	}{
		{"nothing written", fresh(size), func(*Partial) {}, 0, blocks},
		{"size learned, nothing written", fresh(-1), func(p *Partial) { p.SetSize(size) }, 0, blocks},
		{"a byte written", fresh(size), func(p *Partial) { p.WriteAt(data[5:6], 5) }, size, nil},
		{"a byte written, size unknown", fresh(-1), func(p *Partial) { p.WriteAt(data[:1], 0) }, 0, blocks},
		{"a byte written, then the size", fresh(-1), func(p *Partial) {
			p.WriteAt(data[:1], 0)
			p.SetSize(size)
		}, size, nil},
		{"an empty write", fresh(size), func(p *Partial) { p.WriteAt(nil, 0) }, 0, blocks},
		{"a write refused past the size", fresh(1), func(p *Partial) { p.WriteAt(data[:2], 0) }, 0, blocks},
		{"failed", fresh(size), func(p *Partial) { p.Fail(errUpstream) }, 0, errUpstream},
		{"abandoned", fresh(size), func(p *Partial) { p.Abandon(errUpstream) }, 0, errUpstream},
		{"failed after a byte", fresh(size), func(p *Partial) {
			p.WriteAt(data[:1], 0)
			p.Fail(errUpstream)
		}, size, nil},
		{"resumed, nothing written", resumed, func(*Partial) {}, 0, blocks},
		{"resumed, upstream resends bytes on disk", resumed, func(p *Partial) { p.WriteAt(data[:10], 0) }, size, nil},
		{"resumed, committed", resumed, func(p *Partial) { p.Commit(context.Background()) }, size, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := tc.start(t)
			if n, err := p.WaitStarted(cancelledContext()); !errors.Is(err, blocks) {
				t.Fatalf("WaitStarted before anything happened: got %v, %v, want it to block", n, err)
			}
			tc.act(p)
			n, err := p.WaitStarted(cancelledContext())
			if n != tc.want || !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Errorf("WaitStarted: got %v, %v, want %v, %v", n, err, tc.want, tc.wantErr)
			}
		})
	}
}

// TestPartialWaitStartedWakes: a waiter is woken by the first byte, by the
// size learned after it, and by a failure.
func TestPartialWaitStartedWakes(t *testing.T) {
	t.Parallel()
	errUpstream := errors.New("upstream refused")
	for _, tc := range []struct {
		name    string
		size    int64
		act     func(p *Partial)
		want    int64
		wantErr error
	}{
		{"first byte", 10, func(p *Partial) { p.WriteAt([]byte("x"), 3) }, 10, nil},
		{"size after the first byte", -1, func(p *Partial) {
			p.WriteAt([]byte("x"), 3)
			synctest.Wait() // still waiting: a byte is no size
			p.SetSize(10)
		}, 10, nil},
		{"failure", 10, func(p *Partial) { p.Fail(errUpstream) }, 0, errUpstream},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				s := openStore(t) // its own: Badger's goroutines in the bubble (see TestPartialWaitSize)
				p, err := s.NewPartial(t.Context(), digest.FromString(tc.name), tc.size)
				if err != nil {
					t.Fatal(err)
				}
				defer p.Fail(nil)
				type result struct {
					n   int64
					err error
				}
				done := make(chan result, 1)
				go func() {
					n, err := p.WaitStarted(t.Context())
					done <- result{n, err}
				}()
				synctest.Wait()
				tc.act(p)
				synctest.Wait()
				select {
				case r := <-done:
					if r.n != tc.want || !errors.Is(r.err, tc.wantErr) || (tc.wantErr == nil && r.err != nil) {
						t.Errorf("WaitStarted: got %v, %v, want %v, %v", r.n, r.err, tc.want, tc.wantErr)
					}
				default:
					t.Fatalf("WaitStarted: still blocked, want %v, %v", tc.want, tc.wantErr)
				}
			})
		})
	}
}

// span is a byte range [start, end) the tests write.
type span struct{ start, end int64 }
