//go:build unix

package storage

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

// inUse reports whether another process holds the lock Badger takes on
// dir: the one cause of a failed open that is not damage.
func inUse(dir string) bool {
	f, err := os.Open(dir)
	if err != nil {
		return false
	}
	defer f.Close()
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		unix.Flock(int(f.Fd()), unix.LOCK_UN)
	}
	return errors.Is(err, unix.EWOULDBLOCK)
}
