package storage

import (
	"crypto/sha256"
	"os"
	"path/filepath"
	"testing"
)

// TestHashFile: any range of a file, at any alignment, hashes as its bytes
// do; a range past the file's end is an error, not a crash.
func TestHashFile(t *testing.T) {
	t.Parallel()
	data := randomBytes(3, 3<<20+123)
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tests := []struct {
		name   string
		off, n int64
	}{
		{"whole file", 0, int64(len(data))},
		{"one byte", 0, 1},
		{"unaligned start", 1, 8191},
		{"last byte of a page", 4095, 1},
		{"page aligned", 4096, 1 << 20},
		{"unaligned, to the end", 5000, int64(len(data)) - 5000},
		{"nothing", 100, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := sha256.New()
			var buf []byte
			if err := hashFile(h, f, tt.off, tt.n, &buf); err != nil {
				t.Fatalf("hashFile: %v", err)
			}
			want := sha256.Sum256(data[tt.off : tt.off+tt.n])
			if got := h.Sum(nil); string(got) != string(want[:]) {
				t.Errorf("hash: got %x, want %x", got, want)
			}
		})
	}
	t.Run("past the end", func(t *testing.T) {
		var buf []byte
		if err := hashFile(sha256.New(), f, int64(len(data))-10, 1<<20, &buf); err == nil {
			t.Error("hashFile past the file's end: got no error, want one")
		}
	})
}
