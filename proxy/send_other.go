//go:build !linux

package proxy

import (
	"io"
	"net"
	"os"
	"syscall"
)

// sendBlob sends a response on c: hdr, then the first size bytes of the
// file fd, as io.Copy sends a file (with sendfile where the platform has
// it). It returns how many bytes of the body it sent.
func sendBlob(c *net.TCPConn, _ syscall.RawConn, hdr []byte, fd int, size int64) (int64, error) {
	if _, err := c.Write(hdr); err != nil || size == 0 {
		return 0, err
	}
	dup, err := syscall.Dup(fd) // the caller closes fd; the *os.File closes its own
	if err != nil {
		return 0, err
	}
	f := os.NewFile(uintptr(dup), "")
	defer f.Close()
	n, err := io.Copy(c, io.NewSectionReader(f, 0, size))
	if err == nil && n < size {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}
