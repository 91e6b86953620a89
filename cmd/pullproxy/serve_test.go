package main

import (
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
)

func urls(u config.Upstream) []string {
	var out []string
	for _, e := range u.Endpoints {
		out = append(out, e.URL)
	}
	return out
}

func TestServeConfig(t *testing.T) {
	t.Parallel()
	file := writeConfig(t, `
listen: 0.0.0.0:6000
data_dir: /var/lib/pullproxy
tag_ttl: 30s
blob_loop: false
upstreams:
  - name: docker.io
    endpoints:
      - url: https://mirror.example
  - name: ghcr.io
    endpoints:
      - url: https://ghcr.io
`)
	for _, tc := range []struct {
		name      string
		args      []string
		listen    string
		dataDir   string
		tagTTL    time.Duration
		noLoop    bool
		upstreams map[string][]string
	}{
		{
			name: "defaults", listen: "127.0.0.1:5000", dataDir: "./data", tagTTL: 5 * time.Minute,
			upstreams: map[string][]string{
				"docker.io": {"https://registry-1.docker.io"}, "ghcr.io": {"https://ghcr.io"},
				"quay.io": {"https://quay.io"}, "registry.k8s.io": {"https://registry.k8s.io"},
				"public.ecr.aws": {"https://public.ecr.aws"}, "gcr.io": {"https://gcr.io"},
				"mcr.microsoft.com": {"https://mcr.microsoft.com"},
			},
		},
		{
			name: "flag upstreams replace the defaults", args: []string{"--upstream", "reg.test:5000=http://127.0.0.1:1,http://127.0.0.1:2"},
			listen: "127.0.0.1:5000", dataDir: "./data", tagTTL: 5 * time.Minute,
			upstreams: map[string][]string{"reg.test:5000": {"http://127.0.0.1:1", "http://127.0.0.1:2"}},
		},
		{
			name: "file", args: []string{"--config", file},
			listen: "0.0.0.0:6000", dataDir: "/var/lib/pullproxy", tagTTL: 30 * time.Second, noLoop: true,
			upstreams: map[string][]string{"docker.io": {"https://mirror.example"}, "ghcr.io": {"https://ghcr.io"}},
		},
		{
			name:   "flags override the file",
			args:   []string{"--config", file, "--listen", ":7000", "--data-dir", "/d", "--upstream", "docker.io=https://other.example", "--upstream", "quay.io=https://quay.io"},
			listen: ":7000", dataDir: "/d", tagTTL: 30 * time.Second, noLoop: true,
			upstreams: map[string][]string{"docker.io": {"https://other.example"}, "ghcr.io": {"https://ghcr.io"}, "quay.io": {"https://quay.io"}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := serveConfig(tc.args, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Listen != tc.listen || cfg.DataDir != tc.dataDir || *cfg.TagTTL != tc.tagTTL || *cfg.BlobLoop == tc.noLoop {
				t.Errorf("got listen %q data_dir %q tag_ttl %v blob_loop %v, want %q %q %v %v", cfg.Listen, cfg.DataDir, *cfg.TagTTL, *cfg.BlobLoop,
					tc.listen, tc.dataDir, tc.tagTTL, !tc.noLoop)
			}
			got := map[string][]string{}
			for _, u := range cfg.Upstreams {
				got[u.Name] = urls(u)
			}
			if !reflect.DeepEqual(got, tc.upstreams) {
				t.Errorf("upstreams: got %v, want %v", got, tc.upstreams)
			}
		})
	}
}

func TestServeConfigErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, file string
		args       []string
		want       string
	}{
		{name: "unknown key", file: "listen: :5000\nlisen: :6000\n", want: "field lisen not found"},
		{name: "duplicate upstream", file: "upstreams:\n- name: a.io\n  endpoints: [{url: https://a.io}]\n- name: a.io\n  endpoints: [{url: https://a.io}]\n", want: "a.io is configured twice"},
		{name: "upstream without endpoints", file: "upstreams:\n- name: a.io\n", want: "upstream a.io: no endpoints"},
		{name: "default not configured", file: "default_upstream: b.io\nupstreams:\n- name: a.io\n  endpoints: [{url: https://a.io}]\n", want: "default_upstream b.io is not among the upstreams"},
		{name: "bad duration", file: "tag_ttl: soon\n", want: "line 1: cannot unmarshal !!str `soon` into time.Duration"},
		{name: "bad upstream flag", args: []string{"--upstream", "docker.io"}, want: "want NAME=URL"},
		{name: "stray argument", args: []string{"extra"}, want: `unexpected argument "extra"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := tc.args
			if tc.file != "" {
				args = append(args, "--config", writeConfig(t, tc.file))
			}
			_, err := serveConfig(args, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	if err := run(t.Context(), []string{"version"}, &out, io.Discard); err != nil || !strings.HasPrefix(out.String(), "pullproxy ") {
		t.Errorf("got %q, %v; want a version line", out.String(), err)
	}
}
