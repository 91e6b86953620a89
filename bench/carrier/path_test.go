package carrier

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"testing"
	"testing/synctest"
	"time"
)

// TestWindowSlowStart: the window lets 10 segments through in the first
// round trip and doubles each round trip, up to the ceiling.
func TestWindowSlowStart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const rtt = 40 * time.Millisecond
		w := newWindow(rtt, defaultInitialWindow, 8*defaultInitialWindow)
		ctx := context.Background()
		start := time.Now()
		perRound := map[int]int64{}
		for sent := int64(0); sent < 40*defaultInitialWindow; {
			n, err := w.reserve(ctx, 32<<10)
			if err != nil {
				t.Fatal(err)
			}
			perRound[int(time.Since(start)/rtt)] += int64(n)
			sent += int64(n)
		}
		want := []int64{1, 2, 4, 8, 8, 8} // in initial windows
		for round, k := range want {
			if got := perRound[round]; got != k*defaultInitialWindow {
				t.Errorf("round trip %d: sent %d bytes, want %d", round, got, k*defaultInitialWindow)
			}
		}
	})
}

// TestRoundTrip: through a path with a round-trip time and one set-up round
// trip, an answer's first byte cannot arrive before two round trips, and
// the bytes arrive intact.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	const rtt = 40 * time.Millisecond
	srv := startServerReq(t, 300<<10, 10)
	r := startRelay(t, Config{Target: srv.ln.Addr().String(), RTT: rtt, SetupRTTs: 1})
	start := time.Now()
	c := dial(t, r)
	if _, err := c.Write(make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	first := make([]byte, 1)
	if _, err := io.ReadFull(c, first); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 2*rtt {
		t.Errorf("first byte after %v, before the set-up and the request's round trip (%v)", d, 2*rtt)
	}
	rest, err := readToEnd(c, 10*time.Second)
	if err != io.EOF {
		t.Fatalf("reading: %v", err)
	}
	if got := append(first, rest...); !bytes.Equal(got, srv.data) {
		t.Fatalf("got %d bytes, not what the server sent (%d bytes)", len(got), len(srv.data))
	}
}

// TestSlowStartThroughRelay: 1 MiB through a session in slow start takes at
// least the round trips the window needs to grow (10 segments doubling:
// seven rounds), and the cut still falls at its exact byte count after the
// delay.
func TestSlowStartThroughRelay(t *testing.T) {
	t.Parallel()
	const rtt = 20 * time.Millisecond
	srv := startServer(t, 1<<20)
	r := startRelay(t, Config{Target: srv.ln.Addr().String(), RTT: rtt, SlowStart: true})
	start := time.Now()
	got, err := readToEnd(dial(t, r), 10*time.Second)
	if err != io.EOF || !bytes.Equal(got, srv.data) {
		t.Fatalf("got %d bytes, err %v", len(got), err)
	}
	if d := time.Since(start); d < 6*rtt {
		t.Errorf("1 MiB in %v, faster than slow start allows (%v)", d, 6*rtt)
	}

	for _, mode := range []Mode{Reset, CleanClose, Stall} {
		cut := startRelay(t, Config{Target: srv.ln.Addr().String(), RTT: rtt, SlowStart: true,
			CutProb: 1, CutMin: 100_000, CutMax: 100_000, Mode: mode})
		timeout := 10 * time.Second
		if mode == Stall {
			timeout = time.Second // the stall shows as the deadline
		}
		got, err := readToEnd(dial(t, cut), timeout)
		checkErrKind(t, mode, err)
		if len(got) != 100_000 {
			t.Errorf("%v: cut after %d bytes, want 100000", mode, len(got))
		}
	}
}

// TestHandshakeThroughPath: with HandshakeThrough, the connect itself takes
// the round trip, and the bytes still arrive intact after it; without it,
// the connect is answered at once.
func TestHandshakeThroughPath(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		requireTool(t, "a handshake through the path needs root (a netfilter queue and an iptables rule)")
	}
	if _, err := exec.LookPath("iptables"); err != nil {
		requireTool(t, "iptables not installed (apt-get install iptables)")
	}
	const rtt = 100 * time.Millisecond
	srv := startServerReq(t, 300<<10, 10)
	for _, through := range []bool{false, true} {
		r := startRelay(t, Config{Target: srv.ln.Addr().String(), RTT: rtt, HandshakeThrough: through})
		start := time.Now()
		c := dial(t, r)
		connect := time.Since(start)
		switch {
		case through && connect < rtt:
			t.Errorf("handshake through the path: connect took %v, less than the round trip %v", connect, rtt)
		case through && connect > 900*time.Millisecond: // a SYN lost to the queue is retransmitted after a second
			t.Errorf("handshake through the path: connect took %v, want about %v", connect, rtt)
		case !through && connect >= rtt/2:
			t.Errorf("connect answered by the carrier: took %v, want well under %v", connect, rtt)
		}
		if _, err := c.Write(make([]byte, 10)); err != nil {
			t.Fatal(err)
		}
		got, err := readToEnd(c, 10*time.Second)
		if err != io.EOF {
			t.Fatalf("reading: %v", err)
		}
		if !bytes.Equal(got, srv.data) {
			t.Fatalf("got %d bytes, not the server's %d", len(got), len(srv.data))
		}
		if err := r.Close(); err != nil {
			t.Errorf("closing the relay: %v", err)
		}
	}
}

// requireTool skips a test that needs what this machine lacks, or fails it
// when PULLPROXY_REQUIRE_TOOLS=1 (as in CI), where a skip would hide a gap.
func requireTool(t *testing.T, reason string) {
	t.Helper()
	if os.Getenv("PULLPROXY_REQUIRE_TOOLS") == "1" {
		t.Fatalf("%s, and PULLPROXY_REQUIRE_TOOLS=1", reason)
	}
	t.Skipf("skipping: %s (set PULLPROXY_REQUIRE_TOOLS=1 to make this an error)", reason)
}
