// Package miniotest runs a MinIO server on loopback for tests of the
// shared bucket: a real S3-compatible server, with its conditional
// writes, multipart uploads and server-side copies.
package miniotest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// Credentials of the servers Start runs.
const (
	AccessKey = "pullproxytest"
	SecretKey = "pullproxytest-secret"
)

// Available reports whether the minio binary is on PATH, and if not why.
func Available() (bool, string) {
	if _, err := exec.LookPath("minio"); err != nil {
		return false, "minio is not installed (make deps builds it: go install github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c)"
	}
	return true, ""
}

// ForTest starts a server for t with an empty bucket of the given name,
// stopped when t ends. Without minio installed, t is skipped, or fails
// when PULLPROXY_REQUIRE_TOOLS=1 (as in CI), where a skip would hide a gap.
func ForTest(t testing.TB, bucket string) *Server {
	t.Helper()
	if ok, why := Available(); !ok {
		if os.Getenv("PULLPROXY_REQUIRE_TOOLS") == "1" {
			t.Fatalf("required tool missing: %s", why)
		}
		t.Skipf("skipping: %s (set PULLPROXY_REQUIRE_TOOLS=1 to make this an error)", why)
	}
	s, err := Start(t.Context(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Stop() })
	if err := s.CreateBucket(t.Context(), bucket); err != nil {
		t.Fatal(err)
	}
	return s
}

// Server is a MinIO server on a loopback port.
type Server struct {
	Endpoint string // http://127.0.0.1:port
	cmd      *exec.Cmd
	exited   chan struct{}
	logPath  string
}

// Start runs MinIO over dir, and waits until it answers.
func Start(ctx context.Context, dir string) (*Server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	console, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	logPath := filepath.Join(dir, "minio.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	data := filepath.Join(dir, "data")
	cmd := exec.Command("minio", "server", "--quiet", "--address", addr,
		"--console-address", net.JoinHostPort("127.0.0.1", strconv.Itoa(console)), data)
	cmd.Env = append(os.Environ(), "MINIO_ROOT_USER="+AccessKey, "MINIO_ROOT_PASSWORD="+SecretKey,
		"MINIO_BROWSER=off", "MINIO_UPDATE=off", "HOME="+dir)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting minio: %w", err)
	}
	s := &Server{Endpoint: "http://" + addr, cmd: cmd, exited: make(chan struct{}), logPath: logPath}
	go func() { cmd.Wait(); close(s.exited) }()
	if err := s.waitReady(ctx); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *Server) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.Endpoint+"/minio/health/ready", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-s.exited:
			log, _ := os.ReadFile(s.logPath)
			return fmt.Errorf("minio exited at start: %s", log)
		case <-ctx.Done():
			return fmt.Errorf("minio did not become ready at %s: %w", s.Endpoint, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Credentials returns the server's credentials.
func (s *Server) Credentials() aws.CredentialsProvider {
	return credentials.NewStaticCredentialsProvider(AccessKey, SecretKey, "")
}

// Client returns an S3 client of the server.
func (s *Server) Client() *s3.Client {
	return s3.New(s3.Options{Region: "us-east-1", Credentials: s.Credentials(),
		BaseEndpoint: aws.String(s.Endpoint), UsePathStyle: true})
}

// CreateBucket creates a bucket. A server that answers ready may refuse
// it for a moment (XMinioServerNotInitialized): it is asked again for up
// to 30 s.
func (s *Server) CreateBucket(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		_, err := s.Client().CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String(name)})
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("creating bucket %s: %w", name, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Freeze stops the server's process (SIGSTOP): its port still accepts
// connections, and nothing answers on them, as a hung object store does.
// It returns once every thread of the process is stopped: a thread
// already running when the signal is sent (on a busy machine, for
// milliseconds) could otherwise still answer a request. The test's
// cleanup (Stop) ends a frozen server too.
func (s *Server) Freeze() error {
	if err := s.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return fmt.Errorf("freezing minio: %w", err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		stopped, err := allStopped(s.cmd.Process.Pid)
		if err != nil {
			return fmt.Errorf("freezing minio: %w", err)
		}
		if stopped {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("freezing minio: its threads were not all stopped 10 s after SIGSTOP")
		}
		time.Sleep(time.Millisecond)
	}
}

// allStopped reports whether every thread of process pid is stopped, as
// /proc tells (state T).
func allStopped(pid int) (bool, error) {
	dir := fmt.Sprintf("/proc/%d/task", pid)
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return false, err
	}
	for _, task := range tasks {
		stat, err := os.ReadFile(filepath.Join(dir, task.Name(), "stat"))
		if errors.Is(err, os.ErrNotExist) {
			continue // a thread that exited
		}
		if err != nil {
			return false, err
		}
		// pid (comm) state ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(stat, ')')
		if i < 0 || i+2 >= len(stat) {
			return false, fmt.Errorf("reading %s: no state in %q", task.Name(), stat)
		}
		if state := stat[i+2]; state != 'T' && state != 't' {
			return false, nil
		}
	}
	return true, nil
}

// Thaw resumes a server Freeze stopped (SIGCONT).
func (s *Server) Thaw() error {
	if err := s.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		return fmt.Errorf("thawing minio: %w", err)
	}
	return nil
}

// Stop stops the server.
func (s *Server) Stop() error {
	if s.cmd.Process == nil {
		return nil
	}
	s.cmd.Process.Kill()
	select {
	case <-s.exited:
		return nil
	case <-time.After(10 * time.Second):
		return errors.New("minio did not exit")
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
