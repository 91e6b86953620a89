package storage

import (
	"bytes"
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// progressAttr is the extended attribute of a partial file that holds the
// download's latest progress (see checkpoint.go).
const progressAttr = "user.pullproxy.progress"

// bootID identifies the running kernel's boot: a file's cached pages
// outlive a process, not a reboot. "" when it cannot be read.
func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return string(bytes.TrimSpace(b))
}

// setProgress stores b as f's progress attribute. It goes through the
// file system's journal like any inode change, and is not synced.
func setProgress(f *os.File, b []byte) error {
	return fileControl(f, func(fd int) error { return unix.Fsetxattr(fd, progressAttr, b, 0) })
}

// getProgress returns f's progress attribute, or nil when it has none.
func getProgress(f *os.File) ([]byte, error) {
	var b []byte
	err := fileControl(f, func(fd int) error {
		n, err := unix.Fgetxattr(fd, progressAttr, nil)
		if err != nil {
			return err
		}
		b = make([]byte, n)
		n, err = unix.Fgetxattr(fd, progressAttr, b)
		b = b[:n]
		return err
	})
	if errors.Is(err, unix.ENODATA) {
		return nil, nil
	}
	return b, err
}

// clearProgress removes f's progress attribute, if it has one: a committed
// blob carries nothing of its download.
func clearProgress(f *os.File) error {
	err := fileControl(f, func(fd int) error { return unix.Fremovexattr(fd, progressAttr) })
	if errors.Is(err, unix.ENODATA) || errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	return err
}

// fileControl runs op on f's descriptor and returns its error.
func fileControl(f *os.File, op func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var opErr error
	if err := rc.Control(func(fd uintptr) { opErr = op(int(fd)) }); err != nil {
		return err
	}
	return opErr
}
