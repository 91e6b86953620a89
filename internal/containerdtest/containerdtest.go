// Package containerdtest runs a throwaway containerd daemon for tests and
// benchmarks, so that they can make a real containerd pull an image through a
// registry mirror configured by a hosts.toml file.
//
// The daemon is the one installed on the machine (containerd and ctr on
// PATH, run as root). It gets its own root, state directory, config and gRPC
// socket, and only the plugins needed to store content are enabled (Start)
// or those and the CRI plugin (StartCRI).
// Registry traffic is driven by ctr itself: `ctr content fetch` resolves and
// downloads the image in the ctr process (that is where hosts.toml is read)
// and writes the blobs into the daemon's content store.
//
// StartCRI runs the daemon as a Kubernetes node's containerd instead: the
// CRI plugin is enabled with a registry config_path, and crictl, speaking
// CRI as the kubelet does, asks the daemon itself to pull (and unpack).
//
// Behaviour of containerd/ctr 1.6 worth knowing:
//
//   - A mirror declared with an explicit "http://" URL in hosts.toml is
//     contacted over plain HTTP; neither --plain-http nor skip_verify is
//     needed. --plain-http only changes the scheme of the default/fallback
//     host (the one used when hosts.toml has no `server`).
//   - Requests sent to a mirror carry "?ns=<upstream host>" (for example
//     ?ns=registry.invalid%3A5000), which tells the mirror which registry the
//     repository belongs to.
//   - Unix socket paths are limited to 107 bytes, and containerd also
//     listens on "<socket>.ttrpc"; Start moves the socket to a short
//     temporary directory when dir is too long.
//   - Resolving, a host that refuses the connection or answers an error
//     status is skipped for the next (the mirrors in order, then `server`
//     unless it lacks the resolve capability). When none answers, the
//     first error status is reported with its status line as sent, which
//     is what `crictl pull` prints: "pulling from host 127.0.0.1:PORT
//     failed with status code [manifests v1]: 503 Service Unavailable";
//     when every host said 404, "<ref>: not found".
package containerdtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Namespace is the containerd namespace used by every ctr invocation.
const Namespace = "pullproxytest"

// tailBytes is how much of a log or command output is quoted in errors.
const tailBytes = 2048

// stopGrace is how long Stop waits after SIGTERM before sending SIGKILL.
const stopGrace = 5 * time.Second

// maxSocketPath is the longest socket path used in place; longer paths are
// moved to a short temporary directory. The kernel limit is 107 bytes and
// containerd appends ".ttrpc" for its second socket.
const maxSocketPath = 100

// disabledPlugins are plugins that neither mode needs and that are slow,
// noisy, need privileges or write outside the daemon's root in a sandbox.
// Names of plugins absent from a given containerd build are ignored.
var disabledPlugins = []string{
	"io.containerd.internal.v1.opt", // creates /opt/containerd
	"io.containerd.internal.v1.restart",
	"io.containerd.internal.v1.tracing",
	"io.containerd.tracing.processor.v1.otlp",
	"io.containerd.monitor.v1.cgroups",
	"io.containerd.snapshotter.v1.aufs",
	"io.containerd.snapshotter.v1.blockfile",
	"io.containerd.snapshotter.v1.btrfs",
	"io.containerd.snapshotter.v1.devmapper",
	"io.containerd.snapshotter.v1.overlayfs",
	"io.containerd.snapshotter.v1.zfs",
	"io.containerd.nri.v1.nri",
}

// criPlugins are the CRI plugin and what it refuses to load without: it
// asks for the tasks service, which needs a v1 and a v2 runtime. They keep
// their root and state under the daemon's, and start no shim until a
// container runs. Start disables them; StartCRI keeps them.
var criPlugins = []string{
	"io.containerd.grpc.v1.cri",
	"io.containerd.runtime.v1.linux",
	"io.containerd.runtime.v2.task",
	"io.containerd.service.v1.tasks-service",
	"io.containerd.grpc.v1.tasks",
}

// Available reports whether containerd and ctr are on PATH and the process
// runs as root. If not, reason says why in one line.
func Available() (ok bool, reason string) {
	for _, bin := range []string{"containerd", "ctr"} {
		if _, err := exec.LookPath(bin); err != nil {
			return false, fmt.Sprintf("%s not found on PATH", bin)
		}
	}
	if os.Geteuid() != 0 {
		return false, "containerd needs root (euid is not 0)"
	}
	return true, ""
}

