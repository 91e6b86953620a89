package proxy

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
)

// Range and conditional requests on blobs, answered the same way whether
// the blob is stored or still downloading (RFC 9110, sections 13 and 14).
// A blob's entity tag is its quoted digest, and it has no modification
// date, so the date conditions (If-Modified-Since, If-Unmodified-Since, an
// If-Range with a date) never hold or fail: they are ignored, as the RFC
// says for a resource without one.

// rangeKind is what a Range header asks of a blob.
type rangeKind int

const (
	rangeWhole         rangeKind = iota // no Range, or one to ignore: the whole blob, 200
	rangePart                           // one satisfiable range, 206
	rangeUnsatisfiable                  // a valid range that lies outside the blob, 416
)

// parseByteRange reads a Range header against a blob of size bytes. An
// unknown unit, a malformed or invalid range-spec (such as bytes=5-1) and a
// set of several ranges are ignored (the whole blob is sent, which RFC
// 9110 allows a server to do for any Range). One valid range-spec is
// satisfiable when its first byte is within the blob (a suffix: when it
// asks for at least one byte of a non-empty blob), and then clipped to it.
func parseByteRange(header string, size int64) (start, end int64, kind rangeKind) {
	unit, set, ok := strings.Cut(header, "=")
	if !ok || !strings.EqualFold(strings.TrimSpace(unit), "bytes") || strings.Contains(set, ",") {
		return 0, size, rangeWhole
	}
	first, last, ok := strings.Cut(strings.TrimSpace(set), "-")
	if !ok {
		return 0, size, rangeWhole
	}
	if first == "" { // suffix-range: the last n bytes
		n, ok := digits(last)
		switch {
		case !ok:
			return 0, size, rangeWhole
		case n == 0 || size == 0:
			return 0, 0, rangeUnsatisfiable
		}
		return max(size-n, 0), size, rangePart
	}
	a, ok := digits(first)
	if !ok {
		return 0, size, rangeWhole
	}
	b := size - 1
	if last != "" {
		if b, ok = digits(last); !ok || b < a {
			return 0, size, rangeWhole // invalid: ignored
		}
	}
	if a >= size {
		return 0, 0, rangeUnsatisfiable
	}
	return a, min(b, size-1) + 1, rangePart
}

// digits parses a non-empty run of decimal digits, as the RFC's 1*DIGIT.
func digits(s string) (int64, bool) {
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

// etagListMatches reports whether a list of entity tags (an If-Match or
// If-None-Match value) holds etag, or is "*". Weak tags match only with
// weak comparison.
func etagListMatches(list, etag string, weak bool) bool {
	if strings.TrimSpace(list) == "*" {
		return true
	}
	for t := range strings.SplitSeq(list, ",") {
		t = strings.TrimSpace(t)
		if w, ok := strings.CutPrefix(t, "W/"); ok {
			if !weak {
				continue
			}
			t = w
		}
		if t == etag {
			return true
		}
	}
	return false
}

// preconditions evaluates If-Match and If-None-Match for a blob with the
// entity tag etag, and answers the request (412, or 304 for GET and HEAD)
// when one decides it. It reports whether it answered.
func preconditions(w http.ResponseWriter, r *http.Request, etag string) bool {
	if im := r.Header.Get("If-Match"); im != "" && !etagListMatches(im, etag, false) {
		writeErrorJSON(w, r, &ociError{status: http.StatusPreconditionFailed, code: "UNKNOWN",
			message: "If-Match: the blob's entity tag is " + etag})
		return true
	}
	if inm := r.Header.Get("If-None-Match"); inm != "" && etagListMatches(inm, etag, true) {
		h := w.Header()
		for _, k := range []string{"Content-Type", "Content-Length", "Accept-Ranges"} {
			delete(h, k)
		}
		w.WriteHeader(http.StatusNotModified)
		return true
	}
	return false
}

// requestedRange is the range a request asks of a blob of size bytes with
// the entity tag etag: its Range header, unless an If-Range does not hold
// (only an exact strong tag does; a date never does).
func requestedRange(r *http.Request, etag string, size int64) (start, end int64, kind rangeKind) {
	rng := r.Header.Get("Range")
	if ir := strings.TrimSpace(r.Header.Get("If-Range")); rng != "" && ir != "" && ir != etag {
		rng = ""
	}
	return parseByteRange(rng, size)
}

// writeRangeHead sets the headers of an answer to a range of kind over a
// blob of size bytes, and sends the status line. It reports false, having
// answered 416, when the range cannot be satisfied.
func writeRangeHead(w http.ResponseWriter, r *http.Request, start, end, size int64, kind rangeKind) bool {
	h := w.Header()
	switch kind {
	case rangeUnsatisfiable:
		h.Set("Content-Range", "bytes */"+strconv.FormatInt(size, 10))
		writeErrorJSON(w, r, &ociError{status: http.StatusRequestedRangeNotSatisfiable, code: "BLOB_UNKNOWN",
			message: fmt.Sprintf("range %q is outside the blob's %d bytes", r.Header.Get("Range"), size)})
		return false
	case rangePart:
		h.Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end-1, size))
		h.Set("Content-Length", strconv.FormatInt(end-start, 10))
		w.WriteHeader(http.StatusPartialContent)
	default:
		h.Set("Content-Length", strconv.FormatInt(size, 10))
		w.WriteHeader(http.StatusOK)
	}
	return true
}

// serveStoredPart answers a conditional or ranged GET or HEAD of a stored
// blob: what http.ServeContent did for it, with the range rules of the
// download path (see parseByteRange).
func serveStoredPart(w http.ResponseWriter, r *http.Request, f *os.File, size int64, etag string) {
	if preconditions(w, r, etag) {
		return
	}
	start, end, kind := requestedRange(r, etag, size)
	if !writeRangeHead(w, r, start, end, size, kind) || r.Method == http.MethodHead {
		return
	}
	if start > 0 {
		if _, err := f.Seek(start, io.SeekStart); err != nil {
			return // the response ends short: the client sees it and asks again
		}
	}
	io.CopyN(w, f, end-start)
}
