package proxy

import (
	"bytes"
	"path"
)

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
func parseFastRequest(b []byte) (fastRequest, fastVerdict) {
	end := bytes.Index(b, crlfcrlf)
	if end < 0 {
		// Not worth waiting for: too long, bare LF line ends (which net/http
		// takes, but which never end in CRLFCRLF), another method.
		if len(b) >= maxFastRequest || bareLF(b) || !couldStartFast(b) {
			return fastRequest{}, fastNot
		}
		return fastRequest{}, fastIncomplete
	}
	req := fastRequest{size: end + len(crlfcrlf)}
	head := b[:end+2] // every line with its CRLF
	if req.size > maxFastRequest || bareLF(head) {
		return fastRequest{}, fastNot
	}
	i := bytes.Index(head, crlf)
	line := head[:i]
	head = head[i+2:]
	switch {
	case bytes.HasPrefix(line, []byte("GET ")):
		req.method, line = "GET", line[4:]
	case bytes.HasPrefix(line, []byte("HEAD ")):
		req.method, line = "HEAD", line[5:]
	default:
		return fastRequest{}, fastNot
	}
	target, ok := bytes.CutSuffix(line, []byte(" HTTP/1.1"))
	if !ok || !bytes.HasPrefix(target, []byte("/v2/")) {
		return fastRequest{}, fastNot
	}
	p, q, _ := bytes.Cut(target, []byte("?"))
	if !allIn(p, &pathChars) || !allIn(q, &queryChars) {
		return fastRequest{}, fastNot
	}
	req.path, req.query = string(p), string(q)
	if path.Clean(req.path) != req.path {
		return fastRequest{}, fastNot
	}

	hosts := 0
	for len(head) > 0 {
		i := bytes.Index(head, crlf)
		line := head[:i]
		head = head[i+2:]
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok || len(name) == 0 || !allIn(name, &tokenChars) {
			return fastRequest{}, fastNot
		}
		value = bytes.Trim(value, " \t")
		if !fieldValue(value) {
			return fastRequest{}, fastNot
		}
		switch {
		case equalFold(name, "host"):
			hosts++
			if len(value) == 0 || !allIn(value, &hostChars) {
				return fastRequest{}, fastNot
			}
		case equalFold(name, "connection"):
			if !equalFold(value, "keep-alive") {
				return fastRequest{}, fastNot // close, upgrade, a list
			}
		case equalFold(name, "content-length"), equalFold(name, "transfer-encoding"),
			equalFold(name, "expect"), equalFold(name, "upgrade"), equalFold(name, "range"),
			len(name) > 3 && equalFold(name[:3], "if-"):
			return fastRequest{}, fastNot
		}
	}
	if hosts != 1 { // HTTP/1.1 requires exactly one
		return fastRequest{}, fastNot
	}
	return req, fastOK
}

var (
	crlf     = []byte("\r\n")
	crlfcrlf = []byte("\r\n\r\n")
)

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

// bareLF reports whether b has a line feed without its carriage return, or
// a carriage return without its line feed (but for a last byte, whose line
// feed may be on its way).
func bareLF(b []byte) bool {
	for i, c := range b {
		switch {
		case c == '\n' && (i == 0 || b[i-1] != '\r'):
			return true
		case c == '\r' && i+1 < len(b) && b[i+1] != '\n':
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
