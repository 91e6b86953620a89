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
// setsockopt calls. Each wait for the client has a write deadline of
// timeout (0: none) from the last time the client took bytes, and none
// later than until (zero: no limit): a client that takes nothing for
// timeout is dropped, however long a slow one takes in all. It returns how
// many bytes of the body it sent.
func sendBlob(tc *net.TCPConn, raw syscall.RawConn, hdr []byte, fd int, size int64, timeout time.Duration, until time.Time) (int64, error) {
	flags := syscall.MSG_NOSIGNAL
	if size > 0 {
		flags |= syscall.MSG_MORE
	}
	var off int64
	var err error
	// With a timeout, a wait that follows progress returns to arm the
	// deadline afresh first: one more sendfile, finding the buffer still
	// full, per time the client lets it fill, and none for a response the
	// socket's buffer takes whole.
	rearm, progressed := timeout > 0, false
	wait := func() bool {
		err = nil
		return rearm && progressed // true: out to re-arm; false: wait here
	}
	send := func(s uintptr) bool {
		for len(hdr) > 0 {
			var n int
			n, err = syscall.SendmsgN(int(s), hdr, nil, nil, flags)
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				return wait()
			case err != nil:
				return true
			}
			hdr, progressed = hdr[n:], true
		}
		for off < size {
			var n int
			n, err = syscall.Sendfile(int(s), fd, &off, int(min(size-off, 1<<30)))
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				return wait()
			case err != nil:
				return true
			case n == 0:
				err = io.ErrUnexpectedEOF // the file is shorter than its size
				return true
			}
			progressed = true
		}
		return true
	}
	for {
		if d := pieceDeadline(timeout, until); !d.IsZero() {
			tc.SetWriteDeadline(d)
		}
		progressed = false
		werr := raw.Write(send)
		if err == nil {
			err = werr
		}
		if err != nil || (len(hdr) == 0 && off >= size) {
			return off, err
		}
	}
}
