//go:build !linux

package proxy

import "syscall"

// Only Linux has TCP_CORK; elsewhere a blob's header goes out on its own.
func setCork(uintptr)   {}
func clearCork(uintptr) {}

// writeMore writes b to the connection. Only Linux has MSG_MORE: elsewhere
// the header goes out on its own.
func writeMore(raw syscall.RawConn, b []byte, _ bool) error {
	var err error
	werr := raw.Write(func(fd uintptr) bool {
		for len(b) > 0 {
			var n int
			n, err = syscall.Write(int(fd), b)
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				err = nil
				return false
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
