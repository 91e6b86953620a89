package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/archive"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// The admin endpoint takes seeds, imports and exports into a running
// server. It listens apart from the registry API, so that nodes, which
// reach the registry listener, cannot fill the store: by default on a unix
// socket in the data dir, mode 0600, so that only the service's user (and
// root) reach it; on a loopback TCP address only when asked, and then
// behind adminGuard and a token.

// maxSocketPath is the longest path a unix socket can be bound at (the
// size of sockaddr_un's sun_path, less its terminating NUL).
const maxSocketPath = 107

// listenAdmin opens the admin listener at addr: "off", "unix:/path", or a
// loopback host:port. It returns nil for off. A TCP address other than
// loopback is refused: the endpoint writes to the store.
func listenAdmin(addr string) (net.Listener, error) {
	if addr == "off" {
		return nil, nil
	}
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		ln, err := listenAdminSocket(path)
		if err != nil {
			return nil, fmt.Errorf("admin_listen %s: %w", addr, err)
		}
		return ln, nil
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("admin_listen %s: want host:port, unix:/path, or off: %w", addr, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return nil, fmt.Errorf("admin_listen %s: not a loopback address: the admin endpoint writes to the store, so it listens "+
			"only on 127.0.0.1, ::1 or localhost (or a unix socket, the default)", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("admin_listen %s: %w: another process holds it; stop it, or set admin_listen to another "+
			"address (or leave it unset for the unix socket in the data dir)", addr, err)
	}
	return ln, nil
}

// listenAdminSocket listens on a unix socket at path, mode 0600 from the
// start: it is bound in a directory only this user can enter, then renamed
// into place, so that no other user connects in between. A socket left by
// a killed process is replaced; one something still answers on is not.
func listenAdminSocket(path string) (net.Listener, error) {
	if len(path) > maxSocketPath {
		return nil, fmt.Errorf("the socket path is %d bytes, more than a unix socket's %d: choose a shorter one", len(path), maxSocketPath)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket", path)
		}
		// Only a refused connection says no process listens: a timeout
		// may be a busy server, a permission error another user's.
		c, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			c.Close()
			return nil, errors.New("another process answers on this socket")
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("%s may belong to a running process (%w); stop it, or remove the socket", path, err)
		}
	}
	dir, err := os.MkdirTemp(filepath.Dir(path), ".as")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bound := filepath.Join(dir, "s")
	if len(bound) > maxSocketPath {
		// No room for the private directory's name: bound in place,
		// open to the umask until the chmod below.
		os.Remove(path)
		bound = path
	}
	ln, err := net.Listen("unix", bound)
	if err != nil {
		return nil, err
	}
	ul := ln.(*net.UnixListener)
	ul.SetUnlinkOnClose(false) // the bound name is gone once renamed
	if err := os.Chmod(bound, 0o600); err != nil {
		ul.Close()
		os.Remove(bound)
		return nil, err
	}
	if err := os.Rename(bound, path); err != nil {
		ul.Close()
		os.Remove(bound)
		return nil, err
	}
	fi, err := os.Lstat(path)
	if err != nil {
		ul.Close()
		return nil, err
	}
	return &socketListener{UnixListener: ul, path: path, file: fi}, nil
}

// socketListener is the admin socket: its address is the path clients
// dial, and closing it removes the path, unless another process has
// replaced the socket since.
type socketListener struct {
	*net.UnixListener
	path string
	file os.FileInfo
}

func (l *socketListener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

func (l *socketListener) Close() error {
	err := l.UnixListener.Close()
	if fi, serr := os.Lstat(l.path); serr == nil && os.SameFile(fi, l.file) {
		os.Remove(l.path)
	}
	return err
}

// adminToken returns the token a TCP admin listener requires, from path.
// A missing file is created, mode 0600, with a random token; one that
// other users could read is refused.
func adminToken(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		raw := make([]byte, 32)
		rand.Read(raw)
		tok := hex.EncodeToString(raw)
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, fmt.Errorf("creating the admin token file %s: %w", path, err)
		}
		_, err = f.WriteString(tok + "\n")
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(path)
			return nil, fmt.Errorf("writing the admin token file %s: %w", path, err)
		}
		return []byte(tok), nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the admin token file: %w", err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("reading the admin token file: %w", err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("admin token file %s is mode %v: other users could read it; chmod 600 it", path, fi.Mode().Perm())
	}
	tok := bytes.TrimSpace(b)
	if len(tok) == 0 {
		return nil, fmt.Errorf("admin token file %s is empty", path)
	}
	return tok, nil
}