// CRIAvailable reports whether StartCRI and the crictl helpers can run:
// what Available checks, and crictl on PATH. If not, reason says why in
// one line.
func CRIAvailable() (ok bool, reason string) {
	if ok, reason := Available(); !ok {
		return false, reason
	}
	if _, err := exec.LookPath("crictl"); err != nil {
		return false, "crictl not found on PATH"
	}
	return true, ""
}

// Daemon is a containerd process with its own root, state, config and gRPC
// socket under a directory. Create it with Start and release it with Stop.
type Daemon struct {
	dir     string
	socket  string
	sockDir string // short temporary directory holding socket, removed by Stop
	logPath string

	// criHostsDir is the CRI plugin's registry config_path, set by
	// StartCRI; "" when the CRI plugin is disabled.
	criHostsDir string
	// crictlConfig is the crictl.yaml naming the daemon's socket as both
	// endpoints, written by StartCRI.
	crictlConfig string

	cmd     *exec.Cmd
	exited  chan struct{} // closed once cmd.Wait has returned
	waitErr error         // result of cmd.Wait, valid after exited is closed

	stopOnce sync.Once
	stopErr  error
}

// Start launches containerd with a minimal config under dir, which must
// exist, and waits until the daemon answers `ctr version` or ctx ends.
// The config is written to dir/config.toml, the daemon's log to
// dir/containerd.log, and its root and state to dir/root and dir/state.
//
// The daemon outlives ctx; call Stop to terminate it. It is also killed if
// the calling process dies (Linux).
func Start(ctx context.Context, dir string) (*Daemon, error) {
	d, err := newDaemon(dir)
	if err != nil {
		return nil, err
	}
	if err := d.start(ctx); err != nil {
		_ = d.Stop()
		return nil, err
	}
	return d, nil
}

// StartCRI is Start with containerd's CRI plugin enabled, as on a
// Kubernetes node: the kubelet's image pulls arrive over CRI, and the CRI
// plugin resolves registries through the hosts.toml files under hostsDir
// (its registry config_path; read at each pull, so it may be filled after
// the start, e.g. by WriteHostsDir when hostsDir is dir/hosts). Images are
// unpacked with the native snapshotter, in the CRI's namespace "k8s.io",
// not Namespace. It waits until the CRI image service answers, and writes
// dir/crictl.yaml for the crictl helpers. Nothing is written outside dir:
// the CNI directories are dir/cni/bin and dir/cni/net.d (left empty, so the
// plugin logs that pod networking is not ready; pulls do not need it).
func StartCRI(ctx context.Context, dir, hostsDir string) (*Daemon, error) {
	if hostsDir == "" {
		return nil, errors.New("containerdtest: StartCRI needs a hosts directory")
	}
	hostsDir, err := filepath.Abs(hostsDir)
	if err != nil {
		return nil, fmt.Errorf("containerdtest: resolving hosts dir: %w", err)
	}
	d, err := newDaemon(dir)
	if err != nil {
		return nil, err
	}
	d.criHostsDir = hostsDir
	d.crictlConfig = filepath.Join(d.dir, "crictl.yaml")
	endpoint := "unix://" + d.socket
	crictlYAML := fmt.Sprintf("runtime-endpoint: %q\nimage-endpoint: %q\ntimeout: 10\n", endpoint, endpoint)
	if err := os.WriteFile(d.crictlConfig, []byte(crictlYAML), 0o644); err != nil {
		_ = d.Stop()
		return nil, fmt.Errorf("containerdtest: writing crictl config: %w", err)
	}
	if err := d.start(ctx); err != nil {
		_ = d.Stop()
		return nil, err
	}
	return d, nil
}

