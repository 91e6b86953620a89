package imagesync

import (
	"context"
	"fmt"
	"slices"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/proxy"
	"github.com/pullproxy/pullproxy/upstream"
)

// Core is what a round asks of the mirror core (proxy.Server): the
// repositories under a prefix (for a prefix rule), a repository's tags and each tag's digest, as the upstream answers now,
// and an image fetched through the same downloads and checks as a pull's.
type Core interface {
	Repositories(ctx context.Context, upstreamName, prefix string) ([]string, error)
	Tags(ctx context.Context, upstreamName, repo string) ([]string, error)
	CheckTag(ctx context.Context, upstreamName, repo, tag string) (upstream.Descriptor, error)
	Seed(ctx context.Context, upstreamName, repo, ref string, opts proxy.SeedOptions) (digest.Digest, error)
}

var _ Core = (*proxy.Server)(nil)

// Kept is what a rule keeps cached of one repository: the digest each
// tag pointed to when it was last synced.
type Kept map[string]digest.Digest

// Round is what one round over a repository did.
type Round struct {
	Picked  int              // tags the rule keeps, of those the upstream lists
	Fetched []string         // tags new or moved, whose images were fetched
	Dropped []string         // tags kept before that the rule no longer keeps, or the upstream no longer lists
	Failed  map[string]error // tags whose check or fetch failed: they keep what they had
}

// SyncRepository runs one round of sel over repo: it lists the tags, picks
// those sel keeps, asks the upstream what each points to, and fetches the
// images of those new or moved since kept. A tag whose digest is
// unchanged costs the round its HEAD and nothing more. It returns what the
// rule keeps now. A tag that fails keeps its earlier digest (its image is
// still cached); listing the tags failing fails the round, kept as it was.
func SyncRepository(ctx context.Context, core Core, sel *Selector, repo string, kept Kept) (Kept, Round, error) {
	r := sel.Rule()
	listed, err := core.Tags(ctx, r.Upstream, repo)
	if err != nil {
		return kept, Round{}, fmt.Errorf("sync of %s/%s: %w", r.Upstream, repo, err)
	}
	picked := sel.Tags(listed)
	round := Round{Picked: len(picked)}
	next := make(Kept, len(picked))
	opts := proxy.SeedOptions{Platforms: r.Platforms, Referrers: r.Referrers}
	for _, tag := range picked {
		if err := ctx.Err(); err != nil {
			return kept, round, err
		}
		desc, err := core.CheckTag(ctx, r.Upstream, repo, tag)
		if err == nil && desc.Digest == kept[tag] {
			next[tag] = desc.Digest
			continue
		}
		if err == nil {
			_, err = core.Seed(ctx, r.Upstream, repo, desc.Digest.String(), opts)
		}
		if err != nil {
			if round.Failed == nil {
				round.Failed = map[string]error{}
			}
			round.Failed[tag] = err
			if d, ok := kept[tag]; ok {
				next[tag] = d
			}
			continue
		}
		next[tag] = desc.Digest
		round.Fetched = append(round.Fetched, tag)
	}
	for tag := range kept {
		if _, ok := next[tag]; !ok {
			round.Dropped = append(round.Dropped, tag)
		}
	}
	slices.Sort(round.Dropped)
	return next, round, nil
}
