package config

import (
	"fmt"
	"time"

	"github.com/pullproxy/pullproxy/proxy/imagesync"
	"github.com/pullproxy/pullproxy/upstream"
)

// SyncRule is one entry of the sync section: images kept cached before
// anyone asks (see docs/sync.md).
type SyncRule struct {
	Upstream   string        `yaml:"upstream"`   // an upstream's name
	Repository string        `yaml:"repository"` // library/nginx, or team/* for every repository the catalog lists under team/
	Tags       []string      `yaml:"tags"`       // exact tags or ^…$ regular expressions; none: every tag
	Semver     string        `yaml:"semver"`     // a constraint on the tags picked (">=1.26, <2")
	Platforms  []string      `yaml:"platforms"`  // an index's platforms to fetch; none: every one
	Referrers  bool          `yaml:"referrers"`  // also fetch the signatures and SBOMs that refer to them
	Interval   time.Duration `yaml:"interval"`   // how often the tags are looked at; default 1h
}

// SyncRules returns the sync section as the rule runner takes it, the
// upstream names canonical as the store keys them.
func (c File) SyncRules() []imagesync.Rule {
	out := make([]imagesync.Rule, 0, len(c.Sync))
	for _, r := range c.Sync {
		out = append(out, imagesync.Rule{Upstream: upstream.CanonicalName(r.Upstream), Repository: r.Repository,
			Tags: r.Tags, Semver: r.Semver, Platforms: r.Platforms, Referrers: r.Referrers, Interval: r.Interval})
	}
	return out
}

// validateSync checks each rule, and that it names an upstream configured
// and online: an offline upstream has nothing to sync from.
func (c File) validateSync(upstreams map[string]bool) []error {
	var errs []error
	for i, r := range c.SyncRules() {
		if _, err := imagesync.Compile(r); err != nil {
			errs = append(errs, fmt.Errorf("sync[%d]: %w", i, err))
			continue
		}
		u := c.Upstream(r.Upstream)
		switch {
		case !upstreams[r.Upstream] || u == nil:
			errs = append(errs, fmt.Errorf("sync[%d]: upstream %s is not among the upstreams", i, c.Sync[i].Upstream))
		case c.Offline || u.Offline:
			errs = append(errs, fmt.Errorf("sync[%d]: upstream %s is offline: there is nothing to sync from", i, c.Sync[i].Upstream))
		}
	}
	return errs
}
