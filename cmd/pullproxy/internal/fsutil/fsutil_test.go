package fsutil

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// TestWriteFile: the file is replaced whole, mode 0644, and a failed write
// leaves the old file and no temporary one.
func TestWriteFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := WriteFile(path, []byte("one")); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(path, []byte("two")); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "two" {
		t.Errorf("got %q, %v, want two", b, err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o644 {
		t.Errorf("mode: got %v, %v, want 0644", fi.Mode().Perm(), err)
	}
	failed := errors.New("failed")
	if err := WriteFileFunc(path, func(w io.Writer) error { w.Write([]byte("half")); return failed }); !errors.Is(err, failed) {
		t.Errorf("a failed write: got %v, want %v", err, failed)
	}
	if b, _ := os.ReadFile(path); string(b) != "two" {
		t.Errorf("after a failed write: got %q, want two", b)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("the directory holds %d entries, want the file alone", len(entries))
	}
}

func TestSpace(t *testing.T) {
	t.Parallel()
	free, total, err := Space(t.TempDir())
	if err != nil || total <= 0 || free < 0 || free > total {
		t.Errorf("got free %d of %d, %v", free, total, err)
	}
}
