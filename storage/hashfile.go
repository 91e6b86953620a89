package storage

import (
	"fmt"
	"hash"
	"os"
)

// hashBuffer is the size of the buffer bytes written out of order are read
// back through to be hashed: small enough to stay in a core's cache
// between the read and the hash.
const hashBuffer = 256 << 10

// hashFile hashes n bytes of f at off into h, read through *buf (allocated
// on first use).
//
// The bytes are copied out of the page cache rather than hashed through a
// read-only mapping of the file, which would spare the copy but is slower:
// over the mapping, the hash's own loads wait on memory page after page,
// while pread moves the bytes with the kernel's copy into a buffer the
// hash then reads from the core's cache (BenchmarkHashFile compares the
// two). A blob fetched as parallel chunks has most of its bytes hashed
// this way.
func hashFile(h hash.Hash, f *os.File, off, n int64, buf *[]byte) error {
	if *buf == nil {
		*buf = make([]byte, hashBuffer)
	}
	for n > 0 {
		k := min(int64(len(*buf)), n)
		if _, err := f.ReadAt((*buf)[:k], off); err != nil {
			return fmt.Errorf("reading %d bytes at %d: %w", k, off, err)
		}
		h.Write((*buf)[:k])
		off, n = off+k, n-k
	}
	return nil
}
