package upstream

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// lowatSupported: the kernel wakes a socket's reader per its SO_RCVLOWAT.
const lowatSupported = true

func setRcvLowat(sock syscall.RawConn, n int) error {
	var err error
	if cerr := sock.Control(func(fd uintptr) {
		err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, n)
	}); cerr != nil {
		return cerr
	}
	return err
}

// rcvQueued returns how many bytes wait in the socket's receive queue,
// unread (SIOCINQ); 0 on error.
func rcvQueued(sock syscall.RawConn) int {
	n := 0
	sock.Control(func(fd uintptr) {
		if v, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil {
			n = v
		}
	})
	return n
}

// rcvBuf returns the socket's receive buffer size, as the kernel counts it
// (SO_RCVBUF); 0 on error.
func rcvBuf(sock syscall.RawConn) int {
	n := 0
	sock.Control(func(fd uintptr) {
		if v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF); err == nil {
			n = v
		}
	})
	return n
}
