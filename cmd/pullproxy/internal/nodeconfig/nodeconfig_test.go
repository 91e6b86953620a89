package nodeconfig

import (
	"net/url"
	"strings"
	"testing"
)

func TestParseRegistry(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in, name, server, prefix string
		wantErr                  bool
	}{
		{in: "docker.io", name: "docker.io", server: "https://registry-1.docker.io", prefix: "docker.io"},
		{in: "https://index.docker.io", name: "docker.io", server: "https://registry-1.docker.io", prefix: "docker.io"},
		{in: "HTTPS://Registry.Internal:5000/", name: "registry.internal:5000", server: "https://registry.internal:5000", prefix: "registry.internal_5000"},
		{in: "http://registry.internal:5000", name: "registry.internal:5000", server: "http://registry.internal:5000", prefix: "registry.internal_5000"},
		{in: "docker.io/library", wantErr: true},
		{in: "http://registry.internal:5000/v2", wantErr: true},
		{in: "https://user:pw@registry.internal", wantErr: true},
		{in: "oci://registry.internal", wantErr: true},
		{in: "registry.internal_5000", wantErr: true},
		{in: "http://docker.io", wantErr: true},
	} {
		r, err := ParseRegistry(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParseRegistry(%q): got %v, want error %v", tt.in, err, tt.wantErr)
			continue
		}
		if err == nil && (r.Name != tt.name || r.server() != tt.server || r.mirrorPrefix() != tt.prefix) {
			t.Errorf("ParseRegistry(%q): got %s at %s through %s, want %s at %s through %s",
				tt.in, r.Name, r.server(), r.mirrorPrefix(), tt.name, tt.server, tt.prefix)
		}
	}
}

// TestFiles: without fallback, containerd may only push to the registry
// itself, and CRI-O's location is the mirror too.
func TestFiles(t *testing.T) {
	t.Parallel()
	mirror, _ := url.Parse("http://m:5000")
	quay, _ := ParseRegistry("quay.io")
	for _, tt := range []struct {
		name, got string
		want      []string
		wantNot   []string
	}{
		{"hosts.toml", HostsTOML(mirror, quay, false), []string{`server = "https://quay.io"`, `[host."http://m:5000"]`}, []string{`capabilities = ["push"]`}},
		{"hosts.toml, no fallback", HostsTOML(mirror, quay, true), []string{`capabilities = ["push"]`}, nil},
		{"registries.conf", CRIORegistries(mirror, []Registry{quay}, false),
			[]string{`prefix = "quay.io"`, `location = "quay.io"`, "[[registry.mirror]]", `location = "m:5000/quay.io"`}, nil},
		{"registries.conf, no fallback", CRIORegistries(mirror, []Registry{quay}, true),
			[]string{"prefix = \"quay.io\"\nlocation = \"m:5000/quay.io\"\ninsecure = true\n"}, []string{"[[registry.mirror]]"}},
	} {
		for _, w := range tt.want {
			if !strings.Contains(tt.got, w) {
				t.Errorf("%s: got\n%s\nwant it to hold %q", tt.name, tt.got, w)
			}
		}
		for _, w := range tt.wantNot {
			if strings.Contains(tt.got, w) {
				t.Errorf("%s: got\n%s\nwant no %q", tt.name, tt.got, w)
			}
		}
	}
}
