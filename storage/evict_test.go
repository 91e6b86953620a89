package storage

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
)

// putBlobs stores blobs of size bytes, oldest first, and returns their digests.
func putBlobs(t *testing.T, s *Store, n, size int) []digest.Digest {
	t.Helper()
	var out []digest.Digest
	for i := range n {
		b := randomBytes(uint64(1000+i+size), size)
		d := digest.FromBytes(b)
		if err := s.PutBlob(t.Context(), d, b); err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

func stored(s *Store, d digest.Digest) bool {
	_, err := s.StatBlob(context.Background(), d)
	return err == nil
}

// TestEvictLeastRecentlyUsed: eviction removes the least recently used
// blobs first, file and record, and passes by blobs open for reading,
// pinned blobs and manifests.
func TestEvictLeastRecentlyUsed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name                   string
		open, pinned, manifest bool // the oldest blob is
		cached                 bool // the oldest blob was read: its descriptor is cached, idle
		evicted                []int
	}{
		{name: "oldest first", evicted: []int{0}},
		{name: "open", open: true, evicted: []int{1}},
		{name: "cached", cached: true, evicted: []int{0}},
		{name: "pinned", pinned: true, evicted: []int{1}},
		{name: "manifest", manifest: true, evicted: []int{1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := openStore(t)
			ds := putBlobs(t, s, 4, 300)
			if tc.open {
				b, err := s.OpenBlobFD(t.Context(), ds[0])
				if err != nil {
					t.Fatal(err)
				}
				defer b.Release()
			}
			if tc.cached {
				b, err := s.OpenBlobFD(t.Context(), ds[0])
				if err != nil {
					t.Fatal(err)
				}
				b.Release()
			}
			policy := EvictionPolicy{MaxBytes: 1000}
			if tc.pinned {
				policy.Pinned = func(context.Context) (map[digest.Digest]bool, error) {
					return map[digest.Digest]bool{ds[0]: true}, nil
				}
			}
			if tc.manifest {
				if err := s.SetMediaType(t.Context(), ds[0], "application/vnd.oci.image.manifest.v1+json"); err != nil {
					t.Fatal(err)
				}
			}
			s.SetEviction(policy)
			need := s.overBound(0) // 1200 held, down to 900
			if need != 300 {
				t.Fatalf("over the bound by %d, want 300", need)
			}
			round, err := s.Evict(t.Context(), need)
			if err != nil || round.Blobs != 1 || round.Bytes != 300 {
				t.Fatalf("Evict: %+v, %v; want one blob of 300 bytes", round, err)
			}
			for i, d := range ds {
				want := !contains(tc.evicted, i)
				if got := stored(s, d); got != want {
					t.Errorf("blob %d stored: %v, want %v", i, got, want)
				}
				if _, err := s.Blob(t.Context(), d); (err == nil) != want {
					t.Errorf("blob %d record: %v, want it kept %v", i, err, want)
				}
			}
			if bytes, blobs := s.Usage(); bytes != 900 || blobs != 3 {
				t.Errorf("usage after: %d bytes in %d blobs, want 900 in 3", bytes, blobs)
			}
		})
	}
}

func contains(xs []int, x int) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// TestDownloadMakesRoom: a download whose bytes would take the store past
// max_size evicts first; one larger than max_size is refused.
func TestDownloadMakesRoom(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ds := putBlobs(t, s, 3, 300)
	s.SetEviction(EvictionPolicy{MaxBytes: 1000})
	b := randomBytes(7, 300)
	p, err := s.NewPartial(t.Context(), digest.FromBytes(b), int64(len(b)))
	if err != nil {
		t.Fatalf("a download that fits once the oldest blob goes: %v", err)
	}
	if _, err := p.WriteAt(b, 0); err != nil {
		t.Fatal(err)
	}
	if err := p.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	if stored(s, ds[0]) || !stored(s, ds[1]) || !stored(s, ds[2]) {
		t.Errorf("stored after: %v %v %v, want the oldest evicted", stored(s, ds[0]), stored(s, ds[1]), stored(s, ds[2]))
	}
	if bytes, _ := s.Usage(); bytes > 1000 {
		t.Errorf("the store holds %d bytes, over its max_size of 1000", bytes)
	}
	big := randomBytes(8, 1001)
	if _, err := s.NewPartial(t.Context(), digest.FromBytes(big), int64(len(big))); !errors.Is(err, ErrNoSpace) {
		t.Errorf("a blob larger than max_size: %v, want ErrNoSpace", err)
	}
}

