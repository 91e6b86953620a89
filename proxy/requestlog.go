package proxy

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"
)

// RequestLog writes the line logged for each request straight to a writer,
// byte for byte as slog's text or JSON handler writes it: same keys, order,
// time format and quoting. Through slog, every request would pay for
// building a record, walking its attributes and checking each for quoting:
// a noticeable share of serving a small stored blob, for a line whose
// values almost never need it. Lines with a value that would need quoting
// or escaping go through the logger instead, so the output never differs
// from slog's.
//
// The logger given to WithLogger still decides whether requests are logged
// (Info enabled) and must write to the same writer, unadorned (no WithAttrs,
// WithGroup or ReplaceAttr), for the two to agree.
type RequestLog struct {
	w    io.Writer
	json bool
	bufs sync.Pool // *[]byte
}

// NewRequestLog returns a RequestLog writing to w in format, "text" (or "")
// or "json", as slog.NewTextHandler or slog.NewJSONHandler would.
func NewRequestLog(w io.Writer, format string) (*RequestLog, error) {
	l := &RequestLog{w: w}
	switch strings.ToLower(format) {
	case "", "text":
	case "json":
		l.json = true
	default:
		return nil, fmt.Errorf("request log format %q: want text or json", format)
	}
	l.bufs.New = func() any { b := make([]byte, 0, 512); return &b }
	return l, nil
}

// requestLine is what the line of one request says.
type requestLine struct {
	time         time.Time
	method, path string
	ns, remote   string
	status       int
	bytes        int64
	duration     time.Duration
}

// write writes line, or reports false, writing nothing, when one of its
// strings is not plain (see plainValue).
func (l *RequestLog) write(line *requestLine) bool {
	if !plainValue(line.method) || !plainValue(line.path) || !plainValue(line.ns) || !plainValue(line.remote) {
		return false
	}
	bp := l.bufs.Get().(*[]byte)
	b := (*bp)[:0]
	if l.json {
		b = appendJSONLine(b, line)
	} else {
		b = appendTextLine(b, line)
	}
	l.w.Write(b) // as slog does, a failed write loses the line
	*bp = b
	l.bufs.Put(bp)
	return true
}

func appendTextLine(b []byte, line *requestLine) []byte {
	b = append(b, "time="...)
	b = appendRFC3339Millis(b, line.time)
	b = append(b, " level=INFO msg=request method="...)
	b = append(b, line.method...)
	b = append(b, " path="...)
	b = append(b, line.path...)
	b = append(b, " ns="...)
	if line.ns == "" {
		b = append(b, `""`...)
	} else {
		b = append(b, line.ns...)
	}
	b = append(b, " status="...)
	b = strconv.AppendInt(b, int64(line.status), 10)
	b = append(b, " bytes="...)
	b = strconv.AppendInt(b, line.bytes, 10)
	b = append(b, " duration="...)
	b = append(b, line.duration.String()...)
	b = append(b, " remote="...)
	if line.remote == "" {
		b = append(b, `""`...)
	} else {
		b = append(b, line.remote...)
	}
	return append(b, '\n')
}

func appendJSONLine(b []byte, line *requestLine) []byte {
	b = append(b, `{"time":"`...)
	b = line.time.AppendFormat(b, time.RFC3339Nano)
	b = append(b, `","level":"INFO","msg":"request","method":"`...)
	b = append(b, line.method...)
	b = append(b, `","path":"`...)
	b = append(b, line.path...)
	b = append(b, `","ns":"`...)
	b = append(b, line.ns...)
	b = append(b, `","status":`...)
	b = strconv.AppendInt(b, int64(line.status), 10)
	b = append(b, `,"bytes":`...)
	b = strconv.AppendInt(b, line.bytes, 10)
	b = append(b, `,"duration":`...)
	b = strconv.AppendInt(b, int64(line.duration), 10)
	b = append(b, `,"remote":"`...)
	b = append(b, line.remote...)
	return append(b, "\"}\n"...)
}

// appendRFC3339Millis is slog's text handler's time format: RFC 3339 with
// exactly three digits of milliseconds.
func appendRFC3339Millis(b []byte, t time.Time) []byte {
	// RFC3339Nano trims trailing zeros: a tenth of a millisecond added
	// keeps four digits, and the fourth is dropped.
	const prefixLen = len("2006-01-02T15:04:05.000")
	n := len(b)
	t = t.Truncate(time.Millisecond).Add(time.Millisecond / 10)
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b[:n+prefixLen], b[n+prefixLen+1:]...)
}

// plainValue reports whether s is written unchanged, unquoted, by slog's
// text handler and unescaped inside quotes by its JSON handler: printable
// ASCII but for the quote, the backslash and '=' (an empty string is
// written as "" by both, which the appenders do). Blob and manifest paths,
// namespaces and addresses always are.
func plainValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\\' || c == '=' {
			return false
		}
	}
	return true
}
