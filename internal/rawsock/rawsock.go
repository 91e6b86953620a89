// Package rawsock reads TCP connections without telling the Go runtime's
// scheduler about each read.
//
// A read made as an ordinary system call (net.Conn's Read) enters and
// leaves the scheduler's syscall state. The first such call after every
// processor went idle wakes the runtime's monitor thread from its deep
// sleep, and it then polls every 20 µs for a millisecond; while the
// processors are busy, a call it finds in progress twice has its processor
// handed to another thread. On a server whose reads come in bursts (a
// blob loop between requests, a fetch between packets) that costs a
// context switch or more per burst. A read of a non-blocking socket never
// sleeps in the kernel, so it is made raw here, and the wait for data is
// the network poller's, as for net.Conn.
package rawsock

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
)

// Reader reads a TCP connection with raw read calls. One Read at a time:
// a read's buffer and result live in the Reader, so that a read allocates
// nothing (a closure per read, passed to the poller, escaped to the heap).
type Reader struct {
	conn   *net.TCPConn
	raw    syscall.RawConn
	readFn func(fd uintptr) bool // r.readOnce, bound once

	// The read in progress.
	p     []byte
	n     int
	errno syscall.Errno
}

// NewReader returns a Reader of c.
func NewReader(c *net.TCPConn) (*Reader, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	r := &Reader{conn: c, raw: raw}
	r.readFn = r.readOnce
	return r, nil
}

// readOnce reads into r.p, for the poller: false asks it to wait until
// the socket is readable and call again.
func (r *Reader) readOnce(fd uintptr) bool {
	for {
		n, e := read(fd, r.p)
		switch e {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false
		}
		r.n, r.errno = n, e
		return true
	}
}

// Read reads as the connection's Read does, the connection's read deadline
// included, and fails as it does: with io.EOF once the peer has closed,
// else a *net.OpError naming the connection.
func (r *Reader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	r.p, r.n, r.errno = p, 0, 0
	err := r.raw.Read(r.readFn)
	n, errno := r.n, r.errno
	r.p = nil // the caller's buffer is not kept
	switch {
	case err != nil:
		// The poller's: a deadline passed, the connection closed. Looked
		// into only here: the target of errors.As lives on the heap.
		if oe := (*net.OpError)(nil); errors.As(err, &oe) {
			err = oe.Err
		}
	case errno != 0:
		err = os.NewSyscallError("read", errno)
	case n == 0:
		return 0, io.EOF
	default:
		return n, nil
	}
	return 0, &net.OpError{Op: "read", Net: "tcp", Source: r.conn.LocalAddr(), Addr: r.conn.RemoteAddr(), Err: err}
}
