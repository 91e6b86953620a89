package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// The servers measured, in the table's order.
const (
	serverProxy        = "pullproxy"
	serverProxyWarn    = "pullproxy --log-level warn"
	serverNginx        = "nginx"
	serverDistribution = "distribution"
)

var servers = []string{serverProxy, serverProxyWarn, serverNginx, serverDistribution}

// startTimeout bounds how long a server may take to start answering.
const startTimeout = 30 * time.Second

// proxyProcess is a pullproxy serving on loopback, logging to a file in its
// data dir's parent.
type proxyProcess struct {
	cmd     *exec.Cmd
	url     string
	dataDir string
}

// startProxy starts pullproxy on dataDir mirroring upstreamURL, at the given
// log level ("" for the default). It listens on a port found free, as with
// --log-level warn it does not log the address it serves on.
func startProxy(ctx context.Context, bin, dataDir, upstreamURL, level string) (*proxyProcess, error) {
	addr, err := freePort()
	if err != nil {
		return nil, fmt.Errorf("starting pullproxy: %w", err)
	}
	logFile, err := os.Create(dataDir + ".log")
	if err != nil {
		return nil, fmt.Errorf("starting pullproxy: %w", err)
	}
	defer logFile.Close() // the child has its own descriptor
	args := []string{"serve", "--listen", addr, "--data-dir", dataDir, "--upstream", upstreamName + "=" + upstreamURL}
	if level != "" {
		args = append(args, "--log-level", level)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stderr = logFile
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting pullproxy: %w", err)
	}
	p := &proxyProcess{cmd: cmd, dataDir: dataDir, url: "http://" + addr}
	deadline := time.Now().Add(startTimeout)
	for {
		resp, err := http.Get(p.url + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p, nil
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			p.stop()
			b, _ := os.ReadFile(logFile.Name())
			return nil, fmt.Errorf("pullproxy did not start within %v; its log:\n%s", startTimeout, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (p *proxyProcess) blobURL(d digest.Digest) string {
	return p.url + "/v2/" + repo + "/blobs/" + d.String() + "?ns=" + upstreamName
}

func (p *proxyProcess) stop() {
	p.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		p.cmd.Process.Kill()
		<-done
	}
}

// nginxProcess is nginx in the foreground, serving a directory on loopback.
type nginxProcess struct {
	cmd    *exec.Cmd
	url    string
	exited chan struct{} // closed once cmd.Wait returns
}

// nginxConf is a configuration as a default nginx would run: sendfile,
// keep-alive and an access log in the combined format. nginx runs as the
// user running servebench, so that it can read the work dir.
const nginxConf = `{{user}}worker_processes auto;
pid {{dir}}/nginx.pid;
error_log {{dir}}/error.log warn;
events { worker_connections 1024; }
http {
	include /etc/nginx/mime.types;
	default_type application/octet-stream;
	sendfile on;
	tcp_nopush on;
	keepalive_timeout 65;
	access_log {{dir}}/access.log combined;
	client_body_temp_path {{dir}}/tmp/body;
	proxy_temp_path {{dir}}/tmp/proxy;
	fastcgi_temp_path {{dir}}/tmp/fastcgi;
	uwsgi_temp_path {{dir}}/tmp/uwsgi;
	scgi_temp_path {{dir}}/tmp/scgi;
	server {
		listen {{addr}};
		root {{root}};
	}
}
`

// startNginx serves root on a free loopback port.
func startNginx(ctx context.Context, dir, root string) (*nginxProcess, error) {
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o755); err != nil {
		return nil, fmt.Errorf("starting nginx: %w", err)
	}
	addr, err := freePort()
	if err != nil {
		return nil, fmt.Errorf("starting nginx: %w", err)
	}
	user := ""
	if os.Geteuid() == 0 {
		user = "user root;\n" // the default, nobody, cannot enter the 0700 work dir
	}
	conf := nginxConf
	for k, v := range map[string]string{"{{user}}": user, "{{dir}}": dir, "{{addr}}": addr, "{{root}}": root} {
		conf = string(bytes.ReplaceAll([]byte(conf), []byte(k), []byte(v)))
	}
	confPath := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(confPath, []byte(conf), 0o644); err != nil {
		return nil, fmt.Errorf("starting nginx: %w", err)
	}
	cmd := exec.Command("nginx", "-p", dir, "-e", filepath.Join(dir, "error.log"), "-c", confPath, "-g", "daemon off;")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting nginx: %w", err)
	}
	n := &nginxProcess{cmd: cmd, url: "http://" + addr, exited: make(chan struct{})}
	go func() { cmd.Wait(); close(n.exited) }()
	deadline := time.Now().Add(startTimeout)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return n, nil
		}
		select {
		case <-n.exited:
			errLog, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			return nil, fmt.Errorf("nginx exited: %s%s", out.String(), errLog)
		case <-ctx.Done():
			n.stop()
			return nil, fmt.Errorf("starting nginx: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			n.stop()
			return nil, fmt.Errorf("nginx did not start within %v", startTimeout)
		}
	}
}

// stop asks nginx for a fast shutdown, and kills it if that takes more
// than 30 s.
func (n *nginxProcess) stop() {
	n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-n.exited:
	case <-time.After(30 * time.Second):
		n.cmd.Process.Kill()
		<-n.exited
	}
}

// freePort returns a loopback address no one listens on now.
func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return "127.0.0.1:" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port), nil
}

// checkBlob GETs url and checks that it answers 200 with blob's content.
func checkBlob(ctx context.Context, url string, blob registrytest.Descriptor) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	h := sha256.New()
	n, err := io.Copy(h, resp.Body)
	if err != nil {
		return fmt.Errorf("GET %s: after %d bytes: %w", url, n, err)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != blob.Digest.String() || n != blob.Size {
		return fmt.Errorf("GET %s: got %d bytes hashing to %s, want %d bytes of %s", url, n, got, blob.Size, blob.Digest)
	}
	return nil
}
