package upstream

import (
	"errors"
	"math/bits"
	"os"
	"time"
)

// While a chunk connection reads the body of an answer with well over a
// mark's worth still to come, its socket wakes the reader only once the mark
// is queued (SO_RCVLOWAT), not for every segment or two: fewer read calls
// and context switches for the same bytes. The mark is what the answer's
// pace so far brings in half of lowatWait, and at most a quarter of the
// socket's receive buffer, which the kernel grows as the connection's
// window opens (a new connection starts at tcp_rmem's 128 KiB): a mark the
// window could not let in at once would hold the reader until lowatWait for
// nothing, and one above what the buffer holds makes the kernel clamp the
// window to it. Bytes slower than the mark expects are not held long: a
// read that waited lowatWait drops the mark for the rest of the answer, so
// that a slow answer is read as it comes, and only a silent one meets the
// stall timeout. Across a long path, where an answer's bytes come in bursts
// a round trip apart, that is what mostly happens: there the mark saves
// little, and costs a timer.
//
// The mark is set on the socket under TLS too: the ciphertext is longer
// than the body, so counting it against the body's length errs early.
const (
	lowatMin = 32 << 10
	lowatMax = 256 << 10
	// lowatMargin: body bytes the HTTP and TLS readers above the socket
	// may have taken ahead of what they returned, so that the mark never
	// waits for bytes the answer does not hold: net/http's 4 KiB bufio
	// buffer, and crypto/tls's input buffer, which it fills to its whole
	// free capacity (bytes.Buffer.ReadFrom) and which grows by doubling
	// to about four records.
	lowatMargin = 96 << 10
	lowatWait   = 50 * time.Millisecond
)

// expect says that the answer being read on c has n body bytes left to
// come: 0 when it has none, or none that matter. Called by the chunk's
// fetcher, between reads.
func (c *chunkConn) expect(n int64) {
	c.left.Store(n)
	c.expected.Store(n)
	c.began.Store(time.Now().UnixNano())
	c.slow.Store(false)
	if n < lowatMin+lowatMargin {
		c.setLowat(0)
	}
}

// paceMark returns the largest mark the answer's pace so far would queue in
// half of lowatWait, rounded down to a power of two, or 0 below lowatMin:
// a connection still in slow start, at its first round trips' few segments
// each, gets none.
func (c *chunkConn) paceMark(now time.Time) int {
	took := now.UnixNano() - c.began.Load()
	if took <= 0 {
		return 0
	}
	pace := float64(c.expected.Load()-c.left.Load()) / float64(took) // bytes per nanosecond
	return markSize(int(pace * float64(lowatWait/2)))
}

// markSize rounds n down to a power of two within [lowatMin, lowatMax], or
// to 0 below lowatMin.
func markSize(n int) int {
	switch {
	case n < lowatMin:
		return 0
	case n >= lowatMax:
		return lowatMax
	default:
		return 1 << (bits.Len(uint(n)) - 1)
	}
}

// mark returns the mark c's socket allows: a quarter of its receive buffer,
// rounded down to a power of two within [lowatMin, lowatMax], or 0 below.
// The buffer is looked at again after each lowatMax bytes read, until the
// mark is lowatMax.
func (c *chunkConn) mark() int {
	m := int(c.markSize.Load())
	read := c.read.Load()
	if m == lowatMax || read < c.markNext.Load() {
		return m
	}
	c.markNext.Store(read + lowatMax)
	m = markSize(rcvBuf(c.sock) / 4)
	c.markSize.Store(int32(m))
	return m
}

// setLowat sets the socket's low-water mark to n bytes (0: none) unless it
// is set so already.
func (c *chunkConn) setLowat(n int) {
	if c.sock == nil || int(c.lowat.Load()) == n {
		return
	}
	if err := setRcvLowat(c.sock, max(n, 1)); err != nil {
		return // left as it was: reads still work, only wake more often
	}
	c.lowat.Store(int32(n))
}

// readMarked reads from c with the socket's low-water mark set while the
// answer has enough left, for at most lowatWait. It keeps idleTimeoutConn's
// deadlines.
func (c *chunkConn) readMarked(p []byte) (int, error) {
	now := time.Now()
	m := 0
	if !c.slow.Load() {
		m = min(c.mark(), c.paceMark(now))
	}
	if m == 0 || c.left.Load() < int64(m+lowatMargin) {
		c.setLowat(0)
		return c.idleTimeoutConn.Read(p)
	}
	c.setLowat(m)
	wait := c.idle
	if !c.answered.Load() {
		wait = c.first
	}
	deadline := now.Add(wait)
	for {
		next := deadline
		if soon := now.Add(lowatWait); c.lowat.Load() > 0 && soon.Before(deadline) {
			next = soon
		}
		if err := c.Conn.SetReadDeadline(next); err != nil {
			return 0, err
		}
		n, err := c.recv(p)
		if n > 0 {
			c.answered.Store(true)
		}
		if n > 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
			return n, err
		}
		if now = time.Now(); !now.Before(deadline) {
			return n, err
		}
		// Fewer bytes than the mark came in lowatWait, or none: the rest of
		// the answer is read as it comes, and only silence meets the
		// deadline.
		c.slow.Store(true)
		c.setLowat(0)
	}
}
