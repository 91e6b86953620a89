package proxy

import (
	"bufio"
	"bytes"
	"net/http"
	"path"
	"strings"
	"testing"
)

const fastBlobPath = "/v2/library/app/blobs/sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// containerdRequest is what containerd sends for a layer through a mirror.
const containerdRequest = "GET " + fastBlobPath + "?ns=docker.io HTTP/1.1\r\n" +
	"Host: mirror.local:5000\r\n" +
	"User-Agent: containerd/1.6.20\r\n" +
	"Accept: application/vnd.docker.image.rootfs.diff.tar.gzip, */*\r\n" +
	"Accept-Encoding: gzip\r\n\r\n"

func TestParseFastRequest(t *testing.T) {
	tests := []struct {
		name string
		req  string
		want fastVerdict
	}{
		{"containerd's layer GET", containerdRequest, fastOK},
		{"HEAD", "HEAD " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\n\r\n", fastOK},
		{"keep-alive asked", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nConnection: Keep-Alive\r\n\r\n", fastOK},
		{"spaces around a value", "GET " + fastBlobPath + " HTTP/1.1\r\nHost:  m \t\r\nX-A:\r\n\r\n", fastOK},
		{"a token with its header", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer abc.def\r\n\r\n", fastOK},

		{"empty", "", fastIncomplete},
		{"method only", "GE", fastIncomplete},
		{"head not ended", strings.TrimSuffix(containerdRequest, "\r\n"), fastIncomplete},
		{"CR of the last line", strings.TrimSuffix(containerdRequest, "\n"), fastIncomplete},

		{"POST", "POST " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"POST not ended", "POST " + fastBlobPath, fastNot},
		{"lower-case method", "get " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"outside /v2/", "GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"HTTP/1.0", "GET " + fastBlobPath + " HTTP/1.0\r\nHost: m\r\n\r\n", fastNot},
		{"HTTP/2 preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", fastNot},
		{"absolute target", "GET http://m" + fastBlobPath + " HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"escaped path", "GET /v2/library/a%70p/blobs/sha256:00 HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"unclean path", "GET /v2/library/../app/blobs/sha256:00 HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"double slash", "GET /v2//app/blobs/sha256:00 HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"dot element", "GET /v2/app/./blobs/sha256:00 HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"trailing dot-dot", "GET /v2/app/blobs/.. HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"trailing slash", "GET /v2/app/blobs/ HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"bare LF in a value", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nX-A: a\nb\r\n\r\n", fastNot},
		{"bare CR in a value", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nX-A: a\rb\r\n\r\n", fastNot},
		{"bare LF in the target", "GET /v2/a\nb HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"plus in query", "GET " + fastBlobPath + "?ns=a+b HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"semicolon in query", "GET " + fastBlobPath + "?ns=a;b HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"fragment", "GET " + fastBlobPath + "#x HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"two spaces", "GET  " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\n\r\n", fastNot},
		{"no Host", "GET " + fastBlobPath + " HTTP/1.1\r\nAccept: */*\r\n\r\n", fastNot},
		{"two Hosts", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nHost: n\r\n\r\n", fastNot},
		{"bad Host", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m/x\r\n\r\n", fastNot},
		{"Connection: close", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n", fastNot},
		{"Connection: a list", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nConnection: keep-alive, x\r\n\r\n", fastNot},
		{"Range", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nRange: bytes=0-9\r\n\r\n", fastNot},
		{"If-None-Match", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nif-none-match: \"x\"\r\n\r\n", fastNot},
		{"If-Range", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nIF-RANGE: \"x\"\r\n\r\n", fastNot},
		{"a body", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nContent-Length: 3\r\n\r\nabc", fastNot},
		{"an empty body", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nContent-Length: 0\r\n\r\n", fastNot},
		{"chunked", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", fastNot},
		{"Expect", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nExpect: 100-continue\r\n\r\n", fastNot},
		{"Upgrade", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nUpgrade: h2c\r\n\r\n", fastNot},
		{"folded line", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nX-A: a\r\n b\r\n\r\n", fastNot},
		{"space before colon", "GET " + fastBlobPath + " HTTP/1.1\r\nHost : m\r\n\r\n", fastNot},
		{"no colon", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nX-A\r\n\r\n", fastNot},
		{"control byte", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nX-A: a\x00b\r\n\r\n", fastNot},
		{"non-ASCII value", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nX-A: \xc3\xa9\r\n\r\n", fastNot},
		{"bare LF", "GET " + fastBlobPath + " HTTP/1.1\nHost: m\n\n", fastNot},
		{"bare LF, not ended", "GET " + fastBlobPath + " HTTP/1.1\nHost: m\n", fastNot},
		{"bare CR", "GET " + fastBlobPath + " HTTP/1.1\rHost: m\r\n\r\n", fastNot},
		{"too long", "GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nX-A: " + strings.Repeat("a", maxFastRequest) + "\r\n\r\n", fastNot},
		{"too long, not ended", "GET " + fastBlobPath + " HTTP/1.1\r\nX-A: " + strings.Repeat("a", maxFastRequest), fastNot},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, got := parseFastRequest([]byte(tt.req))
			if got != tt.want {
				t.Fatalf("verdict %d, want %d", got, tt.want)
			}
			if got == fastOK && req.size != len(tt.req) {
				t.Errorf("size %d, want %d", req.size, len(tt.req))
			}
		})
	}
}

func TestParseFastRequestReadsOneOfPipelined(t *testing.T) {
	b := []byte(containerdRequest + "HEAD " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\n\r\n")
	req, v := parseFastRequest(b)
	if v != fastOK || req.method != http.MethodGet || req.size != len(containerdRequest) ||
		req.path != fastBlobPath || req.query != "ns=docker.io" {
		t.Fatalf("first: %+v, verdict %d", req, v)
	}
	req, v = parseFastRequest(b[req.size:])
	if v != fastOK || req.method != http.MethodHead || req.query != "" {
		t.Fatalf("second: %+v, verdict %d", req, v)
	}
}

// FuzzParseFastRequest checks that what the blob loop answers itself,
// net/http would have read as the same request: same method, path and
// query, no body, the connection kept open, no header that changes the
// answer, and the same length.
func FuzzParseFastRequest(f *testing.F) {
	f.Add([]byte(containerdRequest))
	f.Add([]byte("HEAD " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nConnection: keep-alive\r\n\r\n"))
	f.Add([]byte("GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nRange: bytes=0-9\r\n\r\n"))
	f.Add([]byte("GET " + fastBlobPath + " HTTP/1.1\r\nHost: m\r\nContent-Length: 3\r\n\r\nabc"))
	f.Add([]byte("GET " + fastBlobPath + "?ns=a&b=c HTTP/1.1\nHost: m\n\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, v := parseFastRequest(b)
		if v != fastOK {
			return
		}
		src := bytes.NewReader(b)
		br := bufio.NewReader(src)
		r, err := http.ReadRequest(br)
		if err != nil {
			t.Fatalf("accepted, but net/http fails to read it: %v\n%q", err, b)
		}
		consumed := len(b) - src.Len() - br.Buffered()
		switch {
		case path.Clean(req.path) != req.path:
			t.Fatalf("path %q is not clean", req.path)
		case r.Method != req.method || r.URL.Path != req.path || r.URL.RawQuery != req.query:
			t.Fatalf("read as %s %s ? %s, net/http reads %s %s ? %s", req.method, req.path, req.query, r.Method, r.URL.Path, r.URL.RawQuery)
		case queryValue(req.query, "ns") != r.URL.Query().Get("ns"):
			t.Fatalf("ns %q, net/http reads %q", queryValue(req.query, "ns"), r.URL.Query().Get("ns"))
		case r.ProtoMajor != 1 || r.ProtoMinor != 1 || r.Close:
			t.Fatalf("net/http reads HTTP/%d.%d, close %v", r.ProtoMajor, r.ProtoMinor, r.Close)
		case r.ContentLength != 0 || r.TransferEncoding != nil:
			t.Fatalf("net/http reads a body: length %d, encoding %v", r.ContentLength, r.TransferEncoding)
		case r.Host == "":
			t.Fatal("net/http reads no host")
		case conditional(r.Header):
			t.Fatalf("net/http reads a conditional request: %v", r.Header)
		case consumed != req.size:
			t.Fatalf("size %d, net/http read %d", req.size, consumed)
		}
	})
}

// BenchmarkParseFastRequest: what reading containerd's layer request costs
// the blob loop.
func BenchmarkParseFastRequest(b *testing.B) {
	req := []byte(containerdRequest)
	b.ReportAllocs()
	for b.Loop() {
		if _, v := parseFastRequest(req); v != fastOK {
			b.Fatal(v)
		}
	}
}
