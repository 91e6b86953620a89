package archive

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/archivetest"
)

// TestExtractBounds: an archive is indexed, never unpacked, and an entry
// is read only as a regular file of the size its manifest declares:
// sparse entries (old GNU and PAX), names outside the archive, devices,
// entries past the archive's end and a cancelled import are refused, and
// a link is refused where a blob is read.
func TestExtractBounds(t *testing.T) {
	t.Parallel()
	regular := func(name string, b []byte) []byte {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: int64(len(b)), Mode: 0o644})
		tw.Write(b)
		tw.Flush()
		return buf.Bytes()
	}
	header := func(h *tar.Header) []byte {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(h)
		tw.Flush()
		return buf.Bytes()
	}
	end := make([]byte, 1024)
	data := bytes.Repeat([]byte("x"), 4096)
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	whole := cat(regular("blobs/a", data), regular("index.json", []byte("{}")), end)
	for _, tc := range []struct {
		name    string
		archive []byte
		cancel  bool
		read    string // an entry then read with its true size
		want    string // in the error; "" for none
	}{
		{name: "regular entries", archive: whole, read: "blobs/a"},
		{name: "PAX sparse", archive: cat(archivetest.PAXSparseEntry("blobs/a", data, 600<<20), end), want: "sparse"},
		{name: "old GNU sparse", archive: cat(archivetest.GNUSparseEntry("blobs/a", data, 600<<20), end), want: "sparse"},
		{name: "a name outside", archive: cat(regular("../a", data), end), want: "outside"},
		{name: "an absolute name", archive: cat(regular("/etc/a", data), end), want: "outside"},
		{name: "a device", archive: cat(header(&tar.Header{Typeflag: tar.TypeChar, Name: "dev", Mode: 0o644}), end), want: "no place"},
		{name: "truncated", archive: whole[:len(whole)/3], want: "ends inside"},
		{name: "twice", archive: cat(regular("blobs/a", data), regular("./blobs/a", data), end), want: "twice"},
		{name: "a link read as a blob", archive: cat(header(&tar.Header{Typeflag: tar.TypeSymlink, Name: "blobs/a", Linkname: "/etc/passwd"}), end),
			read: "blobs/a", want: "link"},
		{name: "cancelled", archive: whole, cancel: true, want: "canceled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "a.tar")
			if err := os.WriteFile(path, tc.archive, 0o644); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(t.Context())
			if tc.cancel {
				cancel()
			}
			defer cancel()
			x, err := indexArchive(ctx, path)
			if err == nil && tc.read != "" {
				defer x.Close()
				var r io.Reader
				if r, err = x.open(ctx, tc.read, int64(len(data))); err == nil {
					var b []byte
					if b, err = io.ReadAll(r); err == nil && !bytes.Equal(b, data) {
						t.Errorf("entry %s: read %d bytes, not its own", tc.read, len(b))
					}
				}
				// The size a manifest declares bounds what is read.
				if err == nil {
					if _, derr := x.open(ctx, tc.read, int64(len(data))+1); derr == nil || !strings.Contains(derr.Error(), "declared") {
						t.Errorf("entry %s read as a byte larger: %v, want refused", tc.read, derr)
					}
				}
			} else if err == nil {
				x.Close()
			}
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("got %v, want no error", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("got %v, want an error naming %q", err, tc.want)
			}
		})
	}
}
