//go:build linux

package upstream

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// rcvLowat reads the socket's SO_RCVLOWAT.
func rcvLowat(t *testing.T, c *chunkConn) int {
	t.Helper()
	var v int
	var err error
	c.sock.Control(func(fd uintptr) { v, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT) })
	if err != nil {
		t.Fatalf("getsockopt SO_RCVLOWAT: %v", err)
	}
	return v
}

// TestChunkConnLowat: a chunk connection reading an answer as fast as
// loopback brings it sets the socket's low-water mark, on a new connection
// or one that carried 4 MiB before, only while more than the mark and its
// margin is left, so that no read waits for bytes the answer does not hold,
// and drops it by the answer's end. The server keeps the connection open
// after the answer, as a kept-alive one.
func TestChunkConnLowat(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		before int // bytes the connection carried before the answer
		size   int
		marked bool // the mark is set at some read
	}{
		{"short: no mark", 4 << 20, lowatMin + lowatMargin - 1, false},
		{"512 KiB", 4 << 20, 512 << 10, true},
		{"4 MiB and a bit", 4 << 20, 4<<20 + 12345, true},
		{"a new connection", 0, 512 << 10, true},
		{"a new connection, 4 MiB", 0, 4 << 20, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ln.Close() })
			hold := make(chan struct{})
			t.Cleanup(func() { close(hold) })
			go func() {
				s, err := ln.Accept()
				if err != nil {
					return
				}
				defer s.Close()
				s.Write(randomBlob(tt.before + tt.size))
				<-hold // open, as a kept-alive connection after its answer
			}()
			raw, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { raw.Close() })
			c := &chunkConn{idleTimeoutConn: idleTimeoutConn{Conn: raw, first: 10 * time.Second, idle: 10 * time.Second}}
			c.sock, _ = raw.(*net.TCPConn).SyscallConn()
			c.answered.Store(true)
			buf := make([]byte, 16<<10)
			if _, err := io.ReadFull(c, make([]byte, tt.before)); err != nil {
				t.Fatalf("reading the bytes before the answer: %v", err)
			}
			c.expect(int64(tt.size))
			highest := 0 // the highest mark seen after a read
			for total := 0; total < tt.size; {
				left := c.left.Load()
				n, err := c.Read(buf)
				total += n
				if err != nil {
					t.Fatalf("after %d of %d bytes: %v", total, tt.size, err)
				}
				// A mark the answer's rest, less what the readers above
				// the socket may hold, could not fill would wait for
				// bytes that never come.
				m := rcvLowat(t, c)
				if m > 1 && int64(m+lowatMargin) > left {
					t.Fatalf("SO_RCVLOWAT %d for a read with %d bytes left: want at most the rest less %d", m, left, lowatMargin)
				}
				highest = max(highest, m)
			}
			switch {
			case tt.marked && highest < lowatMin:
				t.Errorf("SO_RCVLOWAT: never set (receive buffer %d bytes; a mark needs %d, net.ipv4.tcp_rmem)",
					rcvBuf(c.sock), 4*lowatMin)
			case !tt.marked && highest != 1:
				t.Errorf("SO_RCVLOWAT: set to %d, want never set", highest)
			}
			if got := rcvLowat(t, c); got != 1 {
				t.Errorf("SO_RCVLOWAT at the answer's end: got %d, want 1 (none)", got)
			}
		})
	}
}

// TestFetchBlobSlowAnswerIsNoStall: an answer that comes fast at first,
// so that its connection gets a low-water mark, then trickles in slower
// than would fill the mark within the stall timeout, is read as it comes,
// not abandoned as a stall. The trickle's pieces come eight times as often
// as the stall timeout, so that a test run starved of CPU for a while does
// not see one (with pieces three times as often, one full run in a few
// counted a stall).
func TestFetchBlobSlowAnswerIsNoStall(t *testing.T) {
	t.Parallel()
	const (
		size    = 448 << 10
		fast    = 256 << 10 // at once
		trickle = 64 << 10  // then these, a piece at a time, then the rest at once
		piece   = 2 << 10
		every   = 50 * time.Millisecond // 40 KB/s: the least mark, 32 KiB, in 800 ms
		stall   = 400 * time.Millisecond
	)
	blob := randomBlob(size)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start, end, ok := startRange(w, r, size)
		if !ok {
			return
		}
		w.WriteHeader(http.StatusPartialContent)
		for off := start; off < end; {
			n := int64(piece)
			switch {
			case off < fast:
				n = fast - off
			case off >= fast+trickle:
				n = end - off
			}
			if _, err := w.Write(blob[off:min(off+n, end)]); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			off += n
			time.Sleep(every)
		}
	}))
	t.Cleanup(srv.Close)
	m, reg := newTestMetrics(t)
	cfg := fixedBudget(size, 1)
	cfg.StallTimeout = stall
	r := newFetchRegistry(t, cfg, []string{srv.URL}, WithMetrics(m))
	w := newMemBlobWriter(-1)
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)
	labels := map[string]string{"upstream": testUpstream, "endpoint": host(srv)}
	if got := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", labels); got != 0 {
		t.Errorf("pullproxy_upstream_connection_cuts_total: got %v, want 0", got)
	}
}
