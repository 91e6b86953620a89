package imagesync

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/proxy"
	"github.com/pullproxy/pullproxy/upstream"
)

// fakeCore is an upstream's repository as the mirror core answers for it:
// its tags, and the images fetched.
type fakeCore struct {
	mu       sync.Mutex
	repos    []string                 // what the catalog lists
	tags     map[string]digest.Digest // what each tag points to upstream, in every repository
	listErr  error
	seedErr  map[digest.Digest]error
	checked  []string // tags asked about, in order
	seeded   []digest.Digest
	platform []string // the platforms the last seed asked for
}

func (c *fakeCore) Repositories(ctx context.Context, upstreamName, prefix string) ([]string, error) {
	var out []string
	for _, r := range c.repos {
		if strings.HasPrefix(r, prefix) {
			out = append(out, r)
		}
	}
	return out, nil
}

func (c *fakeCore) Tags(ctx context.Context, upstreamName, repo string) ([]string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.listErr != nil {
		return nil, c.listErr
	}
	return slices.Sorted(maps.Keys(c.tags)), nil
}

func (c *fakeCore) CheckTag(ctx context.Context, upstreamName, repo, tag string) (upstream.Descriptor, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.checked = append(c.checked, tag)
	d, ok := c.tags[tag]
	if !ok {
		return upstream.Descriptor{}, upstream.ErrNotFound
	}
	return upstream.Descriptor{Digest: d}, nil
}

func (c *fakeCore) Seed(ctx context.Context, upstreamName, repo, ref string, opts proxy.SeedOptions) (digest.Digest, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := digest.Digest(ref)
	c.platform = opts.Platforms
	if err := c.seedErr[d]; err != nil {
		return "", err
	}
	c.seeded = append(c.seeded, d)
	return d, nil
}

// TestSyncRepository: a round fetches the images of the tags the rule keeps
// that are new or moved, and only asks about the others; a tag the rule
// no longer keeps, or the upstream no longer lists, is dropped; a tag that
// fails keeps what it had; a tag list that fails fails the round.
func TestSyncRepository(t *testing.T) {
	t.Parallel()
	v1, v1b, v2, dev := digest.FromString("v1"), digest.FromString("v1 moved"), digest.FromString("v2"), digest.FromString("dev")
	boom := errors.New("upstream said no")
	tests := []struct {
		name        string
		upstream    map[string]digest.Digest
		kept        Kept
		listErr     error
		seedErr     map[digest.Digest]error
		wantKept    Kept
		wantSeeded  []digest.Digest
		wantFetched []string
		wantDropped []string
		wantFailed  []string
		wantErr     bool
	}{
		{name: "first round", upstream: map[string]digest.Digest{"v1": v1, "dev": dev},
			wantKept: Kept{"v1": v1}, wantSeeded: []digest.Digest{v1}, wantFetched: []string{"v1"}},
		{name: "nothing moved", upstream: map[string]digest.Digest{"v1": v1, "dev": dev}, kept: Kept{"v1": v1},
			wantKept: Kept{"v1": v1}},
		{name: "a new tag", upstream: map[string]digest.Digest{"v1": v1, "v2": v2, "dev": dev}, kept: Kept{"v1": v1},
			wantKept: Kept{"v1": v1, "v2": v2}, wantSeeded: []digest.Digest{v2}, wantFetched: []string{"v2"}},
		{name: "a moved tag", upstream: map[string]digest.Digest{"v1": v1b}, kept: Kept{"v1": v1},
			wantKept: Kept{"v1": v1b}, wantSeeded: []digest.Digest{v1b}, wantFetched: []string{"v1"}},
		{name: "a tag gone", upstream: map[string]digest.Digest{"v2": v2}, kept: Kept{"v1": v1, "v2": v2},
			wantKept: Kept{"v2": v2}, wantDropped: []string{"v1"}},
		{name: "a fetch that fails keeps the old digest", upstream: map[string]digest.Digest{"v1": v1b, "v2": v2},
			kept: Kept{"v1": v1}, seedErr: map[digest.Digest]error{v1b: boom},
			wantKept: Kept{"v1": v1, "v2": v2}, wantSeeded: []digest.Digest{v2}, wantFetched: []string{"v2"}, wantFailed: []string{"v1"}},
		{name: "a new tag that fails is not kept", upstream: map[string]digest.Digest{"v2": v2},
			seedErr: map[digest.Digest]error{v2: boom}, wantKept: Kept{}, wantFailed: []string{"v2"}},
		{name: "the tag list fails", upstream: map[string]digest.Digest{"v1": v1}, kept: Kept{"v1": v1}, listErr: boom,
			wantKept: Kept{"v1": v1}, wantErr: true},
	}
	sel, err := Compile(Rule{Upstream: "reg", Repository: "team/app", Tags: []string{"^v[0-9]+$"}, Platforms: []string{"linux/amd64"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			core := &fakeCore{tags: tt.upstream, listErr: tt.listErr, seedErr: tt.seedErr}
			kept, round, err := SyncRepository(t.Context(), core, sel, "team/app", tt.kept)
			if (err != nil) != tt.wantErr {
				t.Fatalf("error: got %v, want one: %v", err, tt.wantErr)
			}
			if !maps.Equal(kept, tt.wantKept) {
				t.Errorf("kept: got %v, want %v", kept, tt.wantKept)
			}
			if !slices.Equal(core.seeded, tt.wantSeeded) {
				t.Errorf("images fetched: got %v, want %v", core.seeded, tt.wantSeeded)
			}
			if !slices.Equal(round.Fetched, tt.wantFetched) || !slices.Equal(round.Dropped, tt.wantDropped) {
				t.Errorf("round: fetched %v, dropped %v; want %v, %v", round.Fetched, round.Dropped, tt.wantFetched, tt.wantDropped)
			}
			if failed := slices.Sorted(maps.Keys(round.Failed)); !slices.Equal(failed, tt.wantFailed) {
				t.Errorf("failed: got %v, want %v", failed, tt.wantFailed)
			}
			if slices.Contains(core.checked, "dev") {
				t.Error("dev, which the rule does not keep, was asked about")
			}
			if len(core.seeded) > 0 && !slices.Equal(core.platform, []string{"linux/amd64"}) {
				t.Errorf("seeded for platforms %v, want the rule's", core.platform)
			}
		})
	}
}
