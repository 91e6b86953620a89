package archive

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"log/slog"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/archivetest"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
)

// openOffline opens a mirror on a new data dir whose one upstream,
// registry.test, is offline: what is imported for it is served.
func openOffline(t *testing.T) *mirror.Mirror {
	t.Helper()
	cfg := config.Default()
	cfg.DataDir = t.TempDir()
	cfg.Upstreams = []config.Upstream{{Name: "registry.test", Offline: true}}
	m, err := mirror.Open(t.Context(), cfg, slog.New(slog.DiscardHandler), nil, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	return m
}

// TestImportThenExport: an imported layout's image is tagged in the store
// and exported again whole; an archive whose entry is not the size its
// manifest declares is refused and leaves nothing.
func TestImportThenExport(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a := archivetest.NewLayout()
	layer := a.Blob(ocispec.MediaTypeImageLayerGzip, archivetest.LayerBytes(1, 64<<10))
	manifest := a.Image("registry.test/app/one:v1", 1, layer)
	file := filepath.Join(dir, "one.tar")
	a.Write(t, file)

	m := openOffline(t)
	imp := NewImporter(m, file, false)
	if err := imp.Run(t.Context()); err != nil {
		t.Fatal(err)
	}
	var report bytes.Buffer
	imp.Report(&report, "one.tar")
	if want := "imported registry.test/app/one:v1 " + manifest.Digest.String(); !strings.Contains(report.String(), want) {
		t.Errorf("report: got %q, want it to say %q", report.String(), want)
	}
	held := map[digest.Digest]bool{}
	if err := m.Store.ImageDigests(t.Context(), "registry.test", "app/one", "v1", held); err != nil || !held[layer.Digest] {
		t.Fatalf("the store's image: got %v, %v, want it to hold the layer", held, err)
	}

	exported := filepath.Join(dir, "exported.tar")
	f, err := os.Create(exported)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := imageref.Parse("registry.test/app/one:v1")
	if err := Export(t.Context(), m.Server, []imageref.Ref{ref}, dir, f, &report, false); err != nil {
		t.Fatal(err)
	}
	f.Close()
	again := openOffline(t)
	imp = NewImporter(again, exported, false)
	if err := imp.Run(t.Context()); err != nil {
		t.Fatalf("importing the export: %v", err)
	}
	if n := len(imp.added()); n != 3 {
		t.Errorf("importing the export added %d blobs, want 3 (config, layer, manifest)", n)
	}

	bad := archivetest.NewLayout()
	trueBytes := archivetest.LayerBytes(2, 4<<10)
	claimed := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(trueBytes), Size: int64(len(trueBytes))}
	bad.File(archivetest.BlobEntryName(claimed.Digest), append(trueBytes, 0))
	bad.Image("registry.test/app/bad:v1", 2, claimed)
	badFile := filepath.Join(dir, "bad.tar")
	bad.Write(t, badFile)
	before, _ := m.Store.Usage()
	imp = NewImporter(m, badFile, false)
	if err := imp.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "declared") {
		t.Errorf("an entry larger than declared: got %v, want it refused", err)
	}
	if after, _ := m.Store.Usage(); after != before {
		t.Errorf("the refused archive left %d bytes in the store", after-before)
	}
}
