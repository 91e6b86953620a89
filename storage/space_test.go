package storage

import (
	"errors"
	"testing"

	"github.com/opencontainers/go-digest"
)

// TestDownloadsReserveSpace: a download is refused when the file system's
// free space, less what downloads in progress will still write and a
// margin, cannot take it; a download that ends gives its reservation back.
func TestDownloadsReserveSpace(t *testing.T) {
	t.Parallel()
	s := openStore(t)
	// 100 MiB free of 1 GiB: 51.2 MiB kept free, 48.8 MiB to download into.
	s.space = func(string) (int64, int64, error) { return 100 << 20, 1 << 30, nil }
	newPartial := func(name string, size int64) (*Partial, error) {
		return s.NewPartial(t.Context(), digest.FromString(name), size)
	}
	first, err := newPartial("first", 40<<20)
	if err != nil {
		t.Fatalf("40 MiB: %v", err)
	}
	if _, err := newPartial("second", 20<<20); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("20 MiB more: got %v, want ErrNoSpace", err)
	}
	unknown, err := newPartial("claims a lot", -1)
	if err != nil {
		t.Fatal(err)
	}
	if err := unknown.SetSize(50 << 30); !errors.Is(err, ErrNoSpace) {
		t.Errorf("a size learned later, 50 GiB: got %v, want ErrNoSpace", err)
	}
	if got := unknown.Size(); got != -1 {
		t.Errorf("size after the refusal: got %d, want still unknown", got)
	}
	// What a download has written is no longer to come.
	if _, err := first.WriteAt(make([]byte, 30<<20), 0); err != nil {
		t.Fatal(err)
	}
	if p, err := newPartial("third", 15<<20); err != nil {
		t.Errorf("15 MiB with 10 MiB still to come: %v", err)
	} else {
		p.Fail(errors.New("test over"))
	}
	first.Fail(errors.New("gone"))
	if _, err := newPartial("second", 20<<20); err != nil {
		t.Errorf("20 MiB once the first download ended: %v", err)
	}
}
