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
		{name: "containerd, plain-HTTP registry", args: []string{"--mirror", "http://m:5000", "--registry", "http://registry.internal:5000"},
			want: []string{"/etc/containerd/certs.d/registry.internal:5000/hosts.toml", `server = "http://registry.internal:5000"`,
				`[host."http://m:5000"]`}},
		{name: "containerd, https registry with a port", args: []string{"--mirror", "http://m:5000", "--registry", "HTTPS://Registry.Internal:5000/"},
			want: []string{"/etc/containerd/certs.d/registry.internal:5000/hosts.toml", `server = "https://registry.internal:5000"`}},
		{name: "containerd, bare HOST:PORT", args: []string{"--mirror", "http://m:5000", "--registry", "registry.internal:5000"},
			want: []string{"/etc/containerd/certs.d/registry.internal:5000/hosts.toml", `server = "https://registry.internal:5000"`}},
		{name: "containerd, https docker.io", args: []string{"--mirror", "http://m:5000", "--registry", "https://index.docker.io"},
			want: []string{"/etc/containerd/certs.d/docker.io/hosts.toml", `server = "https://registry-1.docker.io"`}},
		{name: "CRI-O, plain-HTTP registry with a port", args: []string{"--mirror", "https://m", "--registry", "http://registry.internal:5000", "--crio"},
			want: []string{"prefix = \"registry.internal:5000\"\nlocation = \"registry.internal:5000\"\ninsecure = true\n",
				"[[registry.mirror]]\nlocation = \"m/registry.internal_5000\"\ninsecure = false\n"},
			wantNot: []string{"m/registry.internal:5000"}},
		{name: "CRI-O, https registry with a port", args: []string{"--mirror", "http://m:5000", "--registry", "registry.internal:5000", "--crio"},
			want: []string{"location = \"registry.internal:5000\"\ninsecure = false\n",
				"location = \"m:5000/registry.internal_5000\"\ninsecure = true\n"}},
		{name: "CRI-O, HOST:PORT, no fallback", args: []string{"--mirror", "http://m:5000", "--registry", "http://registry.internal:5000", "--crio", "--no-fallback"},
			want:    []string{"prefix = \"registry.internal:5000\"\nlocation = \"m:5000/registry.internal_5000\"\ninsecure = true\n"},
			wantNot: []string{"[[registry.mirror]]", `location = "registry.internal:5000"`}},
		{name: "mirror with a path", args: []string{"--mirror", "http://m:5000/v2"}, wantFail: true},
		{name: "no mirror", args: nil, wantFail: true},
		{name: "registry with a path", args: []string{"--mirror", "http://m", "--registry", "docker.io/library"}, wantFail: true},
		{name: "registry URL with a path", args: []string{"--mirror", "http://m", "--registry", "http://registry.internal:5000/v2"}, wantFail: true},
		{name: "registry URL with a query", args: []string{"--mirror", "http://m", "--registry", "http://registry.internal:5000?ns=x"}, wantFail: true},
		{name: "registry URL with a fragment", args: []string{"--mirror", "http://m", "--registry", "https://registry.internal#x"}, wantFail: true},
		{name: "registry URL with credentials", args: []string{"--mirror", "http://m", "--registry", "https://user:pw@registry.internal"}, wantFail: true},
		{name: "registry URL, other scheme", args: []string{"--mirror", "http://m", "--registry", "oci://registry.internal"}, wantFail: true},
		{name: "registry URL without a host", args: []string{"--mirror", "http://m", "--registry", "http://"}, wantFail: true},
		{name: "registry with a port that is no number", args: []string{"--mirror", "http://m", "--registry", "registry.internal:http"}, wantFail: true},
		{name: "registry with an underscore", args: []string{"--mirror", "http://m", "--registry", "registry.internal_5000"}, wantFail: true},
		{name: "plain-HTTP docker.io", args: []string{"--mirror", "http://m", "--registry", "http://docker.io"}, wantFail: true},
		{name: "CRI-O, IPv6 registry", args: []string{"--mirror", "http://m", "--registry", "[::1]:5000", "--crio"}, wantFail: true},
	} {
		var out, errOut bytes.Buffer
		err := nodeConfig(append(tc.args, "--dry-run"), &out, &errOut)
		if (err != nil) != tc.wantFail {
			t.Errorf("%s: err %v, want failure %v", tc.name, err, tc.wantFail)
			continue
		}
		if err != nil && strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: error %q is more than one line", tc.name, err)
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
