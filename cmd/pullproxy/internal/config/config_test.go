package config

import (
	"encoding/pem"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/upstream"
)

// load reads path as serve does without flags: over the defaults, the
// public registries when it names no upstream, validated.
func load(path string) (File, error) {
	cfg := Default()
	if err := LoadFile(path, &cfg); err != nil {
		return cfg, err
	}
	cfg.Upstreams = WithDefaultUpstreams(cfg.Upstreams)
	return cfg, cfg.Validate()
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "pullproxy.yaml")
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestLoadErrors: the file's mistakes are refused, each named.
func TestLoadErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, file, want string }{
		{name: "unknown key", file: "listen: :5000\nlisen: :6000\n", want: "field lisen not found"},
		{name: "duplicate upstream", file: "upstreams:\n- name: a.io\n  endpoints: [{url: https://a.io}]\n- name: a.io\n  endpoints: [{url: https://a.io}]\n", want: "a.io is configured twice"},
		{name: "upstream without endpoints", file: "upstreams:\n- name: a.io\n", want: "upstream a.io: no endpoints"},
		{name: "default not configured", file: "default_upstream: b.io\nupstreams:\n- name: a.io\n  endpoints: [{url: https://a.io}]\n", want: "default_upstream b.io is not among the upstreams"},
		{name: "bad duration", file: "tag_ttl: soon\n", want: "line 1: cannot unmarshal !!str `soon` into time.Duration"},
		{name: "pin of no upstream", file: "pin: [other.io/app:v1]\nupstreams:\n- name: a.io\n  endpoints: [{url: https://a.io}]\n", want: "other.io is not among the upstreams"},
		{name: "bad max_size", file: "max_size: lots\n", want: "max_size"},
		{name: "s3 without a bucket", file: "storage: {type: s3}\n", want: "type s3 needs a bucket"},
		{name: "background_share above 1", file: "fetch: {background_share: 1.5}\n", want: "background_share 1.5 is not in (0, 1]"},
		{name: "sync of no upstream", file: "sync: [{upstream: other.io, repository: app}]\nupstreams:\n- name: a.io\n  endpoints: [{url: https://a.io}]\n", want: "sync[0]: upstream other.io is not among the upstreams"},
		{name: "sync of an offline upstream", file: "sync: [{upstream: a.io, repository: app}]\nupstreams:\n- name: a.io\n  offline: true\n", want: "sync[0]: upstream a.io is offline"},
		{name: "sync tag pattern not anchored", file: "sync: [{upstream: docker.io, repository: library/nginx, tags: ['^1\\.27']}]\n", want: "sync[0]: tag pattern \"^1\\\\.27\": a regular expression is anchored at both ends"},
		{name: "sync wildcard mid-path", file: "sync: [{upstream: docker.io, repository: 'team/*/app'}]\n", want: "a wildcard only ends a prefix"},
		{name: "sync interval too short", file: "sync: [{upstream: docker.io, repository: library/nginx, interval: 10ms}]\n", want: "interval 10ms: at least 1s"},
		{name: "sync unknown key", file: "sync: [{upstream: docker.io, repository: library/nginx, tag: [v1]}]\n", want: "field tag not found"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := load(writeFile(t, tc.file))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestParseStoreBound(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in      string
		want    StoreBound
		wantErr bool
	}{
		{in: "100MiB", want: StoreBound{bytes: 100 << 20, set: true}},
		{in: "2GB", want: StoreBound{bytes: 2e9, set: true}},
		{in: "80%", want: StoreBound{percent: 80, set: true}},
		{in: " 92.5 % ", want: StoreBound{percent: 92.5, set: true}},
		{in: "off", want: Unbounded()},
		{in: "0", wantErr: true},
		{in: "-1", wantErr: true},
		{in: "101%", wantErr: true},
		{in: "3%", wantErr: true},
		{in: "lots", wantErr: true},
	} {
		got, err := ParseStoreBound(tt.in)
		if (err != nil) != tt.wantErr || !tt.wantErr && got != tt.want {
			t.Errorf("ParseStoreBound(%q) = %+v, %v; want %+v (error %v)", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

// TestExampleConfig keeps the documented example loadable.
func TestExampleConfig(t *testing.T) {
	t.Parallel()
	cfg, err := load("../../../../deploy/pullproxy.example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Upstreams) != 5 || cfg.DefaultUpstream != "docker.io" {
		t.Errorf("got %d upstreams and default %q, want 5 and docker.io", len(cfg.Upstreams), cfg.DefaultUpstream)
	}
	want := upstream.FetchConfig{ConnectionBudget: 1 << 20, MaxConnectionBudget: 64 << 20, MinConnectionBudget: 64 << 10,
		MaxConnections: 64, StallTimeout: 2 * time.Second, FirstByteTimeout: 10 * time.Second, MaxAttempts: 8, MinGoodput: 4 << 10,
		BackgroundShare: 0.5}
	if got := cfg.Fetch.Options(); got != want {
		t.Errorf("fetch settings: got %+v, want %+v", got, want)
	}
	if !*cfg.BlobLoop {
		t.Error("blob_loop: got false, want true")
	}
	if got := cfg.Upstreams[2].CAFile; got != "/etc/pullproxy/corp-ca.pem" {
		t.Errorf("ca_file of the third upstream: got %q", got)
	}
	if rules := cfg.SyncRules(); len(rules) != 2 || rules[0].Repository != "team/*" || rules[0].Interval != 10*time.Minute || !rules[0].Referrers {
		t.Errorf("sync rules: got %+v", rules)
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
		auth Auth
		want string // error substring; "" for success
	}{
		{"anonymous", Auth{}, ""},
		{"basic", Auth{Type: "basic", Username: "u", Password: "p"}, ""},
		{"basic from a file", Auth{Type: "basic", Username: "u", PasswordFile: pwFile}, ""},
		{"basic without password", Auth{Type: "basic", Username: "u"}, "needs username and password"},
		{"basic, file missing", Auth{Type: "basic", Username: "u", PasswordFile: filepath.Join(dir, "nope")}, "reading password_file"},
		{"dockerconfig", Auth{Type: "dockerconfig", Config: dockerCfg}, ""},
		{"dockerconfig missing", Auth{Type: "dockerconfig", Config: filepath.Join(dir, "nope")}, "reading docker config"},
		{"ecr", Auth{Type: "ecr", APIEndpoint: "http://127.0.0.1:1"}, ""},
		{"unknown type", Auth{Type: "kerberos"}, `auth type "kerberos"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.auth.Credentials("reg.test", slog.New(slog.DiscardHandler), nil)
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
	_, err := load(file)
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
	if cfg, err := (Upstream{Name: "u"}).TLSConfig(log); cfg != nil || err != nil {
		t.Errorf("no setting: got %v, %v, want nil, nil (the defaults)", cfg, err)
	}
	cfg, err := (Upstream{Name: "u", CAFile: good}).TLSConfig(log)
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
		if _, err := (Upstream{Name: "u", CAFile: bad}).TLSConfig(log); err == nil || !strings.Contains(err.Error(), "ca_file") {
			t.Errorf("ca_file %s: got %v, want an error naming ca_file", bad, err)
		}
	}
	if logged.Len() != 0 {
		t.Errorf("logged %q, want nothing", logged.String())
	}
	cfg, err = (Upstream{Name: "u", InsecureSkipVerify: true}).TLSConfig(log)
	if err != nil || !cfg.InsecureSkipVerify {
		t.Fatalf("insecure_skip_verify: got %+v, %v", cfg, err)
	}
	if !strings.Contains(logged.String(), "level=WARN") || !strings.Contains(logged.String(), "insecure_skip_verify") {
		t.Errorf("insecure_skip_verify: logged %q, want a warning naming it", logged.String())
	}
}
