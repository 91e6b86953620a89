package main

import (
	"bytes"
	"strings"
	"testing"
)

func TestNodeConfigDryRun(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		args     []string
		want     []string
		wantNot  []string
		wantFail bool
	}{
		{name: "containerd, default registries", args: []string{"--mirror", "http://m:5000"},
			want: []string{"/etc/containerd/certs.d/docker.io/hosts.toml", `server = "https://registry-1.docker.io"`,
				"/etc/containerd/certs.d/ghcr.io/hosts.toml", `[host."http://m:5000"]`, `config_path = "/etc/containerd/certs.d"`},
			wantNot: []string{`capabilities = ["push"]`}},
		{name: "containerd, no fallback", args: []string{"--mirror", "https://m", "--registry", "quay.io", "--no-fallback"},
			want: []string{`server = "https://quay.io"`, `capabilities = ["push"]`, `[host."https://m"]`}},
		{name: "CRI-O", args: []string{"--mirror", "http://m:5000", "--registry", "docker.io", "--crio"},
			want: []string{`prefix = "docker.io"`, `location = "registry-1.docker.io"`, "[[registry.mirror]]", `location = "m:5000/docker.io"`, "insecure = true"}},
		{name: "CRI-O, no fallback", args: []string{"--mirror", "https://m", "--registry", "ghcr.io", "--crio", "--no-fallback"},
			want: []string{`location = "m/ghcr.io"`, "insecure = false"}, wantNot: []string{"[[registry.mirror]]", `location = "ghcr.io"`}},
		{name: "mirror with a path", args: []string{"--mirror", "http://m:5000/v2"}, wantFail: true},
		{name: "no mirror", args: nil, wantFail: true},
		{name: "registry with a path", args: []string{"--mirror", "http://m", "--registry", "docker.io/library"}, wantFail: true},
	} {
		var out, errOut bytes.Buffer
		err := nodeConfig(append(tc.args, "--dry-run"), &out, &errOut)
		if (err != nil) != tc.wantFail {
			t.Errorf("%s: err %v, want failure %v", tc.name, err, tc.wantFail)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("%s: output lacks %q:\n%s", tc.name, w, out.String())
			}
		}
		for _, w := range tc.wantNot {
			if strings.Contains(out.String(), w) {
				t.Errorf("%s: output has %q:\n%s", tc.name, w, out.String())
			}
		}
	}
}
