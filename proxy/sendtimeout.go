package proxy

import (
	"io"
	"net/http"
	"os"
	"time"
)

// A client that stops reading a response (a node that hung, a scanner
// that reads one byte and waits) would otherwise hold its connection, its
// goroutine and the blob's file open for as long as it likes: enough of
// them exhaust the process's descriptors, and real pulls fail. A client gets
// the send timeout to take bytes, and is dropped when it takes none: on
// the blob loop's connections, from the last bytes it took (sendBlob); on
// net/http's, which give no sign of progress inside a write, a blob's body
// goes out in pieces of sendPiece, and the timeout runs for each piece. On
// a LAN a piece takes milliseconds; at the default timeout of a minute,
// only a client slower than about 17 KiB/s is dropped there.
const sendPiece = 1 << 20

// timedWriter is a ResponseWriter whose writes the client has timeout to
// take, piece by piece. Copies from a file (or a file's section, as
// http.ServeContent and io.CopyN make them) still go out with sendfile.
type timedWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
}

// timed returns w with the send timeout applied, or w as it is when there
// is none. The caller calls done when the response is written.
func (s *Server) timed(w http.ResponseWriter) (http.ResponseWriter, func()) {
	if s.sendTimeout <= 0 {
		return w, func() {}
	}
	t := &timedWriter{ResponseWriter: w, rc: http.NewResponseController(w), timeout: s.sendTimeout}
	// net/http keeps a deadline set on the connection for the requests
	// after this one (it resets only its own WriteTimeout): clear it.
	return t, func() { t.rc.SetWriteDeadline(time.Time{}) }
}

func (t *timedWriter) arm() { t.rc.SetWriteDeadline(time.Now().Add(t.timeout)) }

func (t *timedWriter) Write(p []byte) (int, error) {
	var n int
	for len(p) > 0 {
		t.arm()
		m, err := t.ResponseWriter.Write(p[:min(len(p), sendPiece)])
		n += m
		if err != nil {
			return n, err
		}
		p = p[m:]
	}
	return n, nil
}

// ReadFrom copies src a piece at a time. A file, whole or limited, is
// handed to the ResponseWriter as a file limited to the piece, which it
// sends with sendfile; anything else is copied through Write.
func (t *timedWriter) ReadFrom(src io.Reader) (int64, error) {
	remain := int64(-1)
	if lr, ok := src.(*io.LimitedReader); ok {
		remain, src = lr.N, lr.R
		defer func() { lr.N = remain }()
	}
	f, ok := src.(*os.File)
	if !ok {
		if remain >= 0 {
			src = io.LimitReader(src, remain)
		}
		return io.Copy(writerOnly{t}, src)
	}
	var sent int64
	for remain != 0 {
		piece := int64(sendPiece)
		if remain > 0 {
			piece = min(piece, remain)
		}
		t.arm()
		n, err := io.Copy(t.ResponseWriter, &io.LimitedReader{R: f, N: piece})
		sent += n
		if remain > 0 {
			remain -= n
		}
		if err != nil {
			return sent, err
		}
		if n < piece {
			break // the file ended
		}
	}
	return sent, nil
}

func (t *timedWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// writerOnly hides ReadFrom, so that io.Copy does not call it again.
type writerOnly struct{ io.Writer }

// pieceDeadline is the write deadline of a piece, or a wait, starting now:
// timeout from now (0: none), and no later than until (zero: no limit).
// Zero: none.
func pieceDeadline(timeout time.Duration, until time.Time) time.Time {
	if timeout <= 0 {
		return until
	}
	d := time.Now().Add(timeout)
	if !until.IsZero() && until.Before(d) {
		return until
	}
	return d
}
