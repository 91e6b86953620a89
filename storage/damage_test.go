package storage

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// commitBlob stores b through a download, as a layer is stored.
func commitBlob(t *testing.T, s *Store, b []byte) digest.Digest {
	t.Helper()
	d := digest.FromBytes(b)
	p, err := s.NewPartial(t.Context(), d, int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.WriteAt(b, 0); err != nil {
		t.Fatal(err)
	}
	if err := p.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	return d
}

// damage changes blob d's file on disk as how says.
func damage(t *testing.T, s *Store, d digest.Digest, how string) {
	t.Helper()
	path := s.blobPath(d)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	switch how {
	case "flip":
		b[len(b)/2] ^= 0x20
	case "truncate":
		b = b[:100]
	case "grow":
		b = append(b, '\n')
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// checkQuarantined checks that d is no longer served, and that its file
// went to quarantine/.
func checkQuarantined(t *testing.T, s *Store, d digest.Digest, err error) {
	t.Helper()
	if !errors.Is(err, ErrNotFound) || !errors.Is(err, ErrDamaged) {
		t.Errorf("got %v, want ErrNotFound and ErrDamaged", err)
	}
	if _, err := os.Stat(s.blobPath(d)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("blob file still in place: %v", err)
	}
	q, _ := filepath.Glob(filepath.Join(s.Dir(), "quarantine", "sha256-"+d.Encoded()+"-*"))
	if len(q) != 1 {
		t.Errorf("quarantined files: got %q, want one", q)
	}
	if _, _, err := s.OpenBlob(t.Context(), d); !errors.Is(err, ErrNotFound) {
		t.Errorf("OpenBlob after quarantine: got %v, want ErrNotFound", err)
	}
}

// TestBlobOfWrongSizeIsNotServed: a blob file cut short or grown is found
// at the open that would serve it, and at a HEAD's stat.
func TestBlobOfWrongSizeIsNotServed(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"truncate", "grow"} {
		for _, read := range []string{"OpenBlob", "OpenBlobFD", "OpenBlobFD cached", "StatBlob"} {
			t.Run(how+"/"+read, func(t *testing.T) {
				t.Parallel()
				s := openStore(t)
				d := commitBlob(t, s, randomBytes(1, 4096))
				if read == "OpenBlobFD cached" { // its descriptor kept open from a read before the damage
					b, err := s.OpenBlobFD(t.Context(), d)
					if err != nil {
						t.Fatal(err)
					}
					b.Release()
				}
				damage(t, s, d, how)
				var err error
				switch read {
				case "OpenBlob":
					var f *os.File
					if f, _, err = s.OpenBlob(t.Context(), d); err == nil {
						f.Close()
					}
				case "OpenBlobFD", "OpenBlobFD cached":
					var b BlobFD
					if b, err = s.OpenBlobFD(t.Context(), d); err == nil {
						b.Release()
					}
				case "StatBlob":
					_, err = s.StatBlob(t.Context(), d)
				}
				checkQuarantined(t, s, d, err)
				if got := s.Damaged(); got != 1 {
					t.Errorf("Damaged: got %d, want 1", got)
				}
			})
		}
	}
}

// TestSizeKnownAfterReopen: the committed size is read back from the
// metadata after a restart.
func TestSizeKnownAfterReopen(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	d := commitBlob(t, s, randomBytes(2, 4096))
	s.Close()
	s = openStoreAt(t, dir)
	damage(t, s, d, "truncate")
	_, _, err = s.OpenBlob(t.Context(), d)
	checkQuarantined(t, s, d, err)
}

// TestManifestEditedOnDiskIsNotServed: a manifest is hashed at every read.
func TestManifestEditedOnDiskIsNotServed(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	m := []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}`)
	d := digest.FromBytes(m)
	if err := s.PutBlob(t.Context(), d, m); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ReadBlob(t.Context(), d, 1<<20); err != nil {
		t.Fatalf("ReadBlob of an intact manifest: %v", err)
	}
	damage(t, s, d, "flip") // same size: only the hash tells
	_, err := s.ReadBlob(t.Context(), d, 1<<20)
	checkQuarantined(t, s, d, err)
}

// TestScrubQuarantinesDamagedBlobs: a byte flipped in a large blob, its
// size intact, is found by a scrub pass, which leaves intact blobs alone.
func TestScrubQuarantinesDamagedBlobs(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	intact := commitBlob(t, s, randomBytes(3, 3<<20+17))
	flipped := commitBlob(t, s, randomBytes(4, 2<<20))
	truncated := commitBlob(t, s, randomBytes(5, 5000))
	damage(t, s, flipped, "flip")
	damage(t, s, truncated, "truncate")
	if _, err := os.Create(filepath.Join(s.Dir(), "blobs", "sha256", "stray-file")); err != nil {
		t.Fatal(err)
	}

	sc := NewScrubber(s, 1<<40)
	st, err := sc.Scrub(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if st.Blobs != 3 || st.Damaged != 2 {
		t.Errorf("scrub: got %+v, want 3 blobs, 2 damaged", st)
	}
	if _, err := s.StatBlob(t.Context(), intact); err != nil {
		t.Errorf("intact blob: %v", err)
	}
	for _, d := range []digest.Digest{flipped, truncated} {
		_, _, err := s.OpenBlob(t.Context(), d)
		if !errors.Is(err, ErrNotFound) {
			t.Errorf("damaged blob after scrub: got %v, want ErrNotFound", err)
		}
	}
	if st.Bytes < 3<<20 || sc.Read() != st.Bytes {
		t.Errorf("bytes read: got %d (scrubber: %d), want at least %d", st.Bytes, sc.Read(), 3<<20)
	}
}

// TestScrubKeepsItsRate: a pass reads at most about the rate given.
func TestScrubKeepsItsRate(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	commitBlob(t, s, randomBytes(6, 3<<20))
	start := time.Now()
	if _, err := NewScrubber(s, 8<<20).Scrub(t.Context()); err != nil {
		t.Fatal(err)
	}
	// 3 MiB at 8 MiB/s: the last piece is read without waiting after it.
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Errorf("a 3 MiB pass at 8 MiB/s took %v, want at least 250 ms", took)
	}
}

// TestScrubStopsWithContext: a cancelled pass returns at once.
func TestScrubStopsWithContext(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	commitBlob(t, s, randomBytes(7, 4<<20))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := NewScrubber(s, 1<<20).Scrub(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("got %v, want context.Canceled", err)
	}
}
