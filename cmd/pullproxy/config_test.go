package main

import (
	"encoding/pem"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/upstream"
)

func urls(u upstreamConfig) []string {
	var out []string
	for _, e := range u.Endpoints {
		out = append(out, e.URL)
	}
	return out
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "pullproxy.yaml")
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestServeConfig(t *testing.T) {
	t.Parallel()
	file := writeFile(t, `
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
				args = append(args, "--config", writeFile(t, tc.file))
			}
			_, err := serveConfig(args, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// TestExampleConfig keeps the documented example loadable.
func TestExampleConfig(t *testing.T) {
	t.Parallel()
	cfg, err := serveConfig([]string{"--config", "../../deploy/pullproxy.example.yaml"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Upstreams) != 5 || cfg.DefaultUpstream != "docker.io" {
		t.Errorf("got %d upstreams and default %q, want 5 and docker.io", len(cfg.Upstreams), cfg.DefaultUpstream)
	}
	want := upstream.FetchConfig{ConnectionBudget: 1 << 20, MaxConnectionBudget: 64 << 20, MinConnectionBudget: 64 << 10,
		MaxConnections: 64, StallTimeout: 2 * time.Second, FirstByteTimeout: 10 * time.Second, MaxAttempts: 8, MinGoodput: 4 << 10}
	if got := cfg.Fetch.options(); got != want {
		t.Errorf("fetch settings: got %+v, want %+v", got, want)
	}
	if !*cfg.BlobLoop {
		t.Error("blob_loop: got false, want true")
	}
	if got := cfg.Upstreams[2].CAFile; got != "/etc/pullproxy/corp-ca.pem" {
		t.Errorf("ca_file of the third upstream: got %q", got)
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	if err := run(t.Context(), []string{"version"}, &out, io.Discard); err != nil || !strings.HasPrefix(out.String(), "pullproxy ") {
		t.Errorf("got %q, %v; want a version line", out.String(), err)
	}
}

func TestAuthConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pwFile := filepath.Join(dir, "pw")
	os.WriteFile(pwFile, []byte("s3cret\n"), 0o600)
	dockerCfg := filepath.Join(dir, "config.json")
	os.WriteFile(dockerCfg, []byte(`{"auths":{"https://index.docker.io/v1/":{"auth":"dXNlcjpwYXNz"}}}`), 0o600)
	for _, tc := range []struct {
		name string
		auth authConfig
		want string // error substring; "" for success
	}{
		{"anonymous", authConfig{}, ""},
		{"basic", authConfig{Type: "basic", Username: "u", Password: "p"}, ""},
		{"basic from a file", authConfig{Type: "basic", Username: "u", PasswordFile: pwFile}, ""},
		{"basic without password", authConfig{Type: "basic", Username: "u"}, "needs username and password"},
		{"basic, file missing", authConfig{Type: "basic", Username: "u", PasswordFile: filepath.Join(dir, "nope")}, "reading password_file"},
		{"dockerconfig", authConfig{Type: "dockerconfig", Config: dockerCfg}, ""},
		{"dockerconfig missing", authConfig{Type: "dockerconfig", Config: filepath.Join(dir, "nope")}, "reading docker config"},
		{"ecr", authConfig{Type: "ecr", APIEndpoint: "http://127.0.0.1:1"}, ""},
		{"unknown type", authConfig{Type: "kerberos"}, `auth type "kerberos"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.auth.credentials("reg.test", slog.New(slog.DiscardHandler), nil)
			if (err == nil) != (tc.want == "") || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("got %v, want %q", err, tc.want)
			}
		})
	}
}

func TestECRConfigNeedsRegion(t *testing.T) {
	t.Parallel()
	file := writeFile(t, `
upstreams:
  - name: 123456789012.dkr.ecr.us-east-2.amazonaws.com
    auth: {type: ecr}
    endpoints:
      - url: https://123456789012.dkr.ecr.us-east-2.amazonaws.com
      - url: https://ecr-replica.internal
`)
	_, err := serveConfig([]string{"--config", file}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "https://ecr-replica.internal is not an ECR host: give its region") {
		t.Errorf("got %v, want an error asking for the replica's region", err)
	}
}

// TestUpstreamTLSConfig: ca_file adds a bundle to the system's roots, and is
// refused with its name when unreadable or empty of certificates;
// insecure_skip_verify is warned about.
func TestUpstreamTLSConfig(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	t.Cleanup(srv.Close)
	good := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(good, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.pem")
	if err := os.WriteFile(empty, []byte("not a certificate\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	var logged strings.Builder
	log := slog.New(slog.NewTextHandler(&logged, nil))
	if cfg, err := (upstreamConfig{Name: "u"}).tlsConfig(log); cfg != nil || err != nil {
		t.Errorf("no setting: got %v, %v, want nil, nil (the defaults)", cfg, err)
	}
	cfg, err := (upstreamConfig{Name: "u", CAFile: good}).tlsConfig(log)
	if err != nil {
		t.Fatalf("ca_file: got %v", err)
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg}}
	resp, err := client.Get(srv.URL)
	if err != nil {
		t.Fatalf("GET with the CA: %v", err)
	}
	resp.Body.Close()
	for _, bad := range []string{empty, filepath.Join(dir, "missing.pem")} {
		if _, err := (upstreamConfig{Name: "u", CAFile: bad}).tlsConfig(log); err == nil || !strings.Contains(err.Error(), "ca_file") {
			t.Errorf("ca_file %s: got %v, want an error naming ca_file", bad, err)
		}
	}
	if logged.Len() != 0 {
		t.Errorf("logged %q, want nothing", logged.String())
	}
	cfg, err = (upstreamConfig{Name: "u", InsecureSkipVerify: true}).tlsConfig(log)
	if err != nil || !cfg.InsecureSkipVerify {
		t.Fatalf("insecure_skip_verify: got %+v, %v", cfg, err)
	}
	if !strings.Contains(logged.String(), "level=WARN") || !strings.Contains(logged.String(), "insecure_skip_verify") {
		t.Errorf("insecure_skip_verify: logged %q, want a warning naming it", logged.String())
	}
}
