// Package fsutil holds the file helpers pullproxy's commands share:
// writing a file whole or not at all, and a file system's free space.
package fsutil

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// WriteFile replaces path with b, mode 0644: a reader never sees half a
// file.
func WriteFile(path string, b []byte) error {
	return WriteFileFunc(path, func(w io.Writer) error {
		_, err := w.Write(b)
		return err
	})
}

// WriteFileFunc writes path with write, mode 0644, replacing it whole once
// written and synced: a reader never sees half an archive.
func WriteFileFunc(path string, write func(io.Writer) error) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".pullproxy-*")
	if err != nil {
		return err
	}
	err = write(tmp)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return errors.Join(fmt.Errorf("writing %s", path), err)
	}
	return nil
}

// Space returns the free (to unprivileged users) and total bytes of the
// file system holding path.
func Space(path string) (free, total int64, err error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		return 0, 0, err
	}
	return int64(st.Bavail) * int64(st.Bsize), int64(st.Blocks) * int64(st.Bsize), nil
}
