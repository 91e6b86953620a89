package storage

import (
	"testing"

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
