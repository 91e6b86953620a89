package proxy

import (
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"strings"
	"syscall"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
)

// TestStoreErrorsKeepPathsHome: what the store fails with reaches clients
// with a status they can act on and without the data dir's paths.
func TestStoreErrorsKeepPathsHome(t *testing.T) {
	t.Parallel()
	const dir = "/var/lib/pullproxy"
	d := digest.FromString("m")
	for _, tt := range []struct {
		name   string
		err    error
		status int
	}{
		{"disk full storing a manifest", fmt.Errorf("storing %s: %w", d,
			&fs.PathError{Op: "open", Path: dir + "/partial/put-123", Err: syscall.ENOSPC}), http.StatusInsufficientStorage},
		{"no room for a download", fmt.Errorf("downloading %s needs 10 bytes: %w", d, storage.ErrNoSpace), http.StatusInsufficientStorage},
		{"unreadable file", fmt.Errorf("reading blob %s: %w", d,
			&fs.PathError{Op: "read", Path: dir + "/blobs/sha256/ab/ab12", Err: syscall.EIO}), http.StatusInternalServerError},
	} {
		e := toOCI(tt.err, kindManifest)
		if e.status != tt.status {
			t.Errorf("%s: status %d, want %d", tt.name, e.status, tt.status)
		}
		if strings.Contains(e.message, dir) {
			t.Errorf("%s: message %q holds the data dir's path", tt.name, e.message)
		}
		if e.message == "" || errors.Is(tt.err, storage.ErrNoSpace) && !strings.Contains(e.message, "free") {
			t.Errorf("%s: message %q does not say what failed", tt.name, e.message)
		}
	}
}
