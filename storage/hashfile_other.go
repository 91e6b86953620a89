//go:build !linux

package storage

import (
	"hash"
	"os"
)

// hashFile hashes n bytes of f at off into h, read through *buf (allocated
// on first use).
func hashFile(h hash.Hash, f *os.File, off, n int64, buf *[]byte) error {
	if *buf == nil {
		*buf = make([]byte, 256<<10)
	}
	for n > 0 {
		k := min(int64(len(*buf)), n)
		if _, err := f.ReadAt((*buf)[:k], off); err != nil {
			return err
		}
		h.Write((*buf)[:k])
		off, n = off+k, n-k
	}
	return nil
}
