package storage

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// openStore opens a store in a fresh temporary directory and closes it when
// the test ends.
func openStore(t *testing.T) *Store {
	t.Helper()
	return openStoreAt(t, t.TempDir())
}

func openStoreAt(t *testing.T, dir string) *Store {
	t.Helper()
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatalf("Open(%s): %v", dir, err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s
}

// randomBytes returns n reproducible pseudo-random bytes.
func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// readAll reads the whole of f from its start.
func readAll(t *testing.T, f *os.File) []byte {
	t.Helper()
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		t.Fatalf("seek: %v", err)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return b
}

// filesUnder lists the regular files below dir, relative to it.
func filesUnder(t *testing.T, dir string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			rel, _ := filepath.Rel(dir, path)
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("walking %s: %v", dir, err)
	}
	return files
}

func TestOpenCreatesLayout(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "not", "yet", "there")
	s := openStoreAt(t, dir)
	if got := s.Dir(); got != dir {
		t.Errorf("Dir() = got %v, want %v", got, dir)
	}
	for _, sub := range []string{"blobs", "partial", "meta"} {
		fi, err := os.Stat(filepath.Join(dir, sub))
		if err != nil {
			t.Errorf("stat %s: got %v, want nil", sub, err)
			continue
		}
		if !fi.IsDir() {
			t.Errorf("%s is a directory: got %v, want %v", sub, fi.IsDir(), true)
		}
	}
}

// TestOpenNilLogger: an option given nil is as if it were not given.
func TestOpenNilLogger(t *testing.T) {
	t.Parallel()
	s, err := Open(t.Context(), t.TempDir(), WithLogger(nil))
	if err != nil {
		t.Fatalf("Open with a nil logger: got %v, want the default logger", err)
	}
	s.Close()
}

func TestOpenTwiceFails(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	openStoreAt(t, dir)
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err == nil {
		s.Close()
		t.Fatalf("second Open of a data dir in use: got %v, want an error", err)
	}
	if !errors.Is(err, ErrInUse) || errors.Is(err, ErrMetadataDamaged) {
		t.Errorf("second Open: got %v, want ErrInUse", err)
	}
}

