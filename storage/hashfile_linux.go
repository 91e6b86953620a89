package storage

import (
	"fmt"
	"hash"
	"os"
	"runtime/debug"

	"golang.org/x/sys/unix"
)

// hashFile hashes n bytes of f at off into h. It hashes them where they lie
// in the page cache, through a read-only mapping, rather than copying them
// out first: bytes written out of order are hashed from the file once the
// hashed prefix reaches them, and for a blob fetched as parallel chunks that
// is most of its bytes. buf is unused here.
func hashFile(h hash.Hash, f *os.File, off, n int64, _ *[]byte) (err error) {
	if n <= 0 {
		return nil
	}
	page := int64(os.Getpagesize())
	start := off &^ (page - 1)
	skip := off - start
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var m []byte
	var merr error
	if err := rc.Control(func(fd uintptr) {
		m, merr = unix.Mmap(int(fd), start, int(skip+n), unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE)
	}); err != nil {
		return err
	}
	if merr != nil {
		return fmt.Errorf("mapping %d bytes at %d: %w", n, off, merr)
	}
	defer unix.Munmap(m)
	// A file cut short under the mapping faults on access: that becomes a
	// panic here, recovered as an error, instead of a crash.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("reading %d bytes at %d: %v", n, off, r)
		}
	}()
	h.Write(m[skip:])
	return nil
}
