//go:build linux && (amd64 || arm64)

package storage

import (
	"syscall"
	"unsafe"
)

// fstatCached is fstat made as a raw system call, for a descriptor the fd
// cache holds open: its inode is in memory, so the call never sleeps.
// An ordinary system call would tell the Go runtime's monitor that the
// process is busy again and wake it, on every blob served after a pause
// (see internal/rawsock).
func fstatCached(fd int, st *syscall.Stat_t) error {
	if _, _, e := syscall.RawSyscall(syscall.SYS_FSTAT, uintptr(fd), uintptr(unsafe.Pointer(st)), 0); e != 0 {
		return e
	}
	return nil
}
