// Package admin is a running server's admin endpoint: the server side
// (listening on the data dir's socket or a loopback port, the guard
// against what a browser could forge, the token, the routes for seed,
// import, export, forget and the live state) and the client the commands
// call it with.
package admin

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// The admin endpoint takes seeds, imports and exports into a running
// server. It listens apart from the registry API, so that nodes, which
// reach the registry listener, cannot fill the store: by default on a unix
// socket in the data dir, mode 0600, so that only the service's user (and
// root) reach it; on a loopback TCP address only when asked, and then
// behind guard and a token.

// maxSocketPath is the longest path a unix socket can be bound at (the
// size of sockaddr_un's sun_path, less its terminating NUL).
const maxSocketPath = 107

// Listen opens the admin listener at addr: "off", "unix:/path", or a
// loopback host:port. It returns nil for off. A TCP address other than
// loopback is refused: the endpoint writes to the store.
func Listen(addr string) (net.Listener, error) {
	if addr == "off" {
		return nil, nil
	}
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		ln, err := listenSocket(path)
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

// listenSocket listens on a unix socket at path, mode 0600 from the
// start: it is bound in a directory only this user can enter, then renamed
// into place, so that no other user connects in between. A socket left by
// a killed process is replaced; one something still answers on is not.
func listenSocket(path string) (net.Listener, error) {
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

// readToken returns the token a TCP admin listener requires, from path.
// A missing file is created, mode 0600, with a random token; one that
// other users could read is refused.
func readToken(path string) ([]byte, error) {
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
