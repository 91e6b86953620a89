package storage

import (
	"testing"

	"github.com/dgraph-io/badger/v4"
	"github.com/opencontainers/go-digest"
)

// TestMembers: a digest belongs to an upstream's repository once recorded
// as a member or declared by one of its manifests, and to no other; the
// records outlive the process.
func TestMembers(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := openStoreAt(t, dir)
	ctx := t.Context()
	layer, manifest := digest.FromString("layer"), digest.FromString("manifest")
	if err := s.AddMembers(ctx, "r.example", "team/app", manifest); err != nil {
		t.Fatal(err)
	}
	if err := s.SetDeclaredSizes(ctx, "r.example", "team/app", map[digest.Digest]int64{layer: 5}); err != nil {
		t.Fatal(err)
	}
	check := func(s *Store, when string) {
		t.Helper()
		for _, tt := range []struct {
			upstream, repo string
			d              digest.Digest
			want           bool
		}{
			{"r.example", "team/app", manifest, true},
			{"r.example", "team/app", layer, true},
			{"r.example", "team/other", layer, false},
			{"r.example", "team/app/sub", manifest, false},
			{"other.example", "team/app", layer, false},
			{"r.example", "team/app", digest.FromString("unknown"), false},
		} {
			got, err := s.IsMember(ctx, tt.upstream, tt.repo, tt.d)
			if err != nil || got != tt.want {
				t.Errorf("%s: IsMember(%s, %s, %.19s) = %v, %v; want %v", when, tt.upstream, tt.repo, tt.d, got, err, tt.want)
			}
		}
	}
	check(s, "recorded")
	check(s, "from memory") // the same answers once cached
	s.Close()
	check(openStoreAt(t, dir), "after reopening")
}

// TestMembersMigrated: a store filled before membership was recorded
// (tags and declared sizes only) gets, once, what they imply: the tag's
// digest and the manifests naming declared digests are the repository's.
func TestMembersMigrated(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := openStoreAt(t, dir)
	ctx := t.Context()
	layer := digest.FromString("layer")
	manifestBody := `{"schemaVersion":2,"config":{"digest":"` + digest.FromString("config").String() + `"},"layers":[{"digest":"` + layer.String() + `"}]}`
	manifest := digest.FromString(manifestBody)
	if err := s.PutBlob(ctx, manifest, []byte(manifestBody)); err != nil {
		t.Fatal(err)
	}
	if err := s.SetMediaType(ctx, manifest, "application/vnd.oci.image.manifest.v1+json"); err != nil {
		t.Fatal(err)
	}
	tagged := digest.FromString("the tag's index")
	if err := s.PutTag(ctx, "r.example:5000", "team/app", "v1", TagRecord{Digest: tagged}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetDeclaredSizes(ctx, "r.example:5000", "team/other", map[digest.Digest]int64{layer: 5}); err != nil {
		t.Fatal(err)
	}
	// As an older version left it: no member records, no mark.
	if err := s.db.Update(func(txn *badger.Txn) error { return txn.Delete(membersMigratedKey) }); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = openStoreAt(t, dir)
	for _, tt := range []struct {
		repo string
		d    digest.Digest
		want bool
	}{
		{"team/app", tagged, true},
		{"team/other", manifest, true},
		{"team/app", manifest, false},
	} {
		if got, err := s.IsMember(ctx, "r.example:5000", tt.repo, tt.d); err != nil || got != tt.want {
			t.Errorf("IsMember(%s, %.19s) = %v, %v; want %v", tt.repo, tt.d, got, err, tt.want)
		}
	}
}
