package storage

import (
	"fmt"
	"testing"

	"github.com/opencontainers/go-digest"
)

// TestImageDigests: a pinned tag names its index, every platform's
// manifest, their configs and layers, as the store holds them.
func TestImageDigests(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	ctx := t.Context()
	put := func(body string) digest.Digest {
		d := digest.FromString(body)
		if err := s.PutBlob(ctx, d, []byte(body)); err != nil {
			t.Fatal(err)
		}
		return d
	}
	config, layer := digest.FromString("config"), digest.FromString("layer")
	manifest := put(fmt.Sprintf(`{"schemaVersion":2,"config":{"digest":%q},"layers":[{"digest":%q}]}`, config, layer))
	missing := digest.FromString("a platform never pulled")
	index := put(fmt.Sprintf(`{"schemaVersion":2,"manifests":[{"digest":%q},{"digest":%q}]}`, manifest, missing))
	if err := s.PutTag(ctx, "r.example", "team/app", "v1", TagRecord{Digest: index}); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"v1", index.String()} {
		got := map[digest.Digest]bool{}
		if err := s.ImageDigests(ctx, "r.example", "team/app", ref, got); err != nil {
			t.Fatal(err)
		}
		for _, d := range []digest.Digest{index, manifest, config, layer, missing} {
			if !got[d] {
				t.Errorf("%s: %s not named", ref, d)
			}
		}
	}
	got := map[digest.Digest]bool{}
	if err := s.ImageDigests(ctx, "r.example", "team/app", "never-pulled", got); err != nil || len(got) != 0 {
		t.Errorf("a tag never pulled: %v, %v; want nothing", got, err)
	}
}
