package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/pullproxy/pullproxy/internal/containerdtest"
)

// requireTool skips a test that needs a tool this machine lacks, unless
// PULLPROXY_REQUIRE_TOOLS=1 (as in CI), where a skip would hide a gap.
func requireTool(t *testing.T, ok bool, reason string) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("PULLPROXY_REQUIRE_TOOLS") == "1" {
		t.Fatalf("required tool missing: %s", reason)
	}
	t.Skipf("skipping: %s (set PULLPROXY_REQUIRE_TOOLS=1 to make this an error)", reason)
}

// upstreamLog counts requests to the upstream registry by "METHOD kind".
type upstreamLog struct {
	next http.Handler
	mu   sync.Mutex
	n    map[string]int
}

func (u *upstreamLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	kind := "other"
	for _, k := range []string{"/manifests/", "/blobs/"} {
		if strings.Contains(r.URL.Path, k) {
			kind = strings.Trim(k, "/")
		}
	}
	u.mu.Lock()
	u.n[r.Method+" "+kind]++
	u.mu.Unlock()
	cw := &countingWriter{ResponseWriter: w}
	u.next.ServeHTTP(cw, r)
	u.mu.Lock()
	u.n[r.Method+" "+kind+" bytes"] += int(cw.n)
	u.mu.Unlock()
}

// countingWriter counts the body bytes of an answer.
type countingWriter struct {
	http.ResponseWriter
	n int64
}

func (w *countingWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	w.n += int64(n)
	return n, err
}

func (u *upstreamLog) take() map[string]int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := u.n
	u.n = map[string]int{}
	return n
}

// pullproxyBin is the binary under test, built once by TestMain.
var pullproxyBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pullproxy-e2e")
	if err != nil {
		log.Fatal(err)
	}
	pullproxyBin = filepath.Join(dir, "pullproxy")
	if out, err := exec.Command("go", "build", "-o", pullproxyBin, ".").CombinedOutput(); err != nil {
		log.Fatalf("building pullproxy: %v\n%s", err, out)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// proxyProcess is a running `pullproxy serve`.
type proxyProcess struct {
	URL      string
	AdminURL string // the admin endpoint's: unix:/path, or http://host:port
	cmd      *exec.Cmd

	mu  sync.Mutex
	log strings.Builder // everything it logged
}

// logged returns everything the process has logged so far.
func (p *proxyProcess) logged() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// loggedWithin reports whether the process logs s within d: info lines
// reach its stderr in batches (see logBuffer).
func (p *proxyProcess) loggedWithin(s string, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for !strings.Contains(p.logged(), s) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// startProxy runs `pullproxy serve` with args on a free loopback port and
// returns once it serves. The test's cleanup stops it.
func startProxy(t *testing.T, args ...string) *proxyProcess {
	t.Helper()
	return startProxyEnv(t, nil, args...)
}

// startProxyEnv is startProxy with variables added to the environment.
func startProxyEnv(t *testing.T, env []string, args ...string) *proxyProcess {
	t.Helper()
	// The admin endpoint on its default, a socket in the data dir: tests
	// run side by side.
	cmd := exec.Command(pullproxyBin, append([]string{"serve", "--listen", "127.0.0.1:0"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proxyProcess{cmd: cmd}
	t.Cleanup(p.stop)
	addrc, adminc := make(chan string, 1), make(chan string, 1)
	go func() {
		addrRE := regexp.MustCompile(`msg="pullproxy serving".* addr=(\S+)`)
		adminRE := regexp.MustCompile(`msg="admin endpoint listening".* addr=(\S+)`)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.mu.Lock()
			p.log.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
			if m := addrRE.FindStringSubmatch(sc.Text()); m != nil {
				addrc <- m[1]
			}
			if m := adminRE.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case adminc <- m[1]:
				default:
				}
			}
			if testing.Verbose() || strings.Contains(sc.Text(), "level=WARN") || strings.Contains(sc.Text(), "level=ERROR") {
				t.Log("pullproxy: " + sc.Text())
			}
		}
	}()
	select {
	case addr := <-addrc:
		p.URL = "http://" + addr
		select {
		case admin := <-adminc:
			p.AdminURL = admin // unix:/path
			if !strings.HasPrefix(admin, "unix:") {
				p.AdminURL = "http://" + admin
			}
		default:
		}
	case <-time.After(30 * time.Second):
		t.Fatal("pullproxy did not start within 30 s")
	}
	return p
}

// stop ends the process gracefully; kill ends it with SIGKILL, as a crash.
func (p *proxyProcess) stop() {
	if p.cmd.ProcessState == nil {
		p.cmd.Process.Signal(os.Interrupt)
		p.cmd.Wait()
	}
}

func (p *proxyProcess) kill() {
	p.cmd.Process.Kill()
	p.cmd.Wait()
}

// pushIndex pushes a two-platform image with three layers per platform.
func pushIndex(t *testing.T, upstreamURL, repo string) (v1.ImageIndex, v1.Image) {
	t.Helper()
	var idx v1.ImageIndex = empty.Index
	var amd64 v1.Image
	for _, arch := range []string{"amd64", "arm64"} {
		img, err := random.Image(1<<20, 3)
		if err != nil {
			t.Fatal(err)
		}
		if arch == "amd64" {
			amd64 = img
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: arch}}})
	}
	ref, err := name.ParseReference(strings.TrimPrefix(upstreamURL, "http://")+"/"+repo, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(ref, idx); err != nil {
		t.Fatal(err)
	}
	return idx, amd64
}

