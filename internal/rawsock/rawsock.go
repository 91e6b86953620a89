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

// Reader reads a TCP connection with raw read calls.
type Reader struct {
	conn *net.TCPConn
	raw  syscall.RawConn
}

// NewReader returns a Reader of c.
func NewReader(c *net.TCPConn) (*Reader, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	return &Reader{conn: c, raw: raw}, nil
}

// Read reads as the connection's Read does, the connection's read deadline
// included, and fails as it does: with io.EOF once the peer has closed,
// else a *net.OpError naming the connection.
func (r *Reader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	var errno syscall.Errno
	err := r.raw.Read(func(s uintptr) bool {
		for {
			var e syscall.Errno
			n, e = read(s, p)
			switch e {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false
			}
			errno = e
			return true
		}
	})
	var oe *net.OpError
	switch {
	case errors.As(err, &oe):
		err = oe.Err // the poller's: a deadline passed, the connection closed
	case err == nil && errno != 0:
		err = os.NewSyscallError("read", errno)
	case err == nil && n == 0:
		return 0, io.EOF
	case err == nil:
		return n, nil
	}
	return 0, &net.OpError{Op: "read", Net: "tcp", Source: r.conn.LocalAddr(), Addr: r.conn.RemoteAddr(), Err: err}
}