// adminServer is the admin endpoint's HTTP server.
type adminServer struct {
	hs     *http.Server
	drain  *drainHandler
	cancel context.CancelFunc // ends the requests' contexts
	once   sync.Once
	log    *slog.Logger
}

// startAdmin serves the admin endpoint of m on ln, guarded for its kind
// of listener: on TCP, with the token in tokenFile.
func startAdmin(m *mirror.Mirror, ln net.Listener, dataDir, tokenFile string, log *slog.Logger) (*adminServer, error) {
	guard := &adminGuard{next: adminHandler(m, dataDir, log)}
	if _, ok := ln.Addr().(*net.TCPAddr); ok {
		tok, err := adminToken(tokenFile)
		if err != nil {
			return nil, err
		}
		guard.hosts, guard.token = adminHosts(ln.Addr()), tok
	}
	return serveAdmin(ln, guard, log), nil
}

// serveAdmin serves h on ln until shutdown.
func serveAdmin(ln net.Listener, h http.Handler, log *slog.Logger) *adminServer {
	base, cancel := context.WithCancel(context.Background())
	a := &adminServer{drain: &drainHandler{next: h}, cancel: cancel, log: log}
	a.hs = &http.Server{Handler: a.drain, ReadHeaderTimeout: 10 * time.Second,
		BaseContext: func(net.Listener) context.Context { return base },
		ErrorLog:    slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	go a.hs.Serve(ln)
	return a
}

// adminDrainWait is the last part of the shutdown grace, kept for admin
// requests to end once cancelled: an import rolls back in that time.
const adminDrainWait = 5 * time.Second

// shutdown lets admin requests in progress finish, then cancels those
// left and waits for their handlers to return, so that none touches the
// store after it closes: all by ctx's deadline, the last adminDrainWait of
// it kept for the cancelled ones, so that the whole shutdown stays within
// the grace that supervisors give. It is safe to call more than once.
func (a *adminServer) shutdown(ctx context.Context) {
	a.once.Do(func() {
		finish := ctx
		if deadline, ok := ctx.Deadline(); ok {
			var cancel context.CancelFunc
			finish, cancel = context.WithDeadline(ctx, deadline.Add(-adminDrainWait))
			defer cancel()
		}
		if err := a.hs.Shutdown(finish); err != nil {
			a.log.Warn("admin requests still running at shutdown are cancelled", "err", err)
		}
		// Cancelled before their connections close, so that a cancelled
		// import can tell its client it kept nothing, rather than the
		// client seeing the connection end.
		a.cancel()
		done := make(chan struct{})
		go func() { a.drain.close(); close(done) }()
		select {
		case <-done:
		case <-ctx.Done():
			a.log.Warn("admin requests did not end after being cancelled; closing the store under them")
		}
		a.hs.Close()
	})
}

// drainHandler tracks the handlers running, so that close can wait for
// them; after close it refuses new requests.
type drainHandler struct {
	mu     sync.RWMutex
	closed bool
	next   http.Handler
}

func (d *drainHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		http.Error(w, "admin endpoint: shutting down", http.StatusServiceUnavailable)
		return
	}
	d.next.ServeHTTP(w, r)
}

// close waits for the handlers running to return.
func (d *drainHandler) close() {
	d.mu.Lock()
	d.closed = true
	d.mu.Unlock()
}

// uploadFits returns an error wrapping storage.ErrNoSpace when an upload
// of size bytes could not be kept in the data dir: above what the store
// may hold (max_size, storage.CheckFits), or above the file system's free
// space less the share kept free.
func uploadFits(store *storage.Store, dataDir string, size int64) error {
	if err := store.CheckFits(digest.Digest("the archive"), size); err != nil {
		return err
	}
	free, total, err := fsutil.Space(dataDir)
	if err != nil {
		return nil // nothing to tell by: the writes will say
	}
	if margin := min(total/20, 256<<20); size > free-margin {
		return fmt.Errorf("the archive is %s; the data dir's file system has %s free, of which %s is kept free: %w",
			progress.Bytes(size), progress.Bytes(free), progress.Bytes(margin), storage.ErrNoSpace)
	}
	return nil
}

