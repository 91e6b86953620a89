package proxy

import (
	"io"
	"net"
	"syscall"
	"time"
)

// sendBlob sends a response on the connection: hdr, then the first size
// bytes of the file fd with sendfile, from an offset of its own (the
// descriptor's is left alone), waiting while the socket's buffer is full.
// The header goes out with MSG_MORE when a body follows, in the segment of
// the body's first bytes, as a cork would send it without a cork's two
// setsockopt calls. The body goes out in pieces of sendPiece, each with a
// write deadline of timeout from its start (0: none), and none later than
// until (zero: no limit). It returns how many bytes of the body it sent.
func sendBlob(tc *net.TCPConn, raw syscall.RawConn, hdr []byte, fd int, size int64, timeout time.Duration, until time.Time) (int64, error) {
	flags := syscall.MSG_NOSIGNAL
	if size > 0 {
		flags |= syscall.MSG_MORE
	}
	var off, end int64
	var err error
	send := func(s uintptr) bool {
		for len(hdr) > 0 {
			var n int
			n, err = syscall.SendmsgN(int(s), hdr, nil, nil, flags)
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				err = nil
				return false // wait until writable
			case err != nil:
				return true
			}
			hdr = hdr[n:]
		}
		for off < end {
			var n int
			n, err = syscall.Sendfile(int(s), fd, &off, int(end-off))
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				err = nil
				return false
			case err != nil:
				return true
			case n == 0:
				err = io.ErrUnexpectedEOF // the file is shorter than its size
				return true
			}
		}
		return true
	}
	for first := true; first || off < size; first = false {
		end = min(size, off+sendPiece)
		if d := pieceDeadline(timeout, until); !d.IsZero() {
			tc.SetWriteDeadline(d)
		}
		werr := raw.Write(send)
		if err == nil {
			err = werr
		}
		if err != nil {
			break
		}
	}
	return off, err
}
