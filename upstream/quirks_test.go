package upstream

import (
	"net/url"
	"testing"
)

func TestCanonicalName(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in, want string
	}{
		{"docker.io", "docker.io"},
		{"index.docker.io", "docker.io"},
		{"registry-1.docker.io", "docker.io"},
		{"Index.Docker.IO", "docker.io"},
		{"REGISTRY-1.DOCKER.IO", "docker.io"},
		{"Docker.io", "docker.io"},
		{"ghcr.io", "ghcr.io"},
		{"GHCR.io", "ghcr.io"},
		{"registry.k8s.io", "registry.k8s.io"},
		{"123456789012.dkr.ecr.us-east-1.amazonaws.com", "123456789012.dkr.ecr.us-east-1.amazonaws.com"},
		{"localhost:5000", "localhost:5000"},
		{"registry.docker.io", "registry.docker.io"}, // the token service name, not a registry name
		{"", ""},
	}
	for _, tt := range tests {
		if got := CanonicalName(tt.in); got != tt.want {
			t.Errorf("CanonicalName(%q): got %v, want %v", tt.in, got, tt.want)
		}
	}
}

func TestNormalizeRepository(t *testing.T) {
	t.Parallel()
	tests := []struct {
		upstream, repo, want string
	}{
		{"docker.io", "alpine", "library/alpine"},
		{"docker.io", "library/alpine", "library/alpine"},
		{"docker.io", "bitnami/redis", "bitnami/redis"},
		{"docker.io", "org/team/app", "org/team/app"},
		{"ghcr.io", "alpine", "alpine"},
		{"quay.io", "coreos/etcd", "coreos/etcd"},
		{"registry.k8s.io", "pause", "pause"},
		// Only the canonical name: callers map aliases with CanonicalName first.
		{"index.docker.io", "alpine", "alpine"},
	}
	for _, tt := range tests {
		if got := NormalizeRepository(tt.upstream, tt.repo); got != tt.want {
			t.Errorf("NormalizeRepository(%q, %q): got %v, want %v", tt.upstream, tt.repo, got, tt.want)
		}
	}
}

func TestDefaults(t *testing.T) {
	t.Parallel()
	d := Defaults()
	if len(d) == 0 {
		t.Fatalf("got no defaults, want some")
	}
	if want := (Default{Name: DockerHub, URL: "https://registry-1.docker.io"}); d[0] != want {
		t.Errorf("first default: got %+v, want %+v", d[0], want)
	}
	seen := map[string]bool{}
	for _, u := range d {
		if seen[u.Name] {
			t.Errorf("%s: got it twice, want each name once", u.Name)
		}
		seen[u.Name] = true
		if got := CanonicalName(u.Name); got != u.Name {
			t.Errorf("%s: got canonical name %v, want the name itself", u.Name, got)
		}
		if p, err := url.Parse(u.URL); err != nil || p.Scheme != "https" || p.Host == "" || p.Path != "" {
			t.Errorf("%s: got URL %q, want https://host", u.Name, u.URL)
		}
		r, err := New(u.Name, []string{u.URL}, WithLogger(discardLogger))
		if err != nil {
			t.Errorf("New(%s): got %v, want no error", u.Name, err)
			continue
		}
		if got := r.Endpoints(); len(got) != 1 || got[0] != u.URL {
			t.Errorf("%s: got endpoints %v, want [%v]", u.Name, got, u.URL)
		}
	}
	// Each call returns a fresh slice: changing one leaves the next alone.
	d[0] = Default{Name: "changed", URL: "https://changed.example"}
	copy(d[1:], d[2:])
	again := Defaults()
	if again[0].Name != DockerHub {
		t.Errorf("first default after changing an earlier result: got %v, want %v", again[0].Name, DockerHub)
	}
	if len(again) != len(seen) {
		t.Errorf("defaults after changing an earlier result: got %d, want %d", len(again), len(seen))
	}
}