// TestDamagedMetadataWayBack: a metadata database that cannot be opened
// is reported as damaged, with the way back; taking it, the store opens
// and serves the blobs it holds.
func TestDamagedMetadataWayBack(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s, err := Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	content := randomBytes(9, 5000)
	d := commitBlob(t, s, content)
	s.Close()
	manifests, _ := filepath.Glob(filepath.Join(dir, "meta", "MANIFEST"))
	if len(manifests) != 1 {
		t.Fatalf("no Badger MANIFEST to damage: %v", manifests)
	}
	if err := os.WriteFile(manifests[0], []byte("not a badger manifest"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = Open(t.Context(), dir, WithLogger(slog.New(slog.DiscardHandler)))
	if !errors.Is(err, ErrMetadataDamaged) || !strings.Contains(err.Error(), "verify --repair") {
		t.Fatalf("got %v, want ErrMetadataDamaged saying how to get back", err)
	}
	if err := os.Rename(filepath.Join(dir, "meta"), filepath.Join(dir, "meta.broken")); err != nil {
		t.Fatal(err)
	}
	s = openStoreAt(t, dir)
	f, size, err := s.OpenBlob(t.Context(), d)
	if err != nil || size != int64(len(content)) {
		t.Fatalf("the blob after the metadata was rebuilt: %d bytes, %v", size, err)
	}
	f.Close()
}

func TestPutBlobRoundTrip(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	for _, tc := range []struct {
		name string
		alg  digest.Algorithm
		data []byte
	}{
		{"empty", digest.SHA256, []byte{}},
		{"manifest", digest.SHA256, []byte(`{"schemaVersion":2}`)},
		{"100KiB", digest.SHA256, randomBytes(1, 100<<10)},
		{"sha512", digest.SHA512, []byte("sha512 content")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d := tc.alg.FromBytes(tc.data)
			before := time.Now()
			if err := s.PutBlob(ctx, d, tc.data); err != nil {
				t.Fatalf("PutBlob: got %v, want nil", err)
			}

			got, err := s.ReadBlob(ctx, d, int64(len(tc.data)))
			if err != nil {
				t.Fatalf("ReadBlob: got %v, want nil", err)
			}
			if !bytes.Equal(got, tc.data) {
				t.Errorf("ReadBlob: got %d bytes %q…, want %d bytes", len(got), got[:min(len(got), 16)], len(tc.data))
			}

			f, size, err := s.OpenBlob(ctx, d)
			if err != nil {
				t.Fatalf("OpenBlob: got %v, want nil", err)
			}
			defer f.Close()
			if size != int64(len(tc.data)) {
				t.Errorf("OpenBlob size: got %v, want %v", size, len(tc.data))
			}
			if got := readAll(t, f); !bytes.Equal(got, tc.data) {
				t.Errorf("OpenBlob content: got %d bytes, want %d bytes equal to the stored ones", len(got), len(tc.data))
			}

			size, err = s.StatBlob(ctx, d)
			if err != nil || size != int64(len(tc.data)) {
				t.Errorf("StatBlob: got %v, %v, want %v, nil", size, err, len(tc.data))
			}

			hex := d.Encoded()
			path := filepath.Join(s.Dir(), "blobs", string(tc.alg), hex[:2], hex)
			if _, err := os.Stat(path); err != nil {
				t.Errorf("blob file %s: got %v, want nil", path, err)
			}

			rec, err := s.Blob(ctx, d)
			if err != nil {
				t.Fatalf("Blob: got %v, want nil", err)
			}
			if rec.Size != int64(len(tc.data)) {
				t.Errorf("Blob().Size: got %v, want %v", rec.Size, len(tc.data))
			}
			if rec.LastAccess.Before(before) {
				t.Errorf("Blob().LastAccess: got %v, want at or after %v", rec.LastAccess, before)
			}

			// Storing the same content again is harmless.
			if err := s.PutBlob(ctx, d, tc.data); err != nil {
				t.Errorf("second PutBlob: got %v, want nil", err)
			}
		})
	}
}

func TestPutBlobDigestMismatch(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	d := digest.FromString("what was promised")
	err := s.PutBlob(ctx, d, []byte("what arrived"))
	if !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("PutBlob: got %v, want %v", err, ErrDigestMismatch)
	}
	if _, err := s.StatBlob(ctx, d); !errors.Is(err, ErrNotFound) {
		t.Errorf("StatBlob after a refused PutBlob: got %v, want %v", err, ErrNotFound)
	}
	other := digest.FromString("what arrived")
	if _, err := s.StatBlob(ctx, other); !errors.Is(err, ErrNotFound) {
		t.Errorf("StatBlob of the content's own digest: got %v, want %v", err, ErrNotFound)
	}
	if _, err := s.Blob(ctx, d); !errors.Is(err, ErrNotFound) {
		t.Errorf("Blob after a refused PutBlob: got %v, want %v", err, ErrNotFound)
	}
	for _, sub := range []string{"blobs", "partial"} {
		if files := filesUnder(t, filepath.Join(s.Dir(), sub)); len(files) != 0 {
			t.Errorf("files in %s: got %v, want none", sub, files)
		}
	}
}

func TestAbsentBlob(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	d := digest.FromString("never stored")

	if f, _, err := s.OpenBlob(ctx, d); !errors.Is(err, ErrNotFound) {
		if f != nil {
			f.Close()
		}
		t.Errorf("OpenBlob: got %v, want %v", err, ErrNotFound)
	}
	if _, err := s.StatBlob(ctx, d); !errors.Is(err, ErrNotFound) {
		t.Errorf("StatBlob: got %v, want %v", err, ErrNotFound)
	}
	if _, err := s.ReadBlob(ctx, d, 1<<20); !errors.Is(err, ErrNotFound) {
		t.Errorf("ReadBlob: got %v, want %v", err, ErrNotFound)
	}
	if _, err := s.Blob(ctx, d); !errors.Is(err, ErrNotFound) {
		t.Errorf("Blob: got %v, want %v", err, ErrNotFound)
	}
}

