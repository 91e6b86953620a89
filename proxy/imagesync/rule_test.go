package imagesync

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// TestCompileRefuses: a rule that cannot be meant as written is refused,
// naming what is wrong.
func TestCompileRefuses(t *testing.T) {
	t.Parallel()
	ok := Rule{Upstream: "docker.io", Repository: "library/nginx"}
	tests := []struct {
		name string
		edit func(*Rule)
		want string // in the error
	}{
		{"no upstream", func(r *Rule) { r.Upstream = "" }, "no upstream"},
		{"no repository", func(r *Rule) { r.Repository = "" }, "no repository"},
		{"uppercase repository", func(r *Rule) { r.Repository = "Library/Nginx" }, "not a repository path"},
		{"wildcard inside", func(r *Rule) { r.Repository = "team/*/app" }, "only ends a prefix"},
		{"bare wildcard", func(r *Rule) { r.Repository = "*" }, "only ends a prefix"},
		{"bad prefix", func(r *Rule) { r.Repository = "Team/*" }, "prefix before /*"},
		{"pattern anchored at one end", func(r *Rule) { r.Tags = []string{"^v[0-9]+"} }, "anchored at both ends"},
		{"pattern that does not compile", func(r *Rule) { r.Tags = []string{"^v[0-9+$"} }, "tag pattern"},
		{"unanchored pattern", func(r *Rule) { r.Tags = []string{"v[0-9]+"} }, "neither a tag nor"},
		{"bad semver", func(r *Rule) { r.Semver = ">=one" }, "semver"},
		{"platform without architecture", func(r *Rule) { r.Platforms = []string{"linux"} }, "os/architecture"},
		{"platform with an empty part", func(r *Rule) { r.Platforms = []string{"linux//v8"} }, "os/architecture"},
		{"interval too short", func(r *Rule) { r.Interval = 100 * time.Millisecond }, "at least"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := ok
			tt.edit(&r)
			if _, err := Compile(r); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Compile: got %v, want an error saying %q", err, tt.want)
			}
		})
	}
	s, err := Compile(ok)
	if err != nil {
		t.Fatalf("Compile(%+v): %v", ok, err)
	}
	if got := s.Rule().Interval; got != DefaultInterval {
		t.Errorf("interval not given: got %v, want %v", got, DefaultInterval)
	}
}

// TestSelectorTags: exact tags and anchored patterns pick tags; a semver
// constraint then keeps the versions within it; a rule naming no tag
// takes every tag.
func TestSelectorTags(t *testing.T) {
	t.Parallel()
	held := []string{"latest", "dev", "v1", "v2", "v10", "1.25.3", "1.26.0", "1.27", "1.27.1", "1.28.0-rc.1", "2.0.0", "v1-debug"}
	tests := []struct {
		name   string
		tags   []string
		semver string
		want   []string
	}{
		{"exact", []string{"latest", "1.27", "not-held"}, "", []string{"latest", "1.27"}},
		{"pattern", []string{"^v[0-9]+$"}, "", []string{"v1", "v2", "v10"}},
		{"exact and pattern", []string{"dev", `^1\.2[6-9]\.[0-9]+$`}, "", []string{"dev", "1.26.0", "1.27.1"}},
		{"every tag", nil, "", held},
		{"semver on every tag", nil, ">=1.26, <2", []string{"1.26.0", "1.27", "1.27.1"}},
		{"semver after tags", []string{`^1\.[0-9.]+$`, "2.0.0"}, ">=1.27", []string{"1.27", "1.27.1", "2.0.0"}},
		{"semver with a prerelease", nil, ">=1.28.0-rc.0", []string{"v2", "v10", "1.28.0-rc.1", "2.0.0"}}, // v2 is 2.0.0
		{"semver and v prefixes", []string{"^v[0-9]+$"}, ">=2", []string{"v2", "v10"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := Compile(Rule{Upstream: "docker.io", Repository: "library/nginx", Tags: tt.tags, Semver: tt.semver})
			if err != nil {
				t.Fatal(err)
			}
			if got := s.Tags(held); !slices.Equal(got, tt.want) {
				t.Errorf("Tags: got %v, want %v", got, tt.want)
			}
		})
	}
}

// TestSelectorRepository: a rule keeps its repository, or, with a prefix,
// every repository under it and nothing beside it.
func TestSelectorRepository(t *testing.T) {
	t.Parallel()
	tests := []struct {
		repository string
		repo       string
		want       bool
	}{
		{"library/nginx", "library/nginx", true},
		{"library/nginx", "library/nginx-debug", false},
		{"team/*", "team/app", true},
		{"team/*", "team/app/worker", true},
		{"team/*", "team", false},
		{"team/*", "team/", false},
		{"team/*", "teams/app", false},
	}
	for _, tt := range tests {
		s, err := Compile(Rule{Upstream: "reg", Repository: tt.repository})
		if err != nil {
			t.Fatal(err)
		}
		if got := s.Repository(tt.repo); got != tt.want {
			t.Errorf("rule %q, repository %q: got %v, want %v", tt.repository, tt.repo, got, tt.want)
		}
		if got, want := s.Prefix(), strings.HasSuffix(tt.repository, "/*"); got != want {
			t.Errorf("rule %q: Prefix got %v, want %v", tt.repository, got, want)
		}
	}
}
