//go:build !linux

package rawsock

import "syscall"

// read is an ordinary read where raw calls are not checked.
func read(s uintptr, p []byte) (int, syscall.Errno) {
	n, err := syscall.Read(int(s), p)
	if err != nil {
		if e, ok := err.(syscall.Errno); ok {
			return 0, e
		}
		return 0, syscall.EIO
	}
	return n, 0
}