func TestInvalidDigest(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	for _, tc := range []struct {
		name string
		d    digest.Digest
	}{
		{"empty", ""},
		{"no algorithm", digest.Digest(strings.Repeat("a", 64))},
		{"short hex", "sha256:abc"},
		{"upper case hex", digest.Digest("sha256:" + strings.Repeat("A", 64))},
		{"not hex", digest.Digest("sha256:" + strings.Repeat("z", 64))},
		{"unknown algorithm", digest.Digest("md5:" + strings.Repeat("a", 32))},
		{"path traversal", digest.Digest("sha256:../../" + strings.Repeat("a", 58))},
		{"empty encoded", "sha256:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checks := map[string]error{}
			f, _, err := s.OpenBlob(ctx, tc.d)
			if f != nil {
				f.Close()
			}
			checks["OpenBlob"] = err
			_, checks["StatBlob"] = s.StatBlob(ctx, tc.d)
			_, checks["ReadBlob"] = s.ReadBlob(ctx, tc.d, 1<<20)
			checks["PutBlob"] = s.PutBlob(ctx, tc.d, []byte("x"))
			p, err := s.NewPartial(ctx, tc.d, -1)
			if p != nil {
				p.Fail(nil)
			}
			checks["NewPartial"] = err
			for op, err := range checks {
				if err == nil || errors.Is(err, ErrNotFound) {
					t.Errorf("%s(%q): got %v, want an invalid-digest error", op, tc.d, err)
				}
			}
		})
	}
	for _, sub := range []string{"blobs", "partial"} {
		if files := filesUnder(t, filepath.Join(s.Dir(), sub)); len(files) != 0 {
			t.Errorf("files in %s after invalid digests: got %v, want none", sub, files)
		}
	}
}

func TestReadBlobLimit(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	data := randomBytes(2, 1000)
	d := digest.FromBytes(data)
	if err := s.PutBlob(ctx, d, data); err != nil {
		t.Fatalf("PutBlob: %v", err)
	}
	for _, tc := range []struct {
		limit   int64
		wantErr bool
	}{
		{0, true},
		{999, true},
		{1000, false},
		{1 << 20, false},
	} {
		got, err := s.ReadBlob(ctx, d, tc.limit)
		if (err != nil) != tc.wantErr {
			t.Errorf("ReadBlob(limit %d) error: got %v, want error %v", tc.limit, err, tc.wantErr)
			continue
		}
		if err == nil && !bytes.Equal(got, data) {
			t.Errorf("ReadBlob(limit %d): got %d bytes, want the %d stored", tc.limit, len(got), len(data))
		}
		if err != nil && got != nil {
			t.Errorf("ReadBlob(limit %d) bytes on error: got %d bytes, want nil", tc.limit, len(got))
		}
	}
}

func TestTags(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()

	if _, err := s.Tag(ctx, "docker.io", "library/alpine", "latest"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Tag before PutTag: got %v, want %v", err, ErrNotFound)
	}

	checked := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	recs := map[[3]string]TagRecord{
		{"docker.io", "library/alpine", "latest"}:  {Digest: digest.FromString("a"), MediaType: "application/vnd.oci.image.index.v1+json", Size: 100, CheckedAt: checked},
		{"docker.io", "library/alpine", "3.20"}:    {Digest: digest.FromString("b"), MediaType: "application/vnd.oci.image.manifest.v1+json", Size: 200, CheckedAt: checked.Add(time.Hour)},
		{"ghcr.io", "library/alpine", "latest"}:    {Digest: digest.FromString("c"), Size: 300, CheckedAt: checked.Add(2 * time.Hour)},
		{"docker.io", "library/busybox", "latest"}: {Digest: digest.FromString("d"), Size: 400, CheckedAt: checked.Add(3 * time.Hour)},
	}
	for k, rec := range recs {
		if err := s.PutTag(ctx, k[0], k[1], k[2], rec); err != nil {
			t.Fatalf("PutTag(%v): %v", k, err)
		}
	}
	for k, want := range recs {
		got, err := s.Tag(ctx, k[0], k[1], k[2])
		if err != nil {
			t.Errorf("Tag(%v): got %v, want nil", k, err)
			continue
		}
		if got.Digest != want.Digest || got.MediaType != want.MediaType || got.Size != want.Size || !got.CheckedAt.Equal(want.CheckedAt) {
			t.Errorf("Tag(%v): got %+v, want %+v", k, got, want)
		}
	}

	// Overwriting replaces the record.
	k := [3]string{"docker.io", "library/alpine", "latest"}
	moved := TagRecord{Digest: digest.FromString("e"), MediaType: "application/vnd.oci.image.index.v1+json", Size: 500, CheckedAt: checked.Add(24 * time.Hour)}
	if err := s.PutTag(ctx, k[0], k[1], k[2], moved); err != nil {
		t.Fatalf("PutTag overwrite: %v", err)
	}
	if got, err := s.Tag(ctx, k[0], k[1], k[2]); err != nil || got.Digest != moved.Digest || got.Size != moved.Size {
		t.Errorf("Tag after overwrite: got %+v, %v, want %+v, nil", got, err, moved)
	}

	if _, err := s.Tag(ctx, "docker.io", "library/alpine", "edge"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Tag of another tag: got %v, want %v", err, ErrNotFound)
	}
}

