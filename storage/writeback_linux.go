package storage

import (
	"os"

	"golang.org/x/sys/unix"
)

// startWriteback asks the kernel to start writing f's dirty pages to disk
// now, without waiting for them, so that the next sync finds little left to
// do. Best effort: an error only means the sync will do the work.
func startWriteback(f *os.File) {
	fileControl(f, func(fd int) error { return unix.SyncFileRange(fd, 0, 0, unix.SYNC_FILE_RANGE_WRITE) })
}
