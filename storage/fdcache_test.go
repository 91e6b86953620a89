package storage

import (
	"errors"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// pipeFD returns a descriptor of a pipe's write end, and a function telling
// whether it is closed: the read end then reads EOF at once.
func pipeFD(t *testing.T) (int, func() bool) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	fd, err := syscall.Dup(int(w.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	return fd, func() bool {
		r.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		_, err := r.Read(make([]byte, 1))
		return !errors.Is(err, os.ErrDeadlineExceeded)
	}
}

func TestFDCache(t *testing.T) {
	t.Parallel()
	d := digest.FromString("a")
	t.Run("shared while cached, closed by the last reader once forgotten", func(t *testing.T) {
		t.Parallel()
		c := newFDCache()
		fd, closed := pipeFD(t)
		first := c.add(d, fd)
		second := c.get(d)
		if second != first {
			t.Fatalf("get: got another descriptor than the one cached")
		}
		c.release(first)
		c.release(second)
		if closed() {
			t.Fatal("closed while cached")
		}
		held := c.get(d)
		c.forget(d)
		if c.get(d) != nil {
			t.Error("get after forget: got a descriptor, want none")
		}
		if closed() {
			t.Fatal("closed while a reader holds it")
		}
		c.release(held)
		if !closed() {
			t.Error("not closed after its last reader, once forgotten")
		}
	})
	t.Run("a second opener's descriptor is not cached", func(t *testing.T) {
		t.Parallel()
		c := newFDCache()
		fd1, closed1 := pipeFD(t)
		fd2, closed2 := pipeFD(t)
		a, b := c.add(d, fd1), c.add(d, fd2)
		c.release(b)
		if !closed2() {
			t.Error("the uncached descriptor outlived its reader")
		}
		c.release(a)
		if closed1() {
			t.Error("the cached descriptor was closed")
		}
		c.close()
		if !closed1() {
			t.Error("close left a descriptor open")
		}
	})
	t.Run("the least recently used goes at the bound", func(t *testing.T) {
		t.Parallel()
		c := newFDCache()
		var closed []func() bool
		for i := range fdCacheSize {
			fd, isClosed := pipeFD(t)
			closed = append(closed, isClosed)
			c.release(c.add(digest.FromString(strconv.Itoa(i)), fd))
		}
		c.release(c.get(digest.FromString("0"))) // used again: the least recent is now 1
		fd, _ := pipeFD(t)
		c.release(c.add(d, fd))
		if !closed[1]() {
			t.Error("the least recently used was not closed")
		}
		if closed[0]() {
			t.Error("a blob used lately was closed")
		}
		if len(c.idleFDs()) != fdCacheSize {
			t.Errorf("cached: got %d, want %d", len(c.idleFDs()), fdCacheSize)
		}
		c.close()
	})
}

// TestOpenBlobFDReusesTheDescriptor: a blob read again is served from the
// descriptor of the first read, and a new commit of it is read from its new
// file.
func TestOpenBlobFDReusesTheDescriptor(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	content := randomBytes(1, 4096)
	d := commitBlob(t, s, content)
	a, err := s.OpenBlobFD(t.Context(), d)
	if err != nil {
		t.Fatal(err)
	}
	a.Release()
	b, err := s.OpenBlobFD(t.Context(), d)
	if err != nil {
		t.Fatal(err)
	}
	if b.FD != a.FD || b.Size != int64(len(content)) {
		t.Errorf("second read: descriptor %d size %d, want %d and %d", b.FD, b.Size, a.FD, len(content))
	}
	b.Release()

	// Quarantined and committed again: a new file, a new descriptor.
	s.quarantine(d, -1, "test")
	commitBlob(t, s, content)
	c, err := s.OpenBlobFD(t.Context(), d)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	var open, there syscall.Stat_t
	if err := syscall.Fstat(c.FD, &open); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(s.blobPath(d), &there); err != nil {
		t.Fatal(err)
	}
	if open.Ino != there.Ino {
		t.Errorf("after a new commit: the descriptor is of inode %d, the blob's file is %d", open.Ino, there.Ino)
	}
}
