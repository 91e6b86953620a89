package rawsock

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// pair returns both ends of a loopback TCP connection, closed when the test
// ends, and a Reader of the server's end.
func pair(t *testing.T) (client *net.TCPConn, server *net.TCPConn, r *Reader) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if r, err = NewReader(s.(*net.TCPConn)); err != nil {
		t.Fatal(err)
	}
	return c.(*net.TCPConn), s.(*net.TCPConn), r
}

// TestRead: a Reader returns what the connection's Read would: the bytes
// there, a deadline's error, a reset as ECONNRESET, and io.EOF once the
// peer has closed, with errors that read as net.Conn's.
func TestRead(t *testing.T) {
	buf := make([]byte, 16)

	client, server, r := pair(t)
	server.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	n, err := r.Read(buf)
	var ne net.Error
	if n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("nothing sent: got %d bytes, %v; want a timeout", n, err)
	}
	server.SetReadDeadline(time.Time{})
	client.Write([]byte("GET /"))
	if n, err := r.Read(buf); err != nil || string(buf[:n]) != "GET /" {
		t.Errorf("got %q, %v; want \"GET /\"", buf[:n], err)
	}
	if n, err := r.Read(buf[:0]); n != 0 || err != nil {
		t.Errorf("empty buffer: got %d, %v", n, err)
	}
	client.Close()
	if n, err := r.Read(buf); n != 0 || err != io.EOF {
		t.Errorf("after the peer closed: got %d bytes, %v; want io.EOF", n, err)
	}

	client, _, r = pair(t)
	client.SetLinger(0) // its close resets the connection
	client.Close()
	n, err = r.Read(buf)
	var oe *net.OpError
	if n != 0 || !errors.Is(err, syscall.ECONNRESET) || !errors.As(err, &oe) || oe.Op != "read" {
		t.Errorf("after a reset: got %d bytes, %v; want a read *net.OpError with ECONNRESET", n, err)
	}

	_, server, r = pair(t)
	server.Close()
	if n, err := r.Read(buf); n != 0 || !errors.Is(err, net.ErrClosed) {
		t.Errorf("on a closed connection: got %d bytes, %v; want net.ErrClosed", n, err)
	}
}

// TestReadAllocatesNothing: a read of available bytes allocates nothing,
// on a path taken for every few kilobytes a blob brings.
func TestReadAllocatesNothing(t *testing.T) {
	c, _, r := pair(t)
	const reads = 100
	if _, err := c.Write(make([]byte, reads*16)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	// AllocsPerRun reads once more than it counts: reads in all.
	allocs := testing.AllocsPerRun(reads-1, func() {
		if _, err := io.ReadFull(r, buf); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("%.1f allocations per read, want 0", allocs)
	}
}