// newDaemon checks dir and chooses the daemon's paths; it starts nothing.
func newDaemon(dir string) (*Daemon, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("containerdtest: resolving daemon dir: %w", err)
	}
	if fi, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("containerdtest: daemon dir: %w", err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("containerdtest: daemon dir %s is not a directory", dir)
	}

	d := &Daemon{
		dir:     dir,
		socket:  filepath.Join(dir, "containerd.sock"),
		logPath: filepath.Join(dir, "containerd.log"),
		exited:  make(chan struct{}),
	}
	if len(d.socket)+len(".ttrpc") > maxSocketPath {
		d.sockDir, err = os.MkdirTemp("", "ctrd")
		if err != nil {
			return nil, fmt.Errorf("containerdtest: creating socket dir: %w", err)
		}
		d.socket = filepath.Join(d.sockDir, "c.sock")
		if len(d.socket)+len(".ttrpc") > maxSocketPath {
			_ = os.RemoveAll(d.sockDir)
			return nil, fmt.Errorf("containerdtest: socket path %s too long even in TMPDIR", d.socket)
		}
	}
	return d, nil
}

func (d *Daemon) start(ctx context.Context) error {
	configPath := filepath.Join(d.dir, "config.toml")
	if err := os.WriteFile(configPath, []byte(d.config()), 0o644); err != nil {
		return fmt.Errorf("containerdtest: writing config: %w", err)
	}
	logFile, err := os.OpenFile(d.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("containerdtest: creating log file: %w", err)
	}
	defer logFile.Close() // the child has its own copy of the descriptor

	cmd := exec.Command("containerd", "--config", configPath)
	cmd.Dir = d.dir
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		close(d.exited)
		return fmt.Errorf("containerdtest: starting containerd: %w", err)
	}
	d.cmd = cmd
	go func() {
		d.waitErr = cmd.Wait()
		close(d.exited)
	}()

	if err := d.waitReady(ctx); err != nil {
		return fmt.Errorf("containerdtest: waiting for containerd on %s: %w%s", d.socket, err, d.logTail())
	}
	return nil
}

// config returns containerd's configuration: everything under d.dir (or
// the short socket directory), only the native snapshotter, no debug or
// metrics listeners, and no CRI or runtimes unless StartCRI asked for them.
func (d *Daemon) config() string {
	disabled := disabledPlugins
	if d.criHostsDir == "" {
		disabled = append(slices.Clone(disabledPlugins), criPlugins...)
	}
	quoted := make([]string, len(disabled))
	for i, p := range disabled {
		quoted[i] = fmt.Sprintf("%q", p)
	}
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = [%s]

[grpc]
  address = %q

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""
`, filepath.Join(d.dir, "root"), filepath.Join(d.dir, "state"),
		strings.Join(quoted, ", "), d.socket)
	if d.criHostsDir == "" {
		return config
	}
	// The stream server (exec, attach) listens on a free loopback port.
	return config + fmt.Sprintf(`
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = %q
`, filepath.Join(d.dir, "cni", "bin"), filepath.Join(d.dir, "cni", "net.d"), d.criHostsDir)
}

// waitReady polls until the gRPC socket accepts connections and `ctr
// version` succeeds (and, with CRI, `crictl images`: the CRI plugin refuses
// calls until it has initialised), the daemon exits, or ctx ends.
func (d *Daemon) waitReady(ctx context.Context) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var lastErr error
	for {
		var dialer net.Dialer
		conn, err := dialer.DialContext(ctx, "unix", d.socket)
		if err == nil {
			conn.Close()
			attempt, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err = d.Ctr(attempt, "version")
			if err == nil && d.criHostsDir != "" {
				_, err = d.Crictl(attempt, "images", "--quiet")
			}
			cancel()
			if err == nil {
				return nil
			}
		}
		lastErr = err
		select {
		case <-d.exited:
			return fmt.Errorf("containerd exited early: %v", d.waitErr)
		case <-ctx.Done():
			return fmt.Errorf("%w (last error: %v)", ctx.Err(), lastErr)
		case <-tick.C:
		}
	}
}

// Address returns the path of the daemon's gRPC socket, for ctr --address.
func (d *Daemon) Address() string { return d.socket }

// LogPath returns the path of the file receiving containerd's log.
func (d *Daemon) LogPath() string { return d.logPath }

// Stop terminates the daemon with SIGTERM, then SIGKILL if it has not exited
// after a few seconds, waits for it and removes the temporary socket
// directory, if any. It is safe to call more than once. An exit caused by
// the signals is not an error.
func (d *Daemon) Stop() error {
	d.stopOnce.Do(func() {
		d.stopErr = d.stop()
		if d.sockDir != "" {
			if err := os.RemoveAll(d.sockDir); err != nil && d.stopErr == nil {
				d.stopErr = fmt.Errorf("containerdtest: removing socket dir: %w", err)
			}
		}
	})
	return d.stopErr
}

