package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// socketClient returns an HTTP client whose every request goes to the unix
// socket at path.
func socketClient(path string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		},
	}}
}

// adminRequest sends a request to the admin endpoint at base through
// client, with the headers given, and returns the status and the body.
func adminRequest(t *testing.T, client *http.Client, method, url string, header map[string]string, body []byte) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	return resp.StatusCode, string(b)
}

// cranePull writes repo:tag of reg as a docker-save tar (crane pull's),
// an archive pullproxy imports.
func cranePull(ctx context.Context, t *testing.T, reg *registrytest.Registry, ref string) string {
	t.Helper()
	requireTools(t, "crane")
	file := filepath.Join(t.TempDir(), "image.tar")
	if out, err := exec.CommandContext(ctx, "crane", "pull", "--insecure", "--format", "tarball", reg.Host()+"/"+ref, file).CombinedOutput(); err != nil {
		t.Fatalf("crane pull: %v\n%s", err, out)
	}
	return file
}

// TestAdminRefusesForgedRequests: the admin endpoint on a TCP port, as a
// web page on the mirror's host reaches it. A cross-site form (Origin,
// text/plain) posting a seed and an import, a DNS-rebound page (Host:
// evil.example) and a request without the token are all refused, and the
// store stays empty; the CLI, with the token from the data dir, is served.
func TestAdminRefusesForgedRequests(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	small, err := reg.Push(ctx, registrytest.Image{Repo: "app/small", Tag: "v1", Seed: 91, LayerSizes: []int64{200 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reg.Push(ctx, registrytest.Image{Repo: "app/other", Tag: "v1", Seed: 92, LayerSizes: []int64{100 << 10}}); err != nil {
		t.Fatal(err)
	}
	archive, err := os.ReadFile(cranePull(ctx, t, reg, "app/other:v1"))
	if err != nil {
		t.Fatal(err)
	}
	const host = "registry.test"
	data := filepath.Join(t.TempDir(), "data")
	p := startProxy(t, "--data-dir", data, "--upstream", host+"="+reg.URL(), "--admin-listen", "127.0.0.1:0")
	if !strings.HasPrefix(p.AdminURL, "http://127.0.0.1:") {
		t.Fatalf("admin endpoint at %q, want a loopback TCP address", p.AdminURL)
	}
	seedBody := []byte(`{"refs":["` + host + `/app/small:v1"]}`)
	evilHost := "evil.example:" + strings.TrimPrefix(p.AdminURL, "http://127.0.0.1:")
	for _, tc := range []struct {
		name         string
		method, path string
		header       map[string]string
		body         []byte
		want         int
	}{
		{"a cross-site form posting a seed", "POST", "/seed",
			map[string]string{"Origin": "http://evil.example", "Content-Type": "text/plain"}, seedBody, http.StatusForbidden},
		{"a cross-site form posting an import", "POST", "/import?name=x.tar",
			map[string]string{"Origin": "http://evil.example", "Content-Type": "text/plain"}, archive, http.StatusForbidden},
		{"a DNS-rebound page's seed", "POST", "/seed",
			map[string]string{"Host": evilHost, "Content-Type": "application/json"}, seedBody, http.StatusMisdirectedRequest},
		{"a DNS-rebound page's import", "POST", "/import?name=x.tar",
			map[string]string{"Host": evilHost, "Content-Type": "application/x-tar"}, archive, http.StatusMisdirectedRequest},
		{"a DNS-rebound page reading an export", "GET", "/export?ref=" + host + "/app/small:v1",
			map[string]string{"Host": evilHost}, nil, http.StatusMisdirectedRequest},
		{"a seed without the token", "POST", "/seed",
			map[string]string{"Content-Type": "application/json"}, seedBody, http.StatusUnauthorized},
		{"an import with a wrong token", "POST", "/import?name=x.tar",
			map[string]string{"Content-Type": "application/x-tar", "Authorization": "Bearer 0000"}, archive, http.StatusUnauthorized},
	} {
		status, body := adminRequest(t, http.DefaultClient, tc.method, p.AdminURL+tc.path, tc.header, tc.body)
		if status != tc.want {
			t.Errorf("%s: %d %s, want %d", tc.name, status, shorten(strings.TrimSpace(body), 200), tc.want)
		}
	}
	if n := blobsOnDisk(t, data); n != 0 {
		t.Errorf("the refused requests left %d bytes of blobs in the store", n)
	}

	// The token file: the service's user's alone; the CLI reads it from
	// the data dir and is served.
	if fi, err := os.Stat(filepath.Join(data, "admin.token")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("admin.token: %v, want a file of mode 0600", err)
	}
	if tok, _ := os.ReadFile(filepath.Join(data, "admin.token")); len(tok) > 0 && strings.Contains(p.logged(), strings.TrimSpace(string(tok))) {
		t.Error("the token is in the log")
	}
	out, err := runPullproxy(ctx, t, "seed", "--server", p.AdminURL, "--data-dir", data, host+"/app/small:v1")
	if err != nil || !strings.Contains(out, "seeded "+host+"/app/small:v1") {
		t.Errorf("seed with the token: %v\n%s", err, out)
	}
	resp, err := http.Get(p.URL + "/v2/app/small/blobs/" + small.Layers[0].Digest.String() + "?ns=" + host)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Pullproxy-Source") != "cache" {
		t.Errorf("the layer the CLI seeded: %s from %q, want 200 from the cache", resp.Status, resp.Header.Get("Pullproxy-Source"))
	}
}

// TestAdminSocketIsTheDefault: with no admin_listen, the admin endpoint is
// a socket in the data dir, mode 0600, and seed and status given the data
// dir go through it. A socket left by a killed server is replaced at the
// next start.
func TestAdminSocketIsTheDefault(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	pushed, err := reg.Push(ctx, registrytest.Image{Repo: "app/small", Tag: "v1", Seed: 93, LayerSizes: []int64{200 << 10}})
	if err != nil {
		t.Fatal(err)
	}
	const host = "registry.test"
	data := filepath.Join(t.TempDir(), "data")
	socket := filepath.Join(data, "admin.sock")
	p := startProxy(t, "--data-dir", data, "--upstream", host+"="+reg.URL())
	fi, err := os.Lstat(socket)
	if err != nil {
		t.Fatalf("no admin socket in the data dir: %v", err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("%s: mode %v, want a socket of mode 0600", socket, fi.Mode())
	}
	if p.AdminURL != "unix:"+socket {
		t.Errorf("the admin endpoint logged as %q, want unix:%s", p.AdminURL, socket)
	}
	out, err := runPullproxy(ctx, t, "seed", "--data-dir", data, host+"/app/small:v1")
	if err != nil || !strings.Contains(out, "seeded "+host+"/app/small:v1 "+pushed.Manifest.Digest.String()) {
		t.Fatalf("seed --data-dir through the running server's socket: %v\n%s", err, out)
	}
	resp, err := http.Get(p.URL + "/v2/app/small/blobs/" + pushed.Layers[0].Digest.String() + "?ns=" + host)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Pullproxy-Source") != "cache" {
		t.Errorf("the seeded layer: %s from %q, want 200 from the cache", resp.Status, resp.Header.Get("Pullproxy-Source"))
	}
	if out, err := runPullproxy(ctx, t, "status", "--data-dir", data); err != nil || !strings.Contains(out, reg.URL()) {
		t.Errorf("status --data-dir: %v\n%s", err, out)
	}
	// On the socket, the file's mode is the access control; a browser's
	// form is still refused.
	status, body := adminRequest(t, socketClient(socket), "POST", "http://x/seed",
		map[string]string{"Origin": "http://evil.example", "Content-Type": "text/plain"}, []byte(`{"refs":["`+host+`/app/small:v1"]}`))
	if status != http.StatusForbidden {
		t.Errorf("a form with an Origin through the socket: %d %s, want 403", status, body)
	}

	// Killed, the server leaves its socket; the next start replaces it.
	p.kill()
	if _, err := os.Lstat(socket); err != nil {
		t.Logf("the killed server left no socket (%v)", err)
	}
	p = startProxy(t, "--data-dir", data, "--upstream", host+"="+reg.URL())
	if p.AdminURL != "unix:"+socket {
		t.Fatalf("after a kill, the admin endpoint is %q, want unix:%s", p.AdminURL, socket)
	}
	if out, err := runPullproxy(ctx, t, "status", "--data-dir", data); err != nil || !strings.Contains(out, reg.URL()) {
		t.Errorf("status after a restart over a stale socket: %v\n%s", err, out)
	}
	p.stop()
	if _, err := os.Lstat(socket); err == nil {
		t.Error("a server stopped cleanly left its socket")
	}
}

// TestServeRefusesATakenAdminPort: whatever holds 127.0.0.1:5001 (the old
// default) is never sent a command, and serve refuses to run without the
// admin endpoint it was told to open: a TCP address taken, or a socket
// another process answers on.
func TestServeRefusesATakenAdminPort(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	if _, err := reg.Push(ctx, registrytest.Image{Repo: "app/small", Tag: "v1", Seed: 94, LayerSizes: []int64{100 << 10}}); err != nil {
		t.Fatal(err)
	}
	const host = "registry.test"

	// Another process on 127.0.0.1:5001, answering 200 to anything.
	var squatted atomic.Int64
	squatter, err := net.Listen("tcp", "127.0.0.1:5001")
	if err != nil {
		t.Skipf("127.0.0.1:5001 is not free to hold here: %v", err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		squatted.Add(1)
		io.WriteString(w, "done\n")
	})}
	go hs.Serve(squatter)
	defer hs.Close()
	data := filepath.Join(t.TempDir(), "data")
	startProxy(t, "--data-dir", data, "--upstream", host+"="+reg.URL())
	out, err := runPullproxy(ctx, t, "seed", "--data-dir", data, host+"/app/small:v1")
	if err != nil || !strings.Contains(out, "seeded "+host+"/app/small:v1") {
		t.Errorf("seed --data-dir with 127.0.0.1:5001 held by another process: %v\n%s", err, out)
	}
	if n := squatted.Load(); n != 0 {
		t.Errorf("the process holding 127.0.0.1:5001 was sent %d requests", n)
	}

	// Told to listen where another process does: serve exits, saying why.
	for _, tc := range []struct{ name, addr, want string }{
		{"a TCP port taken", squatter.Addr().String(), squatter.Addr().String()},
		{"a live socket", "unix:" + liveSocket(t), "another process answers"},
		{"not loopback", "0.0.0.0:0", "loopback"},
	} {
		cmd := exec.CommandContext(ctx, pullproxyBin, "serve", "--listen", "127.0.0.1:0", "--data-dir", filepath.Join(t.TempDir(), "data"),
			"--upstream", host+"="+reg.URL(), "--admin-listen", tc.addr)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err = <-done:
		case <-time.After(20 * time.Second):
			cmd.Process.Signal(os.Interrupt)
			<-done
			t.Errorf("%s: serve ran with --admin-listen %s", tc.name, tc.addr)
			continue
		}
		last := lastLine(stderr.String())
		if err == nil || !strings.HasPrefix(last, "pullproxy: ") || !strings.Contains(last, tc.want) {
			t.Errorf("%s: serve exited with %v, last line %q, want an error naming %q\n%s", tc.name, err, last, tc.want, stderr.String())
		}
	}
	if n := squatted.Load(); n != 0 {
		t.Errorf("the process holding the port was sent %d requests", n)
	}
}