// adminHandler serves the admin endpoint over m, whose data dir is dataDir.
func adminHandler(m *mirror.Mirror, dataDir string, log *slog.Logger) http.Handler {
	srv := m.Server
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/upstreams", func(w http.ResponseWriter, r *http.Request) {
		st := []upstream.Status{}
		for _, u := range m.Upstreams {
			st = append(st, u.Status())
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(st)
	})
	mux.Handle("POST /forget", forgetHandler(m.Upstreams, log))
	mux.HandleFunc("GET /debug/bucket", serveBucketHealth(m))
	mux.HandleFunc("GET /export", func(w http.ResponseWriter, r *http.Request) {
		var pins []imageref.Ref
		for _, ref := range r.URL.Query()["ref"] {
			p, err := imageref.Parse(ref)
			if err != nil {
				http.Error(w, "export: "+err.Error(), http.StatusBadRequest)
				return
			}
			pins = append(pins, p)
		}
		if len(pins) == 0 {
			http.Error(w, "export: want ?ref=registry/repository:tag (repeatable)", http.StatusBadRequest)
			return
		}
		log.Info("exporting through the admin endpoint", "refs", r.URL.Query()["ref"])
		// The archive is assembled first, so that a failure is an error
		// status rather than a tar cut short.
		tmp, err := os.CreateTemp(dataDir, ".export-*")
		if err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusInternalServerError)
			return
		}
		defer os.Remove(tmp.Name())
		defer tmp.Close()
		if err := archive.Export(r.Context(), srv, pins, dataDir, tmp, io.Discard, false); err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusBadGateway)
			return
		}
		fi, err := tmp.Stat()
		if err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/x-tar")
		w.Header().Set("Content-Length", fmt.Sprint(fi.Size()))
		http.NewResponseController(w).SetWriteDeadline(time.Time{})
		io.Copy(w, io.NewSectionReader(tmp, 0, fi.Size()))
	})
	mux.HandleFunc("POST /import", func(w http.ResponseWriter, r *http.Request) {
		// The archive is kept beside the store first: reading an image
		// layout needs random access. Its size is known before a byte is
		// written, and bounded: never more than the store and the file
		// system can take.
		if r.ContentLength < 0 {
			http.Error(w, "import: send the archive with a Content-Length", http.StatusLengthRequired)
			return
		}
		if err := uploadFits(m.Store, dataDir, r.ContentLength); err != nil {
			http.Error(w, "import: "+err.Error(), http.StatusRequestEntityTooLarge)
			return
		}
		tmp, err := os.CreateTemp(dataDir, ".import-upload-*")
		if err != nil {
			http.Error(w, "import: "+err.Error(), http.StatusInternalServerError)
			return
		}
		defer os.Remove(tmp.Name())
		_, err = io.Copy(tmp, http.MaxBytesReader(w, r.Body, r.ContentLength))
		if cerr := tmp.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			http.Error(w, "import: receiving the archive: "+err.Error(), http.StatusBadRequest)
			return
		}
		name := r.URL.Query().Get("name")
		if name == "" {
			name = "the archive"
		}
		log.Info("importing through the admin endpoint", "archive", name)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		imp := archive.NewImporter(m, tmp.Name(), r.URL.Query().Get("retag") == "1")
		if err := imp.Run(r.Context()); err != nil {
			fmt.Fprintf(w, "error %s: %v\n", name, err)
			return
		}
		imp.Report(w, name)
		fmt.Fprintln(w, "done")
	})
	mux.HandleFunc("POST /seed", func(w http.ResponseWriter, r *http.Request) {
		var req mirror.SeedRequest
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || len(req.Refs) == 0 {
			http.Error(w, "want JSON: {\"refs\": [...], \"platforms\": [...], \"referrers\": bool}", http.StatusBadRequest)
			return
		}
		log.Info("seeding through the admin endpoint", "refs", req.Refs, "platforms", req.Platforms, "referrers", req.Referrers)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fw := flushWriter{w, http.NewResponseController(w)}
		// The client reads the progress as it comes; a seed takes longer
		// than any write timeout.
		fw.rc.SetWriteDeadline(time.Time{})
		if err := m.Seed(r.Context(), req, fw, false); err != nil {
			fmt.Fprintln(fw, err)
			return
		}
		fmt.Fprintln(fw, "done")
	})
	return mux
}

// flushWriter sends each write to the client at once.
type flushWriter struct {
	w  io.Writer
	rc *http.ResponseController
}

func (f flushWriter) Write(p []byte) (int, error) {
	n, err := f.w.Write(p)
	f.rc.Flush()
	return n, err
}