func (d *Daemon) stop() error {
	if d.cmd == nil {
		return nil
	}
	select {
	case <-d.exited:
		// Exited by itself: report why, since nobody asked it to.
		if d.waitErr != nil {
			return fmt.Errorf("containerdtest: containerd exited before Stop: %w%s", d.waitErr, d.logTail())
		}
		return nil
	default:
	}
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("containerdtest: sending SIGTERM to containerd: %w", err)
	}
	timer := time.NewTimer(stopGrace)
	defer timer.Stop()
	select {
	case <-d.exited:
		return nil
	case <-timer.C:
	}
	if err := d.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("containerdtest: killing containerd: %w", err)
	}
	<-d.exited
	return fmt.Errorf("containerdtest: containerd ignored SIGTERM for %v and was killed%s", stopGrace, d.logTail())
}

// WriteHostsDir writes <dir>/hosts/<host>/hosts.toml declaring mirrorURL
// (for example "http://127.0.0.1:5000") as a mirror with the pull and
// resolve capabilities for the registry host (which may include a port),
// with "https://"+host as the fallback server. It returns the hosts
// directory to pass to ContentFetch.
func (d *Daemon) WriteHostsDir(host, mirrorURL string) (string, error) {
	return d.WriteHostsDirWithServer(host, mirrorURL, "https://"+host)
}

// WriteHostsDirWithServer is WriteHostsDir with serverURL as the fallback
// server: containerd asks it for what the mirror does not answer.
func (d *Daemon) WriteHostsDirWithServer(host, mirrorURL, serverURL string) (string, error) {
	if host == "" || strings.ContainsAny(host, "/\\") {
		return "", fmt.Errorf("containerdtest: invalid registry host %q", host)
	}
	hostsDir := filepath.Join(d.dir, "hosts")
	hostDir := filepath.Join(hostsDir, host)
	if err := os.MkdirAll(hostDir, 0o755); err != nil {
		return "", fmt.Errorf("containerdtest: creating hosts dir for %s: %w", host, err)
	}
	content := fmt.Sprintf(`server = %q

[host.%q]
  capabilities = ["pull", "resolve"]
`, serverURL, mirrorURL)
	if err := os.WriteFile(filepath.Join(hostDir, "hosts.toml"), []byte(content), 0o644); err != nil {
		return "", fmt.Errorf("containerdtest: writing hosts.toml for %s: %w", host, err)
	}
	return hostsDir, nil
}

// WriteDirectHostsDir writes <dir>/hosts/<host>/hosts.toml sending every
// request for registry host straight to serverURL (e.g. "http://127.0.0.1:5001"),
// with no mirror: the baseline a mirror is measured against. caFile, when
// not "", is the PEM CA bundle an https server is verified with.
func (d *Daemon) WriteDirectHostsDir(host, serverURL, caFile string) (string, error) {
	if host == "" || strings.ContainsAny(host, "/\\") {
		return "", fmt.Errorf("containerdtest: invalid registry host %q", host)
	}
	hostsDir := filepath.Join(d.dir, "hosts-direct")
	hostDir := filepath.Join(hostsDir, host)
	if err := os.MkdirAll(hostDir, 0o755); err != nil {
		return "", fmt.Errorf("containerdtest: creating hosts dir for %s: %w", host, err)
	}
	content := fmt.Sprintf("server = %q\n\n[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n", serverURL, serverURL)
	if caFile != "" {
		content += fmt.Sprintf("  ca = %q\n", caFile)
	}
	if err := os.WriteFile(filepath.Join(hostDir, "hosts.toml"), []byte(content), 0o644); err != nil {
		return "", fmt.Errorf("containerdtest: writing hosts.toml for %s: %w", host, err)
	}
	return hostsDir, nil
}

// ContentFetch runs `ctr content fetch --hosts-dir hostsDir ref` against the
// daemon and returns ctr's combined output. Plain-http mirrors need no extra
// flag as long as hosts.toml spells their URL with "http://".
func (d *Daemon) ContentFetch(ctx context.Context, hostsDir, ref string) ([]byte, error) {
	return d.Ctr(ctx, "content", "fetch", "--hosts-dir", hostsDir, ref)
}

