package storage

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"testing"

	"github.com/opencontainers/go-digest"
)

// TestIngestChecksClaims: an ingest's size and bytes are claims. A size no
// eviction could make room for is refused before anything is evicted; a
// blob the store holds is read and verified, and a size other than the
// one held is refused and not recorded; a blob the file system cannot
// take is refused whatever the max_size mode.
func TestIngestChecksClaims(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	held := randomBytes(1, 64<<10)
	hd := digest.FromBytes(held)
	if added, err := s.Ingest(ctx, hd, int64(len(held)), bytes.NewReader(held)); err != nil || !added {
		t.Fatalf("first ingest: added %v, %v", added, err)
	}
	other := randomBytes(2, 32<<10)
	if err := s.PutBlob(ctx, digest.FromBytes(other), other); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name string
		size int64
		body []byte
		want error
	}{
		{"held, a false size", 10 << 40, held, ErrTooLarge},
		{"held, a size one byte larger", int64(len(held)) + 1, append(held, 0), ErrSizeMismatch},
		{"held, other bytes", int64(len(held)), other[: len(held)/2 : len(held)/2], ErrSizeMismatch},
		{"held, altered bytes", int64(len(held)), flipped(held), ErrDigestMismatch},
	} {
		if _, err := s.Ingest(ctx, hd, tc.size, bytes.NewReader(tc.body)); !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
	if got, err := s.StatBlob(ctx, hd); err != nil || got != int64(len(held)) {
		t.Errorf("the held blob after the claims: %d bytes, %v; want %d", got, err, len(held))
	}
	if added, err := s.Ingest(ctx, hd, int64(len(held)), bytes.NewReader(held)); err != nil || added {
		t.Errorf("the held blob, its true bytes: added %v, %v; want not added, no error", added, err)
	}

	// In percent mode, 10 TiB on a 1 GiB file system: refused, nothing evicted.
	s.SetEviction(EvictionPolicy{MaxPercent: 85})
	s.space = func(string) (int64, int64, error) { return 100 << 20, 1 << 30, nil }
	if _, err := s.Ingest(ctx, digest.FromString("huge"), 10<<40, bytes.NewReader(nil)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("10 TiB: got %v, want ErrTooLarge", err)
	}
	if _, blobs := s.Usage(); blobs != 2 {
		t.Errorf("blobs after the refusals: %d, want 2", blobs)
	}
	if evicted, _ := s.Evictions(); evicted != 0 {
		t.Errorf("%d blobs evicted for claims", evicted)
	}

	// 60 MiB free, 51.2 MiB kept free: 20 MiB cannot be made room for
	// when every blob is pinned, in percent mode as with a byte count.
	s.SetEviction(EvictionPolicy{MaxPercent: 95, Pinned: func(context.Context) (map[digest.Digest]bool, error) {
		return map[digest.Digest]bool{hd: true, digest.FromBytes(other): true}, nil
	}})
	s.space = func(string) (int64, int64, error) { return 60 << 20, 1 << 30, nil }
	big := make([]byte, 20<<20)
	if _, err := s.Ingest(ctx, digest.FromBytes(big), int64(len(big)), bytes.NewReader(big)); !errors.Is(err, ErrNoSpace) {
		t.Errorf("20 MiB with no room to make: got %v, want ErrNoSpace", err)
	}
	if _, err := s.StatBlob(ctx, digest.FromBytes(big)); !errors.Is(err, ErrNotFound) {
		t.Errorf("the refused blob: %v, want not stored", err)
	}
}

// TestIngestBatchTakenBack: a batch abandoned, or left unfinished by a
// crash, leaves none of the blobs it added; blobs the store held before
// it stay.
func TestIngestBatchTakenBack(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	before := randomBytes(3, 4<<10)
	if err := s.PutBlob(ctx, digest.FromBytes(before), before); err != nil {
		t.Fatal(err)
	}
	ingest := func(b *IngestBatch, blobs ...[]byte) {
		for _, blob := range blobs {
			if _, err := b.Ingest(ctx, digest.FromBytes(blob), int64(len(blob)), bytes.NewReader(blob)); err != nil {
				t.Fatal(err)
			}
		}
	}
	a, b := randomBytes(4, 8<<10), randomBytes(5, 8<<10)
	abandoned, err := s.BeginIngest()
	if err != nil {
		t.Fatal(err)
	}
	ingest(abandoned, before, a)
	if err := abandoned.Abandon(ctx); err != nil {
		t.Fatal(err)
	}
	crashed, err := s.BeginIngest()
	if err != nil {
		t.Fatal(err)
	}
	ingest(crashed, b)
	if err := s.Close(); err != nil { // the batch never ends: a crash
		t.Fatal(err)
	}
	s = openStoreAt(t, dir)
	for _, tc := range []struct {
		blob []byte
		want bool
	}{{before, true}, {a, false}, {b, false}} {
		_, err := s.StatBlob(ctx, digest.FromBytes(tc.blob))
		if got := err == nil; got != tc.want {
			t.Errorf("blob %s held: %v, want %v", digest.FromBytes(tc.blob).Encoded()[:12], got, tc.want)
		}
	}
}

func flipped(b []byte) []byte {
	c := bytes.Clone(b)
	c[len(c)/2] ^= 1
	return c
}
