package proxy

import "syscall"

func setCork(fd uintptr)   { syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_CORK, 1) }
func clearCork(fd uintptr) { syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_CORK, 0) }

// writeMore writes b to the connection, telling the kernel that more data
// follows (MSG_MORE) when more is set: a response's header then goes out in
// the segment of the body's first bytes, sent next with sendfile, without
// the two setsockopt calls of a cork.
func writeMore(raw syscall.RawConn, b []byte, more bool) error {
	flags := 0
	if more {
		flags = syscall.MSG_MORE
	}
	var err error
	werr := raw.Write(func(fd uintptr) bool {
		for len(b) > 0 {
			var n int
			n, err = syscall.SendmsgN(int(fd), b, nil, nil, flags|syscall.MSG_NOSIGNAL)
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				err = nil
				return false // wait until writable
			case err != nil:
				return true
			}
			b = b[n:]
		}
		return true
	})
	if werr != nil {
		return werr
	}
	return err
}
