package storage

import (
	"crypto/sha256"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// BenchmarkHashFile hashes a file written as a download's are, 256 KiB at
// a time, the way bytes written out of order are hashed: read back through
// a buffer (hashFile), and, for comparison, through read-only mappings a
// window at a time. (How the file was written matters to the mappings: a
// file written in one call hashes through them as fast as read.)
func BenchmarkHashFile(b *testing.B) {
	const size, window, piece = 64 << 20, 4 << 20, 256 << 10
	f, err := os.Create(filepath.Join(b.TempDir(), "f"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	data := randomBytes(5, piece)
	for off := int64(0); off < size; off += piece {
		if _, err := f.WriteAt(data, off); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("read", func(b *testing.B) {
		b.SetBytes(size)
		var buf []byte
		for b.Loop() {
			if err := hashFile(sha256.New(), f, 0, size, &buf); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("mmap", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			h := sha256.New()
			for off := int64(0); off < size; off += window {
				m, err := unix.Mmap(int(f.Fd()), off, window, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE)
				if err != nil {
					b.Fatal(err)
				}
				h.Write(m)
				unix.Munmap(m)
			}
		}
	})
}
