package storage

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/opencontainers/go-digest"
)

// TestVerify: every kind of damage is named, and repaired with Repair: a
// second pass finds nothing.
func TestVerify(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	intact := commitBlob(t, s, randomBytes(10, 70_000))
	flipped := commitBlob(t, s, randomBytes(11, 50_000))
	damage(t, s, flipped, "flip")
	resized := commitBlob(t, s, randomBytes(12, 5000))
	// The file is intact, its record says otherwise.
	if err := s.recordBlob(t.Context(), resized, 4000); err != nil {
		t.Fatal(err)
	}
	gone := commitBlob(t, s, randomBytes(13, 3000))
	if err := os.Remove(s.blobPath(gone)); err != nil {
		t.Fatal(err)
	}
	unrecorded := digest.FromBytes([]byte("placed by hand"))
	os.MkdirAll(filepath.Dir(s.blobPath(unrecorded)), 0o755)
	if err := os.WriteFile(s.blobPath(unrecorded), []byte("placed by hand"), 0o644); err != nil {
		t.Fatal(err)
	}
	stray := filepath.Join(s.Dir(), "blobs", "sha256", "notes.txt")
	if err := os.WriteFile(stray, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}

	kinds := func(ps []Problem) map[string]string {
		out := map[string]string{}
		for _, p := range ps {
			out[p.Kind] = string(p.Digest) + p.Path
		}
		return out
	}
	var calls int
	problems, err := s.Verify(t.Context(), VerifyOptions{Progress: func(done, total int64) { calls++ }})
	if err != nil {
		t.Fatal(err)
	}
	got := kinds(problems)
	want := map[string]string{ProblemDamaged: string(flipped) + s.blobPath(flipped), ProblemTruncated: string(resized) + s.blobPath(resized),
		ProblemNoFile: string(gone), ProblemUnrecord: string(unrecorded) + s.blobPath(unrecorded), ProblemStray: stray}
	if len(problems) != len(want) {
		t.Errorf("found %d problems, want %d: %+v", len(problems), len(want), problems)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: got %q, want %q", k, got[k], v)
		}
	}
	if calls == 0 {
		t.Error("no progress reported")
	}
	if _, err := s.StatBlob(t.Context(), intact); err != nil {
		t.Errorf("the intact blob, after a pass without repair: %v", err)
	}

	repaired, err := s.Verify(t.Context(), VerifyOptions{Repair: true})
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(repaired, func(p Problem) bool { return p.Repaired == "" }); i >= 0 {
		t.Errorf("not repaired: %+v", repaired[i])
	}
	if again, err := s.Verify(t.Context(), VerifyOptions{}); err != nil || len(again) != 0 {
		t.Errorf("after the repair: %+v, %v; want nothing", again, err)
	}
	if size, err := s.StatBlob(t.Context(), resized); err != nil || size != 5000 {
		t.Errorf("the blob whose record was wrong: %d, %v; want it served, 5000 bytes", size, err)
	}
}

// TestOpenForRepairRebuildsMetadata: a damaged metadata database is moved
// aside and the records are rebuilt from the blobs.
func TestOpenForRepairRebuildsMetadata(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := openStoreAt(t, dir)
	d := commitBlob(t, s, randomBytes(14, 9000))
	s.Close()
	if err := os.WriteFile(filepath.Join(dir, "meta", "MANIFEST"), []byte("damaged"), 0o644); err != nil {
		t.Fatal(err)
	}
	s, rebuilt, err := OpenForRepair(t.Context(), dir)
	if err != nil || rebuilt == nil {
		t.Fatalf("got %v, %v; want the metadata rebuilt", rebuilt, err)
	}
	defer s.Close()
	problems, err := s.Verify(t.Context(), VerifyOptions{Repair: true})
	if err != nil || len(problems) != 1 || problems[0].Kind != ProblemUnrecord || problems[0].Digest != d {
		t.Fatalf("got %+v, %v; want the blob's record written again", problems, err)
	}
	if want, ok := s.recordedSize(d); !ok || want != 9000 {
		t.Errorf("recorded size: %d, %v", want, ok)
	}
}
