package carrier

import (
	"net"
	"syscall"
	"unsafe"
)

// unackedBytes returns how many bytes written to c the peer has not yet
// acknowledged (SIOCOUTQ: unsent plus sent-but-unacknowledged).
func unackedBytes(c *net.TCPConn) (int, error) { return queued(c, syscall.TIOCOUTQ) }

// unreadBytes returns how many bytes c received that were not read yet
// (SIOCINQ).
func unreadBytes(c *net.TCPConn) (int, error) { return queued(c, syscall.TIOCINQ) }

// queued asks the kernel for one of c's queue lengths.
func queued(c *net.TCPConn, req uintptr) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int32
	var errno syscall.Errno
	err = rc.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, req, uintptr(unsafe.Pointer(&n)))
	})
	if err != nil {
		return 0, err
	}
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}
