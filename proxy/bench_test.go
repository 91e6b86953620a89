package proxy

import (
	"io"
	"net/http"
	"testing"
)

// BenchmarkServeCachedBlob measures serving a stored 64 MiB blob over
// loopback: the warm path every node after the first takes.
func BenchmarkServeCachedBlob(b *testing.B) {
	content := make([]byte, 64<<20)
	for i := range content {
		content[i] = byte(i * 7)
	}
	bs, srv := newBlobServer(b, content)
	e := blobEnv(b, bs, srv)
	url := e.proxy.URL + "/v2/test/app/blobs/" + bs.digest.String() + "?ns=" + upstreamName
	get := func() {
		resp, err := http.Get(url)
		if err != nil {
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil || n != int64(len(content)) {
			b.Fatalf("read %d bytes, err %v", n, err)
		}
	}
	get() // warm the cache
	b.SetBytes(int64(len(content)))
	b.ResetTimer()
	for b.Loop() {
		get()
	}
}

// BenchmarkServeCachedSmallBlob measures serving a stored 104 KiB blob (a
// typical small layer or config) to many clients at once over kept-alive
// connections: the per-request cost of the hit path (routing, headers,
// opening the file, metrics, the log line), which small blobs expose.
func BenchmarkServeCachedSmallBlob(b *testing.B) {
	content := make([]byte, 104<<10)
	for i := range content {
		content[i] = byte(i * 7)
	}
	bs, srv := newBlobServer(b, content)
	e := blobEnv(b, bs, srv)
	url := e.proxy.URL + "/v2/test/app/blobs/" + bs.digest.String() + "?ns=" + upstreamName
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	get := func() error {
		resp, err := client.Get(url)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		n, err := io.Copy(io.Discard, resp.Body)
		if err == nil && n != int64(len(content)) {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	if err := get(); err != nil { // warm the cache
		b.Fatal(err)
	}
	b.SetBytes(int64(len(content)))
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := get(); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