// TestContainerdPullsThroughMirror is the user's path: containerd, told by
// hosts.toml to use pullproxy as its mirror, pulls a multi-platform image
// (routed by ns); a second, empty containerd pulls it again from pullproxy's
// cache without one upstream blob request.
func TestContainerdPullsThroughMirror(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	up := &upstreamLog{next: registry.New(registry.Logger(log.New(io.Discard, "", 0))), n: map[string]int{}}
	upstreamSrv := httptest.NewServer(up)
	defer upstreamSrv.Close()
	_, img := pushIndex(t, upstreamSrv.URL, "e2e/app:v1")
	up.take()

	dir := t.TempDir()
	const host = "registry.test:5000" // never resolvable: a fallback to it would fail loudly
	proxyURL := startProxy(t, "--data-dir", filepath.Join(dir, "data"), "--upstream", host+"="+upstreamSrv.URL).URL

	want := imageDigests(t, img)
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	blobBytes := int(m.Config.Size)
	for _, l := range m.Layers {
		blobBytes += int(l.Size)
	}
	for i, name := range []string{"cold", "warm"} {
		d, err := containerdtest.Start(ctx, t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Stop() })
		hosts, err := d.WriteHostsDir(host, proxyURL)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := d.ContentFetch(ctx, hosts, host+"/e2e/app:v1"); err != nil {
			t.Fatalf("%s pull: %v\n%s", name, err, out)
		}
		have, err := d.ContentDigests(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range want {
			if !slices.Contains(have, w) {
				t.Errorf("%s pull: containerd lacks %s", name, w)
			}
		}
		got := up.take()
		t.Logf("%s pull: upstream requests %v", name, got)
		if i == 0 && got["GET blobs bytes"] != blobBytes { // every layer and the config, once
			t.Errorf("cold pull: %d upstream blob bytes, want %d (each blob once)", got["GET blobs bytes"], blobBytes)
		}
		if i == 1 && got["GET blobs"] != 0 {
			t.Errorf("warm pull: %d upstream blob GETs, want 0", got["GET blobs"])
		}
		d.Stop()
	}
}

// imageDigests lists an image's manifest, config and layer digests.
func imageDigests(t *testing.T, img v1.Image) []string {
	t.Helper()
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	d, _ := img.Digest()
	out := []string{d.String(), m.Config.Digest.String()}
	for _, l := range m.Layers {
		out = append(out, l.Digest.String())
	}
	return out
}