// TestInterruptedEvictionFinishedAtOpen: a stop between marking a blob for
// eviction and deleting its record, its file removed or not, leaves a
// store that Open finishes and Verify finds clean.
func TestInterruptedEvictionFinishedAtOpen(t *testing.T) {
	t.Parallel()
	for _, fileRemoved := range []bool{false, true} {
		dir := t.TempDir()
		s := openStoreAt(t, dir)
		ds := putBlobs(t, s, 2, 300)
		err := s.update(blobKey(ds[0]), func(rec *BlobRecord) bool { rec.Evicting = true; return true })
		if err != nil {
			t.Fatal(err)
		}
		if fileRemoved {
			if err := os.Remove(s.blobPath(ds[0])); err != nil {
				t.Fatal(err)
			}
		}
		s.Close()
		s = openStoreAt(t, dir)
		if stored(s, ds[0]) || !stored(s, ds[1]) {
			t.Errorf("file removed %v: after reopening, stored %v %v; want the marked blob gone", fileRemoved, stored(s, ds[0]), stored(s, ds[1]))
		}
		if problems, err := s.Verify(t.Context(), VerifyOptions{}); err != nil || len(problems) > 0 {
			t.Errorf("file removed %v: verify: %+v, %v", fileRemoved, problems, err)
		}
		if bytes, blobs := s.Usage(); bytes != 300 || blobs != 1 {
			t.Errorf("usage: %d bytes in %d blobs, want 300 in 1", bytes, blobs)
		}
	}
}

// TestSizeClaimsEvictNothing: a size declared before the bytes are verified
// costs no cached blob when it cannot fit, and none when it fits but its
// bytes then fail verification; the store keeps its bound once a verified
// blob is committed, sparing that blob.
func TestSizeClaimsEvictNothing(t *testing.T) {
	t.Parallel()
	const gib = int64(1) << 30
	for _, tc := range []struct {
		name    string
		policy  EvictionPolicy
		fs      [2]int64 // free, total; zero: the real file system
		pinned  bool     // every stored blob is pinned
		size    int64    // declared
		bytes   int      // then written: 0 none
		corrupt bool     // the bytes do not match the digest
		wantErr error    // from NewPartial
		kept    int      // stored blobs left of 4
	}{
		{name: "10 TiB under 85% of 1 GiB", policy: EvictionPolicy{MaxPercent: 85}, fs: [2]int64{gib / 2, gib},
			size: 10 << 40, wantErr: ErrTooLarge, kept: 4},
		{name: "over max_size", policy: EvictionPolicy{MaxBytes: 2000}, size: 2001, wantErr: ErrTooLarge, kept: 4},
		{name: "larger than the file system", policy: EvictionPolicy{MaxBytes: 2 * gib}, fs: [2]int64{gib / 2, gib},
			size: gib, wantErr: ErrTooLarge, kept: 4},
		{name: "what may go would not be enough", policy: EvictionPolicy{MaxBytes: 1400}, pinned: true,
			size: 300, wantErr: ErrNoSpace, kept: 4},
		{name: "fits, then fails verification", policy: EvictionPolicy{MaxBytes: 2000}, size: 1500, bytes: 1500,
			corrupt: true, kept: 4},
		{name: "fits and verifies", policy: EvictionPolicy{MaxBytes: 2000}, size: 1500, bytes: 1500, kept: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := openStore(t)
			if tc.fs[1] > 0 {
				s.space = func(string) (int64, int64, error) { return tc.fs[0], tc.fs[1], nil }
			}
			ds := putBlobs(t, s, 4, 300)
			if tc.pinned {
				tc.policy.Pinned = func(context.Context) (map[digest.Digest]bool, error) {
					return map[digest.Digest]bool{ds[0]: true, ds[1]: true, ds[2]: true, ds[3]: true}, nil
				}
			}
			s.SetEviction(tc.policy)
			content := randomBytes(99, max(tc.bytes, 1))
			d := digest.FromBytes(content)
			if tc.corrupt {
				content[0] ^= 0xff
			}
			p, err := s.NewPartial(t.Context(), d, tc.size)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("NewPartial of %d bytes: got %v, want %v", tc.size, err, tc.wantErr)
			}
			if err == nil {
				if _, err := p.WriteAt(content[:tc.bytes], 0); err != nil {
					t.Fatal(err)
				}
				err = p.Commit(t.Context())
				if (err != nil) != tc.corrupt {
					t.Fatalf("Commit: %v, corrupt %v", err, tc.corrupt)
				}
				if err == nil && !stored(s, d) {
					t.Error("the blob just committed was evicted")
				}
			}
			kept := 0
			for _, d := range ds {
				if stored(s, d) {
					kept++
				}
			}
			if kept != tc.kept {
				t.Errorf("cached blobs left: got %d of 4, want %d", kept, tc.kept)
			}
			if bytes, _ := s.Usage(); tc.policy.MaxBytes > 0 && bytes > tc.policy.MaxBytes {
				t.Errorf("the store holds %d bytes, over its max_size %d", bytes, tc.policy.MaxBytes)
			}
		})
	}
}

