package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// startTimeout bounds a mirror's start, up to the line naming its address.
const startTimeout = 30 * time.Second

// mirror is a pull-through mirror process with an empty data dir of its own.
type mirror struct {
	name    string
	cmd     *exec.Cmd
	addr    string // host:port it serves on
	dataDir string
	query   string                               // appended to blob and manifest URLs
	stored  func(registrytest.Descriptor) string // where the store keeps a blob
	exited  chan struct{}                        // closed once the process has exited
	logTail func() []string                      // its last log lines, for errors
}

var (
	pullproxyAddrRE = regexp.MustCompile(`msg="pullproxy serving".* addr=(\S+)`)
	distAddrRE      = regexp.MustCompile(`^distproxy serving addr=(\S+)`)
)

// startPullproxy returns a starter of the pullproxy binary bin, mirroring
// registryHost from the relay.
func (b *bench) startPullproxy(bin string) starter {
	return func(ctx context.Context) (*mirror, error) { return b.startPullproxyBin(ctx, bin) }
}

func (b *bench) startPullproxyBin(ctx context.Context, bin string) (*mirror, error) {
	dataDir, err := os.MkdirTemp(b.dir, "pullproxy")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "serve", "--listen", "127.0.0.1:0", "--data-dir", dataDir,
		"--upstream", registryHost+"="+b.relay.URL())
	m := &mirror{name: "pullproxy", cmd: cmd, dataDir: dataDir, query: "?ns=" + registryHost,
		stored: func(d registrytest.Descriptor) string {
			hex := d.Digest.Encoded()
			return filepath.Join(dataDir, "blobs", d.Digest.Algorithm().String(), hex[:2], hex)
		}}
	return m, m.start(ctx, pullproxyAddrRE)
}

// startDistribution starts distribution's registry in proxy mode, pointed at
// the relay, with filesystem storage and its defaults otherwise.
func (b *bench) startDistribution(ctx context.Context) (*mirror, error) {
	dataDir, err := os.MkdirTemp(b.dir, "distribution")
	if err != nil {
		return nil, err
	}
	secret := make([]byte, 16)
	rand.Read(secret)
	conf := fmt.Sprintf(`version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
  cache:
    blobdescriptor: inmemory
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:0
  secret: %s
proxy:
  remoteurl: %s
`, filepath.Join(dataDir, "store"), hex.EncodeToString(secret), b.relay.URL())
	confPath := filepath.Join(dataDir, "config.yml")
	if err := os.WriteFile(confPath, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	cmd := exec.Command(b.distBin, confPath)
	m := &mirror{name: "distribution", cmd: cmd, dataDir: dataDir,
		stored: func(d registrytest.Descriptor) string {
			hex := d.Digest.Encoded()
			return filepath.Join(dataDir, "store", "docker", "registry", "v2", "blobs",
				d.Digest.Algorithm().String(), hex[:2], hex, "data")
		}}
	return m, m.start(ctx, distAddrRE)
}

// start runs the process and waits for the log line naming its address.
func (m *mirror) start(ctx context.Context, addrRE *regexp.Regexp) error {
	// Its stderr goes through a pipe of ours, not an *os.File: with
	// WaitDelay, Wait then returns even if a process it left behind holds
	// the pipe open.
	pr, pw := io.Pipe()
	m.cmd.Stderr = pw
	m.cmd.WaitDelay = 5 * time.Second
	if err := m.cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", m.name, err)
	}
	m.exited = make(chan struct{})
	go func() {
		m.cmd.Wait()
		pw.Close()
		close(m.exited)
	}()
	addrc := make(chan string, 1)
	tail := make(chan []string, 1)
	tail <- nil
	m.logTail = func() []string { t := <-tail; tail <- t; return t }
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if a := addrRE.FindStringSubmatch(line); a != nil {
				select {
				case addrc <- a[1]:
				default:
				}
			}
			t := <-tail
			tail <- append(t[max(0, len(t)-19):], line)
		}
		io.Copy(io.Discard, pr)
	}()
	select {
	case m.addr = <-addrc:
		return nil
	case <-m.exited:
		return fmt.Errorf("%s exited before serving: %s", m.name, strings.Join(m.logTail(), "\n"))
	case <-time.After(startTimeout):
	case <-ctx.Done():
	}
	m.stop()
	return fmt.Errorf("%s did not start within %v", m.name, startTimeout)
}

// stop interrupts the process, kills it if it lingers, and removes its data.
func (m *mirror) stop() {
	m.cmd.Process.Signal(os.Interrupt)
	select {
	case <-m.exited:
	case <-time.After(30 * time.Second):
		m.cmd.Process.Kill()
		<-m.exited
	}
	os.RemoveAll(m.dataDir)
}

func (m *mirror) blobURL(d registrytest.Descriptor) string {
	return "http://" + m.addr + "/v2/" + repo + "/blobs/" + d.Digest.String() + m.query
}

// manifestURL is where the mirror serves the manifest ref (a tag or a
// digest).
func (m *mirror) manifestURL(ref string) string {
	return "http://" + m.addr + "/v2/" + repo + "/manifests/" + ref + m.query
}

// checkStored hashes every blob the mirror stored and compares it with its
// digest.
func (m *mirror) checkStored(blobs []registrytest.Descriptor) error {
	for _, d := range blobs {
		f, err := os.Open(m.stored(d))
		if err != nil {
			return fmt.Errorf("%s did not store %s: %w", m.name, d.Digest, err)
		}
		h := sha256.New()
		n, err := io.Copy(h, f)
		f.Close()
		if err != nil {
			return fmt.Errorf("reading %s's copy of %s: %w", m.name, d.Digest, err)
		}
		if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != d.Digest.String() || n != d.Size {
			return fmt.Errorf("%s stored %s as %d bytes hashing to %s", m.name, d.Digest, n, got)
		}
	}
	return nil
}