// TestSkopeoPathPrefixPull is CRI-O's path: a mirror location with the
// upstream's name as the first path component, no ns, no HEAD.
func TestSkopeoPathPrefixPull(t *testing.T) {
	_, err := exec.LookPath("skopeo")
	requireTool(t, err == nil, "skopeo is not installed (apt-get install skopeo)")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	upstreamSrv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer upstreamSrv.Close()
	_, img := pushIndex(t, upstreamSrv.URL, "e2e/app:v1")
	dir := t.TempDir()
	proxyURL := startProxy(t, "--data-dir", filepath.Join(dir, "data"), "--upstream", "quay.test="+upstreamSrv.URL).URL

	dest := filepath.Join(dir, "oci")
	src := "docker://" + strings.TrimPrefix(proxyURL, "http://") + "/quay.test/e2e/app:v1"
	out, err := exec.CommandContext(ctx, "skopeo", "--override-os", "linux", "--override-arch", "amd64",
		"copy", "--src-tls-verify=false", src, "oci:"+dest+":v1").CombinedOutput()
	if err != nil {
		t.Fatalf("skopeo copy %s: %v\n%s", src, err, out)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range m.Layers {
		if _, err := os.Stat(filepath.Join(dest, "blobs", "sha256", l.Digest.Hex)); err != nil {
			t.Errorf("layer %s missing from the copy: %v", l.Digest, err)
		}
	}

	// skopeo inspect lists the repository's tags (tags/list), and failed
	// on a mirror without the tag list.
	out, err = exec.CommandContext(ctx, "skopeo", "--override-os", "linux", "--override-arch", "amd64",
		"inspect", "--tls-verify=false", src).CombinedOutput()
	if err != nil {
		t.Fatalf("skopeo inspect %s: %v\n%s", src, err, out)
	}
	var inspected struct{ RepoTags []string }
	if err := json.Unmarshal(out, &inspected); err != nil || strings.Join(inspected.RepoTags, ",") != "v1" {
		t.Errorf("skopeo inspect: tags %v (%v), want [v1]\n%s", inspected.RepoTags, err, out)
	}
}

// basicAuthRegistry demands one username and password, challenging with Basic.
type basicAuthRegistry struct {
	user, pass string
	next       http.Handler
}

func (b basicAuthRegistry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if u, p, ok := r.BasicAuth(); !ok || u != b.user || p != b.pass {
		w.Header().Set("WWW-Authenticate", `Basic realm="registry"`)
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`)
		return
	}
	b.next.ServeHTTP(w, r)
}

// TestBasicAuthFromConfig: an upstream's basic credentials, configured in
// the file with the password in a file of its own, are used; wrong ones give
// the client an error that says what is missing.
func TestBasicAuthFromConfig(t *testing.T) {
	upstreamSrv := httptest.NewServer(basicAuthRegistry{user: "puller", pass: "s3cret",
		next: registry.New(registry.Logger(log.New(io.Discard, "", 0)))})
	defer upstreamSrv.Close()
	img, err := random.Image(1000, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := name.ParseReference(strings.TrimPrefix(upstreamSrv.URL, "http://")+"/team/app:v1", name.Insecure)
	if err := remote.Write(ref, img, remote.WithAuth(&authn.Basic{Username: "puller", Password: "s3cret"})); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, tc := range []struct {
		password string
		status   int
	}{{"s3cret", http.StatusOK}, {"wrong", http.StatusUnauthorized}} {
		pw := filepath.Join(t.TempDir(), "password")
		os.WriteFile(pw, []byte(tc.password+"\n"), 0o600)
		cfg := writeConfig(t, "upstreams:\n  - name: reg.test\n    endpoints: [{url: "+upstreamSrv.URL+"}]\n"+
			"    auth: {type: basic, username: puller, password_file: "+pw+"}\n")
		p := startProxy(t, "--data-dir", filepath.Join(dir, tc.password), "--config", cfg)
		resp, err := http.Get(p.URL + "/v2/team/app/manifests/v1?ns=reg.test")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("password %q: status %d, want %d: %s", tc.password, resp.StatusCode, tc.status, body)
		}
		if strings.Contains(string(body), tc.password) && tc.status != http.StatusOK {
			t.Errorf("the password appears in the error: %s", body)
		}
		p.stop()
	}
}
