//go:build linux

package upstream

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// pathMSS is the segment size of a path with a 1500-byte MTU, less
// timestamps.
const pathMSS = 1448

// listenWithMSS listens on loopback with connections' segments at most mss
// bytes, as on a wide-area path. Loopback's own are 64 KiB, and Linux wakes
// a reader whatever its low-water mark while the receive window it last
// advertised is at most a segment: most of the time, on loopback.
func listenWithMSS(t *testing.T, mss int) net.Listener {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var err error
		if cerr := c.Control(func(fd uintptr) { err = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_MAXSEG, mss) }); cerr != nil {
			return cerr
		}
		return err
	}}
	ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listening with TCP_MAXSEG %d: %v", mss, err)
	}
	return ln
}

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
// not abandoned as a stall. The server's segments are a wide-area path's
// size: on loopback's, the kernel wakes the reader at every piece whatever
// the mark, and the test would show nothing. The trickle's pieces come 24
// times as often as the stall timeout: in a full run of the package under
// the race detector on two cores, the server's own writes were once 528 ms
// apart.
func TestFetchBlobSlowAnswerIsNoStall(t *testing.T) {
	t.Parallel()
	const (
		size    = 448 << 10
		fast    = 256 << 10 // at once
		trickle = 32 << 10  // then these, a piece at a time, then the rest at once
		piece   = 1 << 10
		every   = 50 * time.Millisecond // 20 KB/s: the least mark, 32 KiB, in 1.6 s
		stall   = 1200 * time.Millisecond
	)
	blob := randomBlob(size)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
	srv.Listener.Close()
	srv.Listener = listenWithMSS(t, pathMSS)
	srv.Start()
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
		for _, kind := range []string{"reset", "eof", "stall", "slow", "error"} {
			labels["kind"] = kind
			if n := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", labels); n > 0 {
				t.Errorf("pullproxy_upstream_connection_cuts_total{kind=%q}: got %v, want 0", kind, n)
			}
		}
	}
}

// TestClaimLeavesALaggingReader: a chunk that has written nothing for
// longer than hedgeAfter is not claimed again while its connection still
// brings bytes: read and held (see gather), or delivered by the path and
// waiting unread in the socket for a reader starved of CPU. Once nothing
// moves and nothing waits, it is. The connection that counts is the last
// the chunk's request went out on: after a redirect, the target's.
func TestClaimLeavesALaggingReader(t *testing.T) {
	t.Parallel()
	const mib = 1 << 20
	registry, _ := chunkConnPair(t)
	conn, server := chunkConnPair(t)

	w := newMemBlobWriter(4 * mib)
	if _, err := w.WriteAt(make([]byte, 3*mib), 0); err != nil {
		t.Fatal(err)
	}
	f := &source{blobFetch: &blobFetch{w: w, r: &Registry{fetch: FetchConfig{StallTimeout: 2 * time.Second}}},
		ep: &endpoint{pipe: &pipe{}}, workers: 8, stopped: make(chan struct{})}
	f.sources = []*source{f}
	at := time.Now()
	rest, ok, _ := f.claim(at, chunkPlan{size: mib, room: mib}, 0) // no slot free to share it with
	if !ok || rest.Start != 3*mib || rest.End != 4*mib {
		t.Fatalf("claimed %d-%d (%v), want the last MiB", rest.Start, rest.End, ok)
	}
	f.attach(rest, registry) // answered with a redirect
	f.attach(rest, conn)
	claim := func(what string, want bool) {
		t.Helper()
		at = at.Add(time.Second) // longer than hedgeAfter
		c, ok, _ := f.claim(at, chunkPlan{size: mib, room: mib}, 4)
		if ok != want {
			t.Fatalf("%s: claimed %d-%d (%v), want claimed: %v", what, c.Start, c.End, ok, want)
		}
	}

	if _, err := server.Write(make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); conn.queued() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the bytes written never reached the socket's receive queue")
		}
	}
	claim("bytes waiting unread in the socket", false)

	if _, err := io.ReadFull(conn, make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	claim("bytes read, not written yet", false)
	claim("nothing read, nothing waiting", true)
}

// chunkConnPair returns a chunk connection on loopback, with its socket's
// mark and queue reachable, and the server's end of it.
func chunkConnPair(t *testing.T) (*chunkConn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		s, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- s
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	server, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { server.Close() })
	c := &chunkConn{idleTimeoutConn: idleTimeoutConn{Conn: raw, first: 10 * time.Second, idle: 10 * time.Second}}
	c.sock, _ = raw.(*net.TCPConn).SyscallConn()
	return c, server
}
