package proxy

import (
	"io"
	"net"
	"syscall"
)

// sendFD sends the first size bytes of the file fd on the connection with
// sendfile, from an offset of its own (the descriptor's is left alone),
// waiting while the socket's buffer is full. It returns how many it sent.
func sendFD(_ *net.TCPConn, raw syscall.RawConn, fd int, size int64) (int64, error) {
	var off int64
	var err error
	werr := raw.Write(func(s uintptr) bool {
		for off < size {
			var n int
			n, err = syscall.Sendfile(int(s), fd, &off, int(min(size-off, 1<<30)))
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				err = nil
				return false // wait until writable
			case err != nil:
				return true
			case n == 0:
				err = io.ErrUnexpectedEOF // the file is shorter than its size
				return true
			}
		}
		return true
	})
	if err == nil {
		err = werr
	}
	return off, err
}