func TestSetMediaType(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	data := []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json"}`)
	d := digest.FromBytes(data)
	if err := s.PutBlob(ctx, d, data); err != nil {
		t.Fatalf("PutBlob: %v", err)
	}
	const mt = "application/vnd.oci.image.manifest.v1+json"
	for _, want := range []string{mt, mt, "application/vnd.docker.distribution.manifest.v2+json"} {
		if err := s.SetMediaType(ctx, d, want); err != nil {
			t.Fatalf("SetMediaType(%q): %v", want, err)
		}
		rec, err := s.Blob(ctx, d)
		if err != nil {
			t.Fatalf("Blob: %v", err)
		}
		if rec.MediaType != want {
			t.Errorf("MediaType: got %v, want %v", rec.MediaType, want)
		}
		if rec.Size != int64(len(data)) {
			t.Errorf("Size after SetMediaType: got %v, want %v", rec.Size, len(data))
		}
	}

	// Storing the blob again refreshes size and access time but keeps the media type.
	if err := s.PutBlob(ctx, d, data); err != nil {
		t.Fatalf("second PutBlob: %v", err)
	}
	rec, err := s.Blob(ctx, d)
	if err != nil {
		t.Fatalf("Blob: %v", err)
	}
	if want := "application/vnd.docker.distribution.manifest.v2+json"; rec.MediaType != want {
		t.Errorf("MediaType after PutBlob: got %v, want %v", rec.MediaType, want)
	}
}

func TestTouch(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	for i, tc := range []struct {
		name      string
		age       time.Duration
		wantWrite bool
	}{
		{"just recorded", 0, false},
		{"half an hour", 30 * time.Minute, false},
		{"just under the interval", touchInterval - time.Minute, false},
		{"just over the interval", touchInterval + time.Minute, true},
		{"two hours", 2 * time.Hour, true},
		{"a month", 30 * 24 * time.Hour, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d := digest.FromString("touch " + tc.name)
			const mt = "application/vnd.oci.image.manifest.v1+json"
			old := time.Now().Add(-tc.age).UTC().Round(0)
			err := s.update(blobKey(d), func(rec *BlobRecord) bool {
				rec.Size = int64(i + 1)
				rec.MediaType = mt
				rec.LastAccess = old
				return true
			})
			if err != nil {
				t.Fatalf("seeding record: %v", err)
			}
			before := time.Now()
			if err := s.Touch(ctx, d); err != nil {
				t.Fatalf("Touch: %v", err)
			}
			rec, err := s.Blob(ctx, d)
			if err != nil {
				t.Fatalf("Blob: %v", err)
			}
			if tc.wantWrite {
				if rec.LastAccess.Before(before) {
					t.Errorf("LastAccess: got %v, want at or after %v", rec.LastAccess, before)
				}
			} else if !rec.LastAccess.Equal(old) {
				t.Errorf("LastAccess: got %v, want %v (unchanged)", rec.LastAccess, old)
			}
			if rec.Size != int64(i+1) || rec.MediaType != mt {
				t.Errorf("record besides LastAccess: got size %v type %q, want size %v type %q", rec.Size, rec.MediaType, i+1, mt)
			}
		})
	}
}

