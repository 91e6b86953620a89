//go:build !(linux && (amd64 || arm64))

package storage

import "syscall"

// fstatCached is syscall.Fstat where the raw call's layout is not checked.
func fstatCached(fd int, st *syscall.Stat_t) error { return syscall.Fstat(fd, st) }
