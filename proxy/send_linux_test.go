package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// evictFromPageCache writes name's pages to disk and drops them from the
// page cache.
func evictFromPageCache(t *testing.T, name string) {
	t.Helper()
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
}

// TestWholeCached: a range is whole in the cache once read, not after its
// pages were dropped, and never past the file's end.
func TestWholeCached(t *testing.T) {
	name := t.TempDir() + "/blob"
	if err := os.WriteFile(name, randomBytes(t, 3<<20+100), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd := int(f.Fd())
	var rng unix.CachestatRange
	var st unix.Cachestat_t
	if _, _, e := unix.RawSyscall6(unix.SYS_CACHESTAT, uintptr(fd), uintptr(unsafe.Pointer(&rng)), uintptr(unsafe.Pointer(&st)), 0, 0, 0); errors.Is(e, syscall.ENOSYS) {
		t.Skip("cachestat needs Linux 6.5; without it every sendfile is an ordinary system call")
	}
	evictFromPageCache(t, name)
	if wholeCached(fd, 0, 3<<20+100) {
		t.Error("dropped pages count as cached")
	}
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_RANDOM); err != nil { // no readahead past what is read
		t.Fatal(err)
	}
	// cached reads off into f's pages and reports whether that range is
	// whole in the cache. The kernel may drop a clean page at any time (it
	// did once, with other packages' tests running), so a range just read
	// but found not whole is read again, a few times.
	cached := func(off, n, start, end int64) bool {
		for range 3 {
			if _, err := f.ReadAt(make([]byte, n), off); err != nil {
				t.Fatal(err)
			}
			if wholeCached(fd, start, end) {
				return true
			}
		}
		return false
	}
	for _, tt := range []struct {
		start, end int64
	}{
		{1 << 20, 2 << 20},
		{1<<20 + 5, 2<<20 - 5},
	} {
		if !cached(1<<20, 1<<20, tt.start, tt.end) { // pages 256-511
			t.Errorf("wholeCached(%d, %d) = false after reading pages 256-511", tt.start, tt.end)
		}
	}
	for _, tt := range []struct {
		start, end int64
	}{
		{1<<20 - 1, 2 << 20},
		{1 << 20, 2<<20 + 1},
		{0, 3<<20 + 100},
	} {
		if wholeCached(fd, tt.start, tt.end) {
			t.Errorf("wholeCached(%d, %d) = true with only pages 256-511 read", tt.start, tt.end)
		}
	}
	if !cached(0, 3<<20+100, 0, 3<<20+100) {
		t.Error("a file read whole is not whole in the cache")
	}
	if wholeCached(fd, 0, 3<<20+100+int64(os.Getpagesize())) {
		t.Error("a range past the file's end counts as cached")
	}
}

// TestSendBlobUncorks: a body large enough to be sent corked arrives whole
// while the connection stays open, and the socket is left uncorked for
// the next response.
func TestSendBlobUncorks(t *testing.T) {
	content := make([]byte, maxCorked+12345) // ends in a part-filled segment
	name := t.TempDir() + "/blob"
	if err := os.WriteFile(name, content, 0o600); err != nil {
		t.Fatal(err)
	}
	fd, err := syscall.Open(name, syscall.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	peer, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	tc := c.(*net.TCPConn)
	raw, err := tc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	hdr := []byte("HTTP/1.1 200 OK\r\n\r\n")
	sent := make(chan error, 1)
	go func() {
		_, err := sendBlob(tc, raw, hdr, fd, int64(len(content)), 0, time.Time{})
		sent <- err
	}()
	// A cork left on would hold the last segment back for 200 ms: well
	// within this deadline, so only the socket option tells.
	peer.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(peer, make([]byte, len(hdr)+len(content))); err != nil {
		t.Fatalf("reading the response with the connection open: %v", err)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	var cork int
	var gerr error
	raw.Control(func(s uintptr) { cork, gerr = unix.GetsockoptInt(int(s), unix.IPPROTO_TCP, unix.TCP_CORK) })
	if gerr != nil || cork != 0 {
		t.Errorf("TCP_CORK after the response: %d, %v; want 0", cork, gerr)
	}
}
