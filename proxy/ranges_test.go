package proxy

import (
	"bytes"
	"net/http"
	"testing"
)

func TestParseByteRange(t *testing.T) {
	t.Parallel()
	const size = 1000
	for _, tt := range []struct {
		header     string
		start, end int64
		kind       rangeKind
	}{
		{"", 0, size, rangeWhole},
		{"bytes=0-", 0, size, rangePart},
		{"bytes=0-499", 0, 500, rangePart},
		{"bytes=500-999", 500, size, rangePart},
		{"bytes=500-5000", 500, size, rangePart}, // clipped
		{"bytes=999-999", 999, size, rangePart},
		{"Bytes=10-19", 10, 20, rangePart}, // the unit is case-insensitive
		{"bytes= 10-19 ", 10, 20, rangePart},
		{"bytes=-100", 900, size, rangePart},
		{"bytes=-5000", 0, size, rangePart}, // longer than the blob: all of it
		{"bytes=1000-", 0, 0, rangeUnsatisfiable},
		{"bytes=5000-6000", 0, 0, rangeUnsatisfiable},
		{"bytes=-0", 0, 0, rangeUnsatisfiable},
		{"bytes=5-1", 0, size, rangeWhole},                   // invalid range-spec: ignored
		{"bytes=0-9,20-29", 0, size, rangeWhole},             // several ranges: the whole blob instead
		{"bytes=+5-9", 0, size, rangeWhole},                  // not 1*DIGIT
		{"bytes=5--9", 0, size, rangeWhole},                  // not 1*DIGIT
		{"bytes=abc", 0, size, rangeWhole},                   // malformed
		{"bytes=", 0, size, rangeWhole},                      // empty
		{"items=0-9", 0, size, rangeWhole},                   // unknown unit
		{"bytes=99999999999999999999-", 0, size, rangeWhole}, // overflows
	} {
		start, end, kind := parseByteRange(tt.header, size)
		if start != tt.start || end != tt.end || kind != tt.kind {
			t.Errorf("parseByteRange(%q) = %d, %d, %d; want %d, %d, %d", tt.header, start, end, kind, tt.start, tt.end, tt.kind)
		}
	}
	if _, _, kind := parseByteRange("bytes=-10", 0); kind != rangeUnsatisfiable {
		t.Errorf("a suffix of an empty blob: got %d, want unsatisfiable", kind)
	}
}

// TestRangesAnsweredAlikeCachedAndCold: a blob asked with each Range and
// condition gets the same status, Content-Range and body while it is
// fetched (cold) as once it is stored.
func TestRangesAnsweredAlikeCachedAndCold(t *testing.T) {
	t.Parallel()
	content := randomBytes(t, 300_000)
	b, srv := newBlobServer(t, content)
	etag := `"` + b.digest.String() + `"`
	cases := []struct {
		name   string
		header http.Header
		status int
	}{
		{"whole", nil, 200},
		{"open range", http.Header{"Range": {"bytes=1000-"}}, 206},
		{"closed range", http.Header{"Range": {"bytes=1000-1999"}}, 206},
		{"suffix", http.Header{"Range": {"bytes=-500"}}, 206},
		{"past the end", http.Header{"Range": {"bytes=300000-"}}, 416},
		{"empty suffix", http.Header{"Range": {"bytes=-0"}}, 416},
		{"invalid range", http.Header{"Range": {"bytes=5-1"}}, 200},
		{"several ranges", http.Header{"Range": {"bytes=0-9,20-29"}}, 200},
		{"If-None-Match, current", http.Header{"If-None-Match": {etag}}, 304},
		{"If-None-Match, other", http.Header{"If-None-Match": {`"sha256:0"`}}, 200},
		{"If-Match, other", http.Header{"If-Match": {`"sha256:0"`}}, 412},
		{"If-Range, current", http.Header{"Range": {"bytes=10-19"}, "If-Range": {etag}}, 206},
		{"If-Range, other", http.Header{"Range": {"bytes=10-19"}, "If-Range": {`"sha256:0"`}}, 200},
	}
	type answer struct {
		status       int
		contentRange string
		body         []byte
	}
	ask := func(e *env, h http.Header) answer {
		p := "/v2/test/app/blobs/" + b.digest.String() + "?ns=" + upstreamName
		resp, body := e.get(http.MethodGet, p, h)
		return answer{resp.StatusCode, resp.Header.Get("Content-Range"), body}
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := &env{t: t, dir: t.TempDir(), upstream: srv, counter: &counter{counts: map[string]int{}}}
			e.start(srv.URL)
			cold := ask(e, tc.header)
			if got := ask(e, nil); got.status != 200 || !bytes.Equal(got.body, content) { // stores it, if the first did not
				t.Fatalf("whole blob: %d, %d bytes", got.status, len(got.body))
			}
			cached := ask(e, tc.header)
			if cold.status != tc.status {
				t.Errorf("cold: status %d, want %d", cold.status, tc.status)
			}
			if cached.status != cold.status || cached.contentRange != cold.contentRange ||
				(cold.status < 300 && !bytes.Equal(cached.body, cold.body)) {
				t.Errorf("cached: %d %q, %d bytes; cold: %d %q, %d bytes",
					cached.status, cached.contentRange, len(cached.body), cold.status, cold.contentRange, len(cold.body))
			}
		})
	}
}
