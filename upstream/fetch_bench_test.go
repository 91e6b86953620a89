package upstream

import (
	"net/http/httptest"
	"testing"

	"github.com/opencontainers/go-digest"
)

// BenchmarkFetchBlob fetches a 64 MiB blob from a loopback range server
// with the default fetch settings: the fetcher's own cost per blob, its
// allocations above all (the blob's bytes go to a buffer reused across
// runs), without a path's round trips.
func BenchmarkFetchBlob(b *testing.B) {
	const size = 64 << 20
	blob := randomBlob(size)
	srv := httptest.NewServer(&rangeServer{blob: blob})
	defer srv.Close()
	tr := NewTransport()
	defer tr.CloseIdleConnections()
	d := digest.FromBytes(blob)
	buf := make([]byte, 0, size)
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		r, err := New(testUpstream, []string{srv.URL}, WithTransport(tr), WithLogger(discardLogger))
		if err != nil {
			b.Fatal(err)
		}
		w := newMemBlobWriter(-1)
		w.data = buf[:0]
		if _, err := r.FetchBlob(b.Context(), "org/app", d, w); err != nil {
			b.Fatal(err)
		}
	}
}