// ContentDigests lists the digests in the daemon's content store (in
// Namespace), as printed by `ctr content ls -q`.
func (d *Daemon) ContentDigests(ctx context.Context) ([]string, error) {
	out, err := d.Ctr(ctx, "content", "ls", "--quiet")
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(out)), nil
}

// Ctr runs ctr with the given arguments against the daemon, in Namespace,
// and returns its combined output. Tests and benchmarks can use it for
// anything the helpers do not cover, such as removing images and content
// between iterations. On failure the error quotes the tail of the output.
func (d *Daemon) Ctr(ctx context.Context, args ...string) ([]byte, error) {
	full := append([]string{"--address", d.socket, "--namespace", Namespace}, args...)
	cmd := exec.CommandContext(ctx, "ctr", full...)
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return out, fmt.Errorf("containerdtest: ctr %s: %w%s", strings.Join(args, " "), err, quoteTail("output", out))
	}
	return out, nil
}

// CrictlPull runs `crictl pull ref` against a daemon from StartCRI, the
// kubelet's way of pulling, and returns crictl's combined output: on
// failure it holds the error a node would see. When ctx has a deadline,
// crictl is given it as --pull-timeout, so that containerd cancels the pull
// itself rather than only losing its client.
func (d *Daemon) CrictlPull(ctx context.Context, ref string) (output []byte, err error) {
	args := []string{"pull"}
	if deadline, ok := ctx.Deadline(); ok {
		if left := time.Until(deadline).Truncate(time.Second); left > 0 { // 0s would mean no limit
			args = append(args, "--pull-timeout", left.String())
		}
	}
	return d.Crictl(ctx, append(args, ref)...)
}

// CRIImage is what the CRI image service reports about an image.
type CRIImage struct {
	ID          string   `json:"id"` // the config's digest
	RepoTags    []string `json:"repoTags"`
	RepoDigests []string `json:"repoDigests"` // "name@digest" of the manifest (or index) pulled
}

// CrictlImage returns the CRI's view of image ref, from `crictl inspecti`,
// on a daemon from StartCRI.
func (d *Daemon) CrictlImage(ctx context.Context, ref string) (CRIImage, error) {
	out, err := d.Crictl(ctx, "inspecti", "--output", "json", ref)
	if err != nil {
		return CRIImage{}, err
	}
	var inspected struct {
		Status CRIImage `json:"status"`
	}
	if err := json.Unmarshal(out, &inspected); err != nil {
		return CRIImage{}, fmt.Errorf("containerdtest: decoding crictl inspecti %s: %w%s", ref, err, quoteTail("output", out))
	}
	return inspected.Status, nil
}

// Crictl runs crictl with the given arguments against a daemon from
// StartCRI, through its own crictl.yaml, and returns crictl's combined
// output. On failure the error quotes the tail of the output.
func (d *Daemon) Crictl(ctx context.Context, args ...string) ([]byte, error) {
	if d.crictlConfig == "" {
		return nil, errors.New("containerdtest: crictl needs a daemon from StartCRI")
	}
	cmd := exec.CommandContext(ctx, "crictl", append([]string{"--config", d.crictlConfig}, args...)...)
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return out, fmt.Errorf("containerdtest: crictl %s: %w%s", strings.Join(args, " "), err, quoteTail("output", out))
	}
	return out, nil
}

// logTail returns the end of containerd's log formatted for an error.
func (d *Daemon) logTail() string {
	f, err := os.Open(d.logPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(fi.Size()-tailBytes, 0)
	buf := make([]byte, fi.Size()-off)
	n, _ := f.ReadAt(buf, off)
	return quoteTail("containerd log "+d.logPath, buf[:n])
}

// quoteTail formats the last tailBytes of b, labelled, for an error message.
func quoteTail(label string, b []byte) string {
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return ""
	}
	prefix := ""
	if len(b) > tailBytes {
		b = b[len(b)-tailBytes:]
		prefix = "..."
	}
	return fmt.Sprintf("\n--- %s (tail) ---\n%s%s", label, prefix, b)
}
