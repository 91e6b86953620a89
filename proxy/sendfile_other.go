//go:build !linux

package proxy

import (
	"io"
	"net"
	"os"
	"syscall"
)

// sendFD sends the first size bytes of the file fd on c, as io.Copy sends
// a file (sendfile where the platform has it). It returns how many it sent.
func sendFD(c *net.TCPConn, _ syscall.RawConn, fd int, size int64) (int64, error) {
	dup, err := syscall.Dup(fd) // the caller closes fd; the *os.File closes its own
	if err != nil {
		return 0, err
	}
	f := os.NewFile(uintptr(dup), "")
	defer f.Close()
	return io.Copy(c, io.NewSectionReader(f, 0, size))
}