func TestReopenKeepsData(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ctx := t.Context()
	log := slog.New(slog.DiscardHandler)

	manifest := []byte(`{"schemaVersion":2}`)
	md := digest.FromBytes(manifest)
	layer := randomBytes(3, 3*HoldBack+17)
	ld := digest.FromBytes(layer)
	tag := TagRecord{Digest: md, MediaType: "application/vnd.oci.image.manifest.v1+json", Size: int64(len(manifest)), CheckedAt: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)}
	unfinished := digest.FromString("unfinished")

	s, err := Open(ctx, dir, WithLogger(log))
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if err := s.PutBlob(ctx, md, manifest); err != nil {
		t.Fatalf("PutBlob: %v", err)
	}
	if err := s.SetMediaType(ctx, md, tag.MediaType); err != nil {
		t.Fatalf("SetMediaType: %v", err)
	}
	if err := s.PutTag(ctx, "docker.io", "library/app", "v1", tag); err != nil {
		t.Fatalf("PutTag: %v", err)
	}
	p, err := s.NewPartial(ctx, ld, int64(len(layer)))
	if err != nil {
		t.Fatalf("NewPartial: %v", err)
	}
	if _, err := p.WriteAt(layer, 0); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
	if err := p.Commit(ctx); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	// A download interrupted by the shutdown, and stray files a crash may leave.
	q, err := s.NewPartial(ctx, unfinished, 100)
	if err != nil {
		t.Fatalf("NewPartial: %v", err)
	}
	if _, err := q.WriteAt([]byte("half"), 0); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	q.f.Close()
	for _, name := range []string{"put-123456", "sha256-" + digest.FromString("crashed").Encoded()} {
		if err := os.WriteFile(filepath.Join(dir, "partial", name), []byte("junk"), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	s = openStoreAt(t, dir)
	if files := filesUnder(t, filepath.Join(dir, "partial")); len(files) != 0 {
		t.Errorf("partial/ after reopening: got %v, want empty", files)
	}
	if got, err := s.ReadBlob(ctx, md, 1<<20); err != nil || !bytes.Equal(got, manifest) {
		t.Errorf("ReadBlob(manifest) after reopening: got %q, %v, want %q, nil", got, err, manifest)
	}
	if got, err := s.ReadBlob(ctx, ld, 1<<20); err != nil || !bytes.Equal(got, layer) {
		t.Errorf("ReadBlob(layer) after reopening: got %d bytes, %v, want %d bytes, nil", len(got), err, len(layer))
	}
	rec, err := s.Blob(ctx, md)
	if err != nil || rec.MediaType != tag.MediaType || rec.Size != int64(len(manifest)) {
		t.Errorf("Blob(manifest) after reopening: got %+v, %v, want media type %q size %d", rec, err, tag.MediaType, len(manifest))
	}
	if rec, err := s.Blob(ctx, ld); err != nil || rec.Size != int64(len(layer)) {
		t.Errorf("Blob(layer) after reopening: got %+v, %v, want size %d", rec, err, len(layer))
	}
	got, err := s.Tag(ctx, "docker.io", "library/app", "v1")
	if err != nil || got.Digest != tag.Digest || got.MediaType != tag.MediaType || got.Size != tag.Size || !got.CheckedAt.Equal(tag.CheckedAt) {
		t.Errorf("Tag after reopening: got %+v, %v, want %+v, nil", got, err, tag)
	}
	if _, err := s.StatBlob(ctx, unfinished); !errors.Is(err, ErrNotFound) {
		t.Errorf("StatBlob(unfinished download) after reopening: got %v, want %v", err, ErrNotFound)
	}
}

func TestOpenRemovesPartialsHonoursContext(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "partial"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "partial", "stale"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	s, err := Open(ctx, dir, WithLogger(slog.New(slog.DiscardHandler)))
	if !errors.Is(err, context.Canceled) {
		if s != nil {
			s.Close()
		}
		t.Fatalf("Open with a cancelled context and partials to remove: got %v, want %v", err, context.Canceled)
	}
	// The database was released: the directory can be opened again.
	openStoreAt(t, dir)
	if files := filesUnder(t, filepath.Join(dir, "partial")); len(files) != 0 {
		t.Errorf("partial/ after reopening: got %v, want empty", files)
	}
}

// TestOpenAfterKillInBadgerCreate: a kill between Badger creating a
// memtable or value log file and sizing it leaves an empty one, on which
// Badger's Open fails; the store opens anyway, its records intact.
func TestOpenAfterKillInBadgerCreate(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"00007.mem", "000009.vlog"} {
		dir := t.TempDir()
		s := openStoreAt(t, dir)
		b := randomBytes(5, 1000)
		d := digest.FromBytes(b)
		if err := s.PutBlob(t.Context(), d, b); err != nil {
			t.Fatal(err)
		}
		s.Close()
		if err := os.WriteFile(filepath.Join(dir, "meta", name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		s = openStoreAt(t, dir)
		if rec, err := s.Blob(t.Context(), d); err != nil || rec.Size != 1000 {
			t.Errorf("an empty %s: the blob's record after reopening: %+v, %v", name, rec, err)
		}
	}
}
