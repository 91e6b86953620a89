//go:build !linux

package proxy

import (
	"io"
	"net"
	"os"
	"syscall"
	"time"
)

// sendBlob sends a response on c: hdr, then the first size bytes of the
// file fd, as io.Copy sends a file (with sendfile where the platform has
// it), in pieces with write deadlines as the Linux version does. It returns
// how many bytes of the body it sent.
func sendBlob(c *net.TCPConn, _ syscall.RawConn, hdr []byte, fd int, size int64, timeout time.Duration, until time.Time) (int64, error) {
	if d := pieceDeadline(timeout, until); !d.IsZero() {
		c.SetWriteDeadline(d)
	}
	if _, err := c.Write(hdr); err != nil || size == 0 {
		return 0, err
	}
	dup, err := syscall.Dup(fd) // the caller closes fd; the *os.File closes its own
	if err != nil {
		return 0, err
	}
	f := os.NewFile(uintptr(dup), "")
	defer f.Close()
	var sent int64
	for sent < size {
		if d := pieceDeadline(timeout, until); !d.IsZero() {
			c.SetWriteDeadline(d)
		}
		n, err := io.Copy(c, io.NewSectionReader(f, sent, min(sendPiece, size-sent)))
		sent += n
		if err != nil {
			return sent, err
		}
		if n == 0 {
			return sent, io.ErrUnexpectedEOF
		}
	}
	return sent, nil
}