// liveSocket returns the path of a unix socket this test answers on.
func liveSocket(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "admin.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return path
}

// lastLine returns s's last non-empty line.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// TestAdminImportOverTheLimitIs413: an archive larger than max_size sent
// to POST /import is refused with 413 naming the bound, before its bytes
// are taken, through the CLI and as a raw upload; nothing is imported.
func TestAdminImportOverTheLimitIs413(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	data := filepath.Join(t.TempDir(), "data")
	socket := filepath.Join(data, "admin.sock")
	startProxy(t, "--data-dir", data, "--max-size", "1MiB", "--offline", "--upstream", "registry.test=http://127.0.0.1:1",
		"--admin-listen", "unix:"+socket)

	archive := filepath.Join(t.TempDir(), "big.tar")
	if err := os.WriteFile(archive, bytes.Repeat([]byte{'x'}, 3<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := runPullproxy(ctx, t, "import", "--server", "unix:"+socket, archive)
	if err == nil || !strings.Contains(out, "413") || !strings.Contains(out, "max_size") {
		t.Errorf("import of 3 MiB under max_size 1MiB: %v, want 413 naming max_size\n%s", err, out)
	}

	// A raw upload declaring 64 MiB: the answer comes before the body is
	// taken, and the server reads no more than a little of it.
	const declared = 64 << 20
	var sent atomic.Int64
	req, err := http.NewRequestWithContext(ctx, "POST", "http://x/import?name=big.tar",
		&progress.CountingReader{R: io.LimitReader(zeroReader{}, declared), N: &sent})
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = declared
	req.Header.Set("Content-Type", "application/x-tar")
	client := socketClient(socket)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("raw upload: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	client.CloseIdleConnections()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(body), "max_size") {
		t.Errorf("raw upload of %d bytes: %s %s, want 413 naming max_size", declared, resp.Status, body)
	}
	t.Logf("the server answered 413 having taken %d of %d bytes", sent.Load(), declared)
	if n := sent.Load(); n >= declared {
		t.Errorf("the server took all %d bytes of an upload it refused", n)
	}
	if n := blobsOnDisk(t, data); n != 0 {
		t.Errorf("the refused imports left %d bytes of blobs", n)
	}
}

// zeroReader reads zeros.
type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// TestAdminImportFinishesAcrossShutdown: SIGTERM arrives while an archive
// is being uploaded to POST /import. The server lets the admin request
// finish (within its grace) before the store closes: the client gets the
// import's answer, not a cut connection, no upload is left behind, and the
// next start serves the image from the store.
func TestAdminImportFinishesAcrossShutdown(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reg := startRegistry(t)
	if _, err := reg.Push(ctx, registrytest.Image{Repo: "app/small", Tag: "v1", Seed: 95, LayerSizes: []int64{2 << 20}}); err != nil {
		t.Fatal(err)
	}
	archive, err := os.ReadFile(cranePull(ctx, t, reg, "app/small:v1"))
	if err != nil {
		t.Fatal(err)
	}
	regHost := reg.Host()
	data := filepath.Join(t.TempDir(), "data")
	socket := filepath.Join(data, "admin.sock")
	p := startProxy(t, "--data-dir", data, "--offline", "--upstream", regHost+"=http://127.0.0.1:1", "--admin-listen", "unix:"+socket)

	// The upload goes in two halves, the signal between them.
	upload, uploading := io.Pipe()
	req, err := http.NewRequestWithContext(ctx, "POST", "http://pullproxy-admin/import?name=small.tar", upload)
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = int64(len(archive))
	req.Header.Set("Content-Type", "application/x-tar")
	type answer struct {
		status int
		body   string
		err    error
	}
	answered := make(chan answer, 1)
	client := socketClient(socket)
	defer client.CloseIdleConnections()
	go func() {
		resp, err := client.Do(req)
		if err != nil {
			answered <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		answered <- answer{resp.StatusCode, string(b), err}
	}()
	half := len(archive) / 2
	if _, err := uploading.Write(archive[:half]); err != nil {
		t.Fatalf("sending the first half: %v", err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if !p.loggedWithin(`msg="shutting down"`, 20*time.Second) {
		t.Fatal("the server did not begin shutting down on SIGTERM")
	}
	go func() { // ends when the transport closes the pipe, on an answer or an error
		uploading.Write(archive[half:])
		uploading.Close()
	}()
	var a answer
	select {
	case a = <-answered:
	case <-time.After(time.Minute):
		t.Fatal("no answer to the import within a minute of SIGTERM")
	}
	if a.err != nil || a.status != http.StatusOK || !strings.Contains(a.body, "imported "+regHost+"/app/small:v1") {
		t.Fatalf("the import in progress at SIGTERM: %d %v, want 200 and the image imported\n%s", a.status, a.err, a.body)
	}
	exited := make(chan error, 1)
	go func() { exited <- p.cmd.Wait() }()
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("serve after SIGTERM: %v, want exit status 0", err)
		}
	case <-time.After(30 * time.Second):
		p.cmd.Process.Kill()
		<-exited
		t.Fatal("serve did not exit within 30 s of the import's answer")
	}
	if left, _ := filepath.Glob(filepath.Join(data, ".import-upload-*")); len(left) > 0 {
		t.Errorf("the upload is left in the data dir: %v", left)
	}

	p = startProxy(t, "--data-dir", data, "--offline", "--upstream", regHost+"=http://127.0.0.1:1")
	get, err := http.NewRequestWithContext(ctx, "GET", p.URL+"/v2/app/small/manifests/v1?ns="+regHost, nil)
	if err != nil {
		t.Fatal(err)
	}
	get.Header.Set("Accept", "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json")
	resp, err := http.DefaultClient.Do(get)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("the imported image after the restart: %s, want 200 from the store", resp.Status)
	}
}

// shorten returns s cut to n bytes, for a failure message.
func shorten(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
