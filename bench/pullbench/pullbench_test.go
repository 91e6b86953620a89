package main

import (
	"errors"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
)

// serveOnce accepts one connection on a new listener and hands it to fn.
func serveOnce(t *testing.T, fn func(c *net.TCPConn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		fn(c.(*net.TCPConn))
	}()
	return ln.Addr().String()
}

func TestTapRelaysAndTimesFirstConnection(t *testing.T) {
	target := serveOnce(t, func(c *net.TCPConn) {
		defer c.Close()
		buf := make([]byte, 4)
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		c.Write([]byte("pong:" + string(buf)))
	})
	tp, err := startTap(target)
	if err != nil {
		t.Fatal(err)
	}
	defer tp.close()
	if _, ok := tp.firstConn(); ok {
		t.Fatal("firstConn reports a connection before any")
	}
	before := time.Now()
	c, err := net.Dial("tcp", strings.TrimPrefix(tp.url(), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("ping"))
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "pong:ping" {
		t.Fatalf("read %q, %v; want %q", got, err, "pong:ping")
	}
	first, ok := tp.firstConn()
	if !ok || first.Before(before) || first.After(time.Now()) {
		t.Fatalf("firstConn = %v, %v; want between %v and now", first, ok, before)
	}
}

func TestTapPassesResetsOn(t *testing.T) {
	target := serveOnce(t, func(c *net.TCPConn) {
		c.Write([]byte("partial"))
		time.Sleep(50 * time.Millisecond)
		c.SetLinger(0)
		c.Close()
	})
	tp, err := startTap(target)
	if err != nil {
		t.Fatal(err)
	}
	defer tp.close()
	c, err := net.Dial("tcp", strings.TrimPrefix(tp.url(), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = io.ReadAll(c)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read error %v; want a reset", err)
	}
}

func TestCtrMessage(t *testing.T) {
	out := []byte("time=\"...\" level=debug msg=fetch\nctr: failed to copy: read tcp a->b: read: connection reset by peer\n")
	if got, want := ctrMessage(out, errors.New("exit status 1")), "failed to copy: read tcp a->b: read: connection reset by peer"; got != want {
		t.Errorf("ctrMessage = %q, want %q", got, want)
	}
	if got := ctrMessage(nil, errors.New("signal: killed\nmore")); got != "signal: killed" {
		t.Errorf("ctrMessage without ctr's line = %q", got)
	}
}

func TestSeriesDescribe(t *testing.T) {
	s := &series{MaxAttempts: 3, Attempts: []attempt{
		{Seconds: 0.412, Outcome: "failed to copy: read tcp a->b: read: connection reset by peer"},
		{Seconds: 0.2, Outcome: "failed to copy: read tcp c->d: read: connection reset by peer"},
		{Seconds: 0.3, Outcome: "failed to copy: unexpected EOF"},
	}}
	if got, want := s.verdict(), "did not finish in 3 attempts"; got != want {
		t.Errorf("verdict = %q, want %q", got, want)
	}
	want := "they took 0.41, 0.20, 0.30 s; 2 ended with: connection reset by peer; 1 ended with: unexpected EOF"
	if got := s.describe(); !strings.HasSuffix(got, want) {
		t.Errorf("describe = %q, want it to end with %q", got, want)
	}
}

func TestSummarise(t *testing.T) {
	got := summarise([]sample{{seconds: 3}, {seconds: 1}, {seconds: 2}}, func(s sample) float64 { return s.seconds })
	if got.Median != 2 || got.Worst != 3 || len(got.Runs) != 3 || got.Runs[0] != 3 {
		t.Errorf("summarise = %+v, want runs in order, median 2, worst 3", got)
	}
}

// TestMatrixPaths: every path of the matrix makes a valid carrier, names
// itself once, and turns bad only with cuts to turn bad with.
func TestMatrixPaths(t *testing.T) {
	names := map[string]bool{}
	for _, p := range matrixPaths() {
		if names[p.Name] {
			t.Errorf("path %q: named twice", p.Name)
		}
		names[p.Name] = true
		if _, ok := modes[p.Mode]; !ok {
			t.Errorf("path %q: mode %q, want one of reset, close, stall", p.Name, p.Mode)
		}
		if p.CutProb <= 0 || p.CutMin <= 0 || p.CutMax < p.CutMin {
			t.Errorf("path %q: cuts %v of sessions at %d–%d bytes, want some", p.Name, p.CutProb, p.CutMin, p.CutMax)
		}
		r, err := carrier.Start(carrier.Config{Target: "127.0.0.1:1", Mode: modes[p.Mode], CutProb: p.CutProb,
			CutMin: p.CutMin, CutMax: p.CutMax, RTT: time.Duration(p.RTTms) * time.Millisecond,
			Jitter: time.Duration(p.JitterMs) * time.Millisecond, SlowStart: true})
		if err != nil {
			t.Errorf("path %q: %v", p.Name, err)
			continue
		}
		r.Close()
	}
}