// TestEvictionPassesOpenBlobsOfARelativeDataDir: a blob being read is
// known by its file's identity, however the data dir was named.
func TestEvictionPassesOpenBlobsOfARelativeDataDir(t *testing.T) {
	t.Parallel()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(wd, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := openStoreAt(t, rel)
	ds := putBlobs(t, s, 4, 300)
	f, _, err := s.OpenBlob(t.Context(), ds[0])
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s.SetEviction(EvictionPolicy{MaxBytes: 1000})
	round, err := s.Evict(t.Context(), 300)
	if err != nil || round.Skipped != 1 {
		t.Fatalf("Evict: %+v, %v; want the open blob passed by", round, err)
	}
	if !stored(s, ds[0]) || stored(s, ds[1]) {
		t.Errorf("stored after: open %v, next %v; want the open one kept and the next evicted", stored(s, ds[0]), stored(s, ds[1]))
	}
}

// TestCommitRacingEvictionKeepsItsFile: a blob committed again between its
// eviction being chosen and its file being removed keeps the new file and
// its record.
func TestCommitRacingEvictionKeepsItsFile(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	content := randomBytes(5, 300)
	d := digest.FromBytes(content)
	if err := s.PutBlob(t.Context(), d, content); err != nil {
		t.Fatal(err)
	}
	chosen, _, err := s.chooseEvictions(t.Context(), 300, "")
	if err != nil || len(chosen) != 1 {
		t.Fatalf("chosen: %v, %v", chosen, err)
	}
	// The commit's rename lands after the eviction chose the file.
	tmp, err := os.CreateTemp(filepath.Join(s.root, "partial"), "put-*")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tmp.Write(content); err != nil {
		t.Fatal(err)
	}
	if err := s.commitFile(tmp, d, int64(len(content))); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.evictBatch(chosen); err != nil {
		t.Fatal(err)
	}
	if err := s.recordBlob(t.Context(), d, int64(len(content))); err != nil {
		t.Fatal(err)
	}
	if !stored(s, d) {
		t.Fatal("the file committed during the eviction was removed")
	}
	if problems, err := s.Verify(t.Context(), VerifyOptions{}); err != nil || len(problems) > 0 {
		t.Errorf("verify: %+v, %v", problems, err)
	}
}
