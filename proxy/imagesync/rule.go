// Package imagesync keeps chosen images cached before anyone asks for
// them: declared rules name an upstream's repositories and the tags to
// keep, and each round lists the tags, picks those a rule matches, and
// fetches what is new or moved through the mirror core, as a pull would.
//
// This file is the rules' language: what a rule says, checked once when
// the configuration is read, and how it picks repositories and tags.
package imagesync

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/Masterminds/semver/v3"
	"github.com/distribution/reference"
)

// Rule is one entry of the configuration's sync section: what to keep
// cached of an upstream.
type Rule struct {
	// Upstream is the name of the upstream the images come from.
	Upstream string
	// Repository is a repository of the upstream, or a prefix ending in
	// "/*" for every repository under it that the upstream lists.
	Repository string
	// Tags are exact tags, or regular expressions anchored at both ends
	// ("^v[0-9]+$"). None: every tag.
	Tags []string
	// Semver, when set, keeps only the tags, of those Tags picked, that
	// are versions within this constraint (">=1.26, <2").
	Semver string
	// Platforms are the platforms of an index to fetch ("linux/amd64",
	// "linux/arm64/v8"). None: every platform.
	Platforms []string
	// Referrers also fetches the signatures and SBOMs that refer to the
	// images.
	Referrers bool
	// Interval is how often the tag list is looked at (default
	// DefaultInterval, at least MinInterval).
	Interval time.Duration
}

const (
	// DefaultInterval is how often a rule's tags are looked at when it
	// does not say.
	DefaultInterval = time.Hour
	// MinInterval is the shortest interval a rule may ask for: each round
	// is a tag list and a HEAD per tag at the upstream.
	MinInterval = time.Second
)

// Selector is a rule checked and compiled: what it picks.
type Selector struct {
	rule       Rule   // as written, the interval defaulted
	prefix     string // with a "/*" repository: what the repositories start with ("team/")
	exact      []string
	patterns   []*regexp.Regexp
	constraint *semver.Constraints
}

var (
	repositoryRegexp = regexp.MustCompile(`^` + reference.NameRegexp.String() + `$`)
	tagRegexp        = regexp.MustCompile(`^` + reference.TagRegexp.String() + `$`)
)

// Compile checks r and returns what it picks. The error names what is
// wrong and how a rule says it.
func Compile(r Rule) (*Selector, error) {
	s := &Selector{rule: r}
	if r.Upstream == "" {
		return nil, fmt.Errorf("no upstream: name the upstream the images come from")
	}
	switch repo := r.Repository; {
	case repo == "":
		return nil, fmt.Errorf("no repository: name one (library/nginx), or a prefix for every repository under it (team/*)")
	case strings.HasSuffix(repo, "/*"):
		s.prefix = strings.TrimSuffix(repo, "*")
		if !repositoryRegexp.MatchString(strings.TrimSuffix(s.prefix, "/")) {
			return nil, fmt.Errorf("repository %q: the prefix before /* is not a repository path", repo)
		}
	case strings.Contains(repo, "*"):
		return nil, fmt.Errorf("repository %q: a wildcard only ends a prefix, as in team/*", repo)
	case !repositoryRegexp.MatchString(repo):
		return nil, fmt.Errorf("repository %q is not a repository path (lowercase, as in library/nginx)", repo)
	}
	for _, t := range r.Tags {
		switch {
		case strings.HasPrefix(t, "^") || strings.HasSuffix(t, "$"):
			if !strings.HasPrefix(t, "^") || !strings.HasSuffix(t, "$") {
				return nil, fmt.Errorf("tag pattern %q: a regular expression is anchored at both ends (^…$)", t)
			}
			re, err := regexp.Compile(t)
			if err != nil {
				return nil, fmt.Errorf("tag pattern %q: %w", t, err)
			}
			s.patterns = append(s.patterns, re)
		case tagRegexp.MatchString(t):
			s.exact = append(s.exact, t)
		default:
			return nil, fmt.Errorf("tag %q is neither a tag nor a regular expression anchored at both ends (^…$)", t)
		}
	}
	if r.Semver != "" {
		c, err := semver.NewConstraint(r.Semver)
		if err != nil {
			return nil, fmt.Errorf("semver %q: %w", r.Semver, err)
		}
		s.constraint = c
	}
	for _, p := range r.Platforms { // as seeding takes them (see proxy.SeedOptions)
		if parts := strings.Split(p, "/"); len(parts) < 2 || len(parts) > 3 || slices.Contains(parts, "") {
			return nil, fmt.Errorf("platform %q: want os/architecture or os/architecture/variant, as in linux/arm64/v8", p)
		}
	}
	switch {
	case r.Interval == 0:
		s.rule.Interval = DefaultInterval
	case r.Interval < MinInterval:
		return nil, fmt.Errorf("interval %v: at least %v (each round lists the tags and asks for each one's manifest)", r.Interval, MinInterval)
	}
	return s, nil
}

// Rule returns the rule as written, its interval defaulted.
func (s *Selector) Rule() Rule { return s.rule }

// Prefix reports whether the rule names every repository under a prefix,
// rather than one repository.
func (s *Selector) Prefix() bool { return s.prefix != "" }

// Repository reports whether repo is one the rule keeps.
func (s *Selector) Repository(repo string) bool {
	if s.prefix != "" {
		return strings.HasPrefix(repo, s.prefix) && len(repo) > len(s.prefix)
	}
	return repo == s.rule.Repository
}

// Tags returns the tags, of those a repository holds, that the rule keeps,
// in the order given: those its tags name (all when it names none), then,
// with a semver constraint, those that are versions within it.
func (s *Selector) Tags(tags []string) []string {
	var out []string
	for _, t := range tags {
		if s.tag(t) {
			out = append(out, t)
		}
	}
	return out
}

func (s *Selector) tag(t string) bool {
	if !s.named(t) {
		return false
	}
	if s.constraint == nil {
		return true
	}
	v, err := semver.NewVersion(t)
	return err == nil && s.constraint.Check(v)
}

// named reports whether the rule's tags name t: all do when it names none.
func (s *Selector) named(t string) bool {
	if len(s.exact) == 0 && len(s.patterns) == 0 || slices.Contains(s.exact, t) {
		return true
	}
	return slices.ContainsFunc(s.patterns, func(re *regexp.Regexp) bool { return re.MatchString(t) })
}
