package proxy

import "bytes"

// fastRequest is a request the blob loop (see fastPath) may answer itself:
// a GET or HEAD under /v2/, HTTP/1.1, kept alive, without a body, and
// without any header that would change the answer (Range, conditionals).
type fastRequest struct {
	method string // http.MethodGet or http.MethodHead
	path   string // clean, needing no unescaping
	query  string // raw, needing no unescaping
	size   int    // bytes the request takes, its blank line included
}

// fastVerdict is what parseFastRequest makes of the bytes it is given.
type fastVerdict int

const (
	fastIncomplete fastVerdict = iota // a fast request may yet arrive: read more
	fastNot                           // not one: net/http is to answer it
	fastOK                            // one, of fastRequest.size bytes
)

// maxFastRequest bounds the head of a request the loop parses. Longer
// heads (large cookies or tokens) go to net/http, whose limit is larger.
const maxFastRequest = 4 << 10

// parseFastRequest reads the request at the start of b. It accepts only a
// strict, common subset of HTTP/1.1, and leaves everything else to net/http:
// anything it accepts, net/http would read as the same method, path and
// query, with no body, and as keeping the connection open, so that answering
// it here cannot disagree with net/http. FuzzParseFastRequest checks this.
// A request it cannot accept is refused as soon as its first line that says
// so has arrived.
func parseFastRequest(b []byte) (fastRequest, fastVerdict) {
	var req fastRequest
	hosts := 0
	rest := b
	for first := true; ; first = false {
		i := bytes.IndexByte(rest, '\n')
		if i < 0 { // the line has not ended yet
			if len(b) >= maxFastRequest || first && !couldStartFast(rest) {
				return fastRequest{}, fastNot
			}
			return fastRequest{}, fastIncomplete
		}
		if i == 0 || rest[i-1] != '\r' {
			return fastRequest{}, fastNot // a bare LF, which net/http takes for a line's end
		}
		line := rest[:i-1]
		rest = rest[i+1:]
		switch {
		case first:
			if !req.parseRequestLine(line) {
				return fastRequest{}, fastNot
			}
		case len(line) == 0: // the end of the head
			req.size = len(b) - len(rest)
			if req.size > maxFastRequest || hosts != 1 { // HTTP/1.1 requires exactly one Host
				return fastRequest{}, fastNot
			}
			return req, fastOK
		default:
			host, ok := fastHeader(line)
			if !ok {
				return fastRequest{}, fastNot
			}
			if host {
				hosts++
			}
		}
	}
}

// parseRequestLine reads the request line, without its CRLF, into req.
func (req *fastRequest) parseRequestLine(line []byte) bool {
	switch {
	case bytes.HasPrefix(line, []byte("GET ")):
		req.method, line = "GET", line[4:]
	case bytes.HasPrefix(line, []byte("HEAD ")):
		req.method, line = "HEAD", line[5:]
	default:
		return false
	}
	target, ok := bytes.CutSuffix(line, []byte(" HTTP/1.1"))
	if !ok || !bytes.HasPrefix(target, []byte("/v2/")) {
		return false
	}
	p, q, _ := bytes.Cut(target, []byte("?"))
	if !allIn(p, &pathChars) || !allIn(q, &queryChars) || !cleanPath(p) {
		return false
	}
	req.path, req.query = string(p), string(q)
	return true
}

// fastHeader checks a header line, without its CRLF, and reports whether
// it is a Host line. It refuses a line that is not one net/http reads the
// same way, or whose field would change the answer or the connection's
// fate.
func fastHeader(line []byte) (host, ok bool) {
	name, value, ok := bytes.Cut(line, []byte(":"))
	if !ok || len(name) == 0 || !allIn(name, &tokenChars) {
		return false, false
	}
	value = trimSpace(value)
	if !fieldValue(value) {
		return false, false
	}
	switch name[0] | 0x20 { // the first letter, lower-cased: most names need no other comparison
	case 'h':
		if equalFold(name, "host") {
			return true, len(value) > 0 && allIn(value, &hostChars)
		}
	case 'c':
		if equalFold(name, "connection") {
			return false, equalFold(value, "keep-alive") // not close, upgrade, a list
		}
		return false, !equalFold(name, "content-length")
	case 't', 'e', 'u', 'r', 'i':
		return false, !(equalFold(name, "transfer-encoding") || equalFold(name, "expect") || equalFold(name, "upgrade") ||
			equalFold(name, "range") || len(name) > 3 && equalFold(name[:3], "if-"))
	}
	return false, true
}

// trimSpace trims spaces and tabs, the optional white space around a
// field's value.
func trimSpace(v []byte) []byte {
	for len(v) > 0 && (v[0] == ' ' || v[0] == '\t') {
		v = v[1:]
	}
	for len(v) > 0 && (v[len(v)-1] == ' ' || v[len(v)-1] == '\t') {
		v = v[:len(v)-1]
	}
	return v
}

// cleanPath reports whether path.Clean would leave p, a rooted path, as it
// is: no empty, "." or ".." element, no trailing slash.
func cleanPath(p []byte) bool {
	for {
		i := bytes.IndexByte(p, '/')
		if i < 0 {
			return true
		}
		p = p[i+1:]
		elem := p
		if j := bytes.IndexByte(p, '/'); j >= 0 {
			elem = p[:j]
		}
		if len(elem) == 0 || elem[0] == '.' && (len(elem) == 1 || len(elem) == 2 && elem[1] == '.') {
			return false
		}
	}
}

// couldStartFast reports whether b could be the start of a fast request.
func couldStartFast(b []byte) bool {
	for _, m := range []string{"GET /v2/", "HEAD /v2/"} {
		n := min(len(b), len(m))
		if string(b[:n]) == m[:n] {
			return true
		}
	}
	return false
}

// fieldValue reports whether v is a field value as RFC 9110 has it, without
// obsolete text: visible ASCII, spaces and tabs.
func fieldValue(v []byte) bool {
	for _, c := range v {
		if (c < 0x20 && c != '\t') || c >= 0x7f {
			return false
		}
	}
	return true
}

// equalFold is strings.EqualFold for an ASCII lower-case s, without
// converting b.
func equalFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != s[i] {
			return false
		}
	}
	return true
}

// byteSet is a set of bytes.
type byteSet [256]bool

func newByteSet(chars string) (s byteSet) {
	for _, c := range []byte(chars) {
		s[c] = true
	}
	return s
}

func allIn(b []byte, s *byteSet) bool {
	for _, c := range b {
		if !s[c] {
			return false
		}
	}
	return true
}

const alnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"

// Characters a fast request may use. Paths and queries exclude escapes and
// everything net/http or url.ParseQuery would read differently from the raw
// bytes ('%', '+', ';', '#').
var (
	pathChars  = newByteSet(alnum + "-._~/:@")
	queryChars = newByteSet(alnum + "-._~/:@=&")
	hostChars  = newByteSet(alnum + "-._:[]")
	tokenChars = newByteSet(alnum + "!#$%&'*+-.^_`|~")
)
