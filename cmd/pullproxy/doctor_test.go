package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/doctor"
	"github.com/pullproxy/pullproxy/internal/ecrtest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// faultyRegistry answers some requests itself, as a registry in trouble
// would, and passes the rest to a real one.
type faultyRegistry struct {
	next  http.Handler
	fault func(w http.ResponseWriter, r *http.Request) bool // true: answered
}

func (f faultyRegistry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if f.fault != nil && f.fault(w, r) {
		return
	}
	f.next.ServeHTTP(w, r)
}

func ociError(w http.ResponseWriter, status int, code, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"errors":[{"code":%q,"message":%q}]}`, code, message)
}

// TestDoctor: doctor names the right cause, and where to fix it, for each
// kind of failure operators meet, against registries that fail that way.
func TestDoctor(t *testing.T) {
	// One registry holding an image for linux/amd64 and linux/arm64 under
	// team/app:v1 and v2.
	newReg := func() http.Handler { return registry.New(registry.Logger(log.New(io.Discard, "", 0))) }
	base := newReg()
	baseSrv := httptest.NewServer(base)
	t.Cleanup(baseSrv.Close)
	_, img := pushIndex(t, baseSrv.URL, "team/app:v1")
	pushTags(t, baseSrv.URL, "team/app", "v2")
	m, _ := img.Manifest()
	layer := m.Layers[0].Digest.String()

	serve := func(fault func(http.ResponseWriter, *http.Request) bool) string {
		srv := httptest.NewServer(faultyRegistry{next: base, fault: fault})
		t.Cleanup(srv.Close)
		return srv.URL
	}
	emptySrv := httptest.NewServer(newReg())
	t.Cleanup(emptySrv.Close)
	tlsReg := startRegistry(t, registrytest.WithTLS())
	authSrv := httptest.NewServer(basicAuthRegistry{user: "puller", pass: "s3cret", next: base})
	t.Cleanup(authSrv.Close)
	wrongPassword := writeConfig(t, "not-the-password\n")

	tests := []struct {
		name     string
		upstream string // the upstream's YAML after "name: reg.test\n"
		ref      string
		platform string
		class    string // of the failing step; "" when all works
		code     int
		env      []string
	}{
		{name: "works", upstream: "endpoints: [{url: " + baseSrv.URL + "}]", ref: "reg.test/team/app:v1", platform: "linux/amd64"},
		{name: "wrong tag", upstream: "endpoints: [{url: " + baseSrv.URL + "}]", ref: "reg.test/team/app:v9", class: "manifest unknown", code: doctor.FixHere},
		{name: "no credentials", upstream: "endpoints: [{url: " + serve(func(w http.ResponseWriter, r *http.Request) bool {
			w.Header().Set("WWW-Authenticate", `Basic realm="registry"`)
			ociError(w, http.StatusUnauthorized, "UNAUTHORIZED", "authentication required")
			return true
		}) + "}]", ref: "reg.test/team/app:v1", class: "no credentials", code: doctor.FixHere},
		{name: "denied", upstream: "endpoints: [{url: " + serve(func(w http.ResponseWriter, r *http.Request) bool {
			if strings.Contains(r.URL.Path, "/manifests/") {
				ociError(w, http.StatusForbidden, "DENIED", "requested access to the resource is denied")
				return true
			}
			return false
		}) + "}]", ref: "reg.test/team/app:v1", class: "denied", code: doctor.FixHere},
		{name: "rate limit", upstream: "endpoints: [{url: " + serve(func(w http.ResponseWriter, r *http.Request) bool {
			if strings.Contains(r.URL.Path, "/manifests/") {
				w.Header().Set("Ratelimit-Remaining", "0;w=21600")
				w.Header().Set("Retry-After", "3600")
				ociError(w, http.StatusTooManyRequests, "TOOMANYREQUESTS", "You have reached your pull rate limit")
				return true
			}
			return false
		}) + "}]", ref: "reg.test/team/app:v1", class: "rate limit", code: doctor.FixUpstream},
		{name: "DNS", upstream: "endpoints: [{url: http://registry.invalid:5000}]", ref: "reg.test/team/app:v1", class: "DNS", code: doctor.FixHere},
		{name: "TLS", upstream: "endpoints: [{url: " + tlsReg.URL() + "}]", ref: "reg.test/team/app:v1", class: "TLS", code: doctor.FixHere},
		{name: "missing platform", upstream: "endpoints: [{url: " + baseSrv.URL + "}]", ref: "reg.test/team/app:v1", platform: "linux/s390x",
			class: "missing platform", code: doctor.FixUpstream},
		{name: "tag missing on a replica", upstream: "endpoints: [{url: " + baseSrv.URL + "}, {url: " + emptySrv.URL + "}]",
			ref: "reg.test/team/app:v1", class: "tag missing on a replica", code: doctor.FixUpstream},
		{name: "blob stored twice", upstream: "endpoints: [{url: " + serve(func(w http.ResponseWriter, r *http.Request) bool {
			if r.Method == http.MethodHead && strings.HasSuffix(r.URL.Path, layer) {
				w.Header().Set("Content-Length", fmt.Sprint(2*m.Layers[0].Size))
				w.Header().Set("Docker-Content-Digest", layer)
				return true
			}
			return false
		}) + "}]", ref: "reg.test/team/app:v1", platform: "linux/amd64", class: "size mismatch", code: doctor.FixUpstream},
		{name: "HTTP proxy unreachable", upstream: "endpoints: [{url: https://registry.example}]", ref: "reg.test/team/app:v1",
			class: "proxy", code: doctor.FixHere, env: []string{"HTTPS_PROXY=http://127.0.0.1:1", "NO_PROXY="}},
		{name: "credentials refused", upstream: "endpoints: [{url: " + authSrv.URL + "}]\n    auth: {type: basic, username: puller, password_file: " + wrongPassword + "}",
			ref: "reg.test/team/app:v1", class: "credentials refused", code: doctor.FixHere},
		{name: "upstream not configured", upstream: "endpoints: [{url: " + baseSrv.URL + "}]", ref: "other.test/team/app:v1",
			class: "configuration", code: doctor.FixHere},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			config := writeConfig(t, "data_dir: "+t.TempDir()+"\nupstreams:\n  - name: reg.test\n    "+tc.upstream+"\n")
			platform := tc.platform
			if platform == "" {
				platform = "linux/amd64"
			}
			cmd := exec.CommandContext(ctx, pullproxyBin, "doctor", "--json", "--config", config, "--platform", platform, tc.ref)
			cmd.Env = append(os.Environ(), tc.env...)
			out, err := cmd.Output()
			code := 0
			if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
				code = ee.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			var steps []doctor.Step
			if err := json.Unmarshal(out, &steps); err != nil {
				t.Fatalf("doctor --json: %v\n%s", err, out)
			}
			var classes []string
			for _, s := range steps {
				if s.Verdict == "fail" {
					classes = append(classes, s.Class)
					if s.Fix == "" {
						t.Errorf("step %q failed without a fix", s.Step)
					}
				}
			}
			if code != tc.code || (tc.class == "" && len(classes) > 0) || (tc.class != "" && (len(classes) == 0 || classes[0] != tc.class)) {
				t.Errorf("exit %d, failures %q; want exit %d, %q\n%s", code, classes, tc.code, tc.class, out)
			}
			if tc.name == "wrong tag" && !strings.Contains(string(out), "v1 v2") {
				t.Errorf("wrong tag: the tags that exist are not listed\n%s", out)
			}
			if tc.name == "missing platform" && !strings.Contains(string(out), "linux/amd64, linux/arm64") {
				t.Errorf("missing platform: the platforms that exist are not listed\n%s", out)
			}
			if tc.name == "blob stored twice" && !strings.Contains(string(out), "stored twice") {
				t.Errorf("blob stored twice: not called out\n%s", out)
			}
		})
	}
}

// TestDoctorSeesTheCuts: after pullproxy pulled across a carrier that cuts
// most sessions, doctor --server reports the path as cutting sessions,
// from the server's live state.
func TestDoctorSeesTheCuts(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	pushed, err := reg.Push(ctx, registrytest.Image{Repo: "team/big", Tag: "v1", Seed: 91, LayerSizes: []int64{40 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	path := cuttingCarrier(t, reg.Host())
	config := writeConfig(t, fmt.Sprintf("data_dir: %s\nfetch:\n  connection_budget: 4MiB\n  max_connection_budget: 4MiB\n  parallel_chunks: 1\n  stall_timeout: 1s\n"+
		"upstreams:\n  - name: reg.test\n    endpoints: [{url: %q}]\n", t.TempDir(), path.URL()))
	p := startProxy(t, "--config", config)
	getBody(t, p.URL+"/v2/team/big/blobs/"+pushed.Layers[0].Digest.String()+"?ns=reg.test")
	out, err := exec.CommandContext(ctx, pullproxyBin, "doctor", "--json", "--config", config, "--server", p.AdminURL, "reg.test/team/big:v1").Output()
	var steps []doctor.Step
	if jerr := json.Unmarshal(out, &steps); jerr != nil {
		t.Fatalf("doctor: %v, %v\n%s", err, jerr, out)
	}
	for _, s := range steps {
		if s.Class == "path cuts sessions" && s.Verdict == "warn" {
			t.Logf("%s: %s", s.Step, s.Detail)
			return
		}
	}
	t.Errorf("doctor did not report the cuts (carrier: %+v):\n%s", path.Stats(), out)
}

// TestDoctorECRWrongRegion: an ECR endpoint given the wrong region gets a
// token its registry refuses with ECR's 403: doctor says so, as a fix here.
func TestDoctorECRWrongRegion(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	api := ecrtest.NewAPI(time.Hour)
	apiSrv := httptest.NewServer(api)
	t.Cleanup(apiSrv.Close)
	backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	plain := httptest.NewServer(backend)
	t.Cleanup(plain.Close)
	pushTags(t, plain.URL, "team/app", "v1")
	east1 := httptest.NewServer(ecrtest.NewRegistry("us-east-1", api, backend))
	t.Cleanup(east1.Close)
	const ecrHost = "123456789012.dkr.ecr.us-east-1.amazonaws.com"
	dir := t.TempDir()
	config := writeConfig(t, fmt.Sprintf("data_dir: %s\nupstreams:\n  - name: %s\n    endpoints:\n      - url: %s\n        region: us-east-2\n"+
		"    auth: {type: ecr, api_endpoint: %s}\n", dir, ecrHost, east1.URL, apiSrv.URL))
	cmd := exec.CommandContext(ctx, pullproxyBin, "doctor", "--json", "--config", config, ecrHost+"/team/app:v1")
	cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=AKIDTEST", "AWS_SECRET_ACCESS_KEY=secret-aws-key",
		"AWS_CONFIG_FILE="+filepath.Join(dir, "none"), "AWS_SHARED_CREDENTIALS_FILE="+filepath.Join(dir, "none"),
		"AWS_EC2_METADATA_DISABLED=true")
	out, err := cmd.Output()
	if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) || ee.ExitCode() != doctor.FixHere {
		t.Fatalf("doctor: %v, want exit %d\n%s", err, doctor.FixHere, out)
	}
	var steps []doctor.Step
	if err := json.Unmarshal(out, &steps); err != nil {
		t.Fatal(err)
	}
	for _, s := range steps {
		if s.Verdict == "fail" {
			if s.Class != "ECR token refused" || !strings.Contains(s.Fix, "region") {
				t.Errorf("failing step %+v, want ECR token refused, naming the region", s)
			}
			if strings.Contains(string(out), ecrtest.TokenPrefix) {
				t.Error("a token appears in doctor's output")
			}
			return
		}
	}
	t.Errorf("no step failed:\n%s", out)
}
