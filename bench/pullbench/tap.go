package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"
)

const tapDialTimeout = 10 * time.Second

// tap is a TCP relay on loopback that ctr pulls through, so that pullbench
// sees when a pull makes its first request. Bytes are relayed unchanged (on
// Linux the kernel splices them) and a reset from the target is passed on to
// the client as a reset. Bytes the tap has not yet sent to the client when
// it passes a reset on are lost, as the reset would lose them anyway.
type tap struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup // accept loop and relays

	mu     sync.Mutex
	first  time.Time             // when the first connection was accepted
	conns  map[net.Conn]struct{} // open connections, both sides
	closed bool
}

// startTap listens on 127.0.0.1 and relays every connection to target.
func startTap(target string) (*tap, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("starting the tap: %w", err)
	}
	t := &tap{ln: ln, target: target, conns: make(map[net.Conn]struct{})}
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

func (t *tap) url() string { return "http://" + t.addr() }

// addr is the host:port the tap listens on.
func (t *tap) addr() string { return t.ln.Addr().String() }

// firstConn returns when the first connection was accepted, if one was.
func (t *tap) firstConn() (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.first, !t.first.IsZero()
}

// close stops listening, closes every connection and waits for the relays.
func (t *tap) close() {
	t.mu.Lock()
	t.closed = true
	t.ln.Close()
	for c := range t.conns {
		c.Close()
	}
	t.mu.Unlock()
	t.wg.Wait()
}

func (t *tap) accept() {
	defer t.wg.Done()
	for {
		c, err := t.ln.Accept()
		if err != nil {
			return // closed
		}
		now := time.Now()
		t.mu.Lock()
		if t.first.IsZero() {
			t.first = now
		}
		t.mu.Unlock()
		if !t.track(c) {
			c.Close()
			return
		}
		t.wg.Add(1)
		go t.relay(c.(*net.TCPConn))
	}
}

// track adds c to the open connections, unless the tap is closed.
func (t *tap) track(c net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	t.conns[c] = struct{}{}
	return true
}

func (t *tap) untrack(c net.Conn) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.conns, c)
}

// relay copies between the client c and a new connection to the target
// until either side ends, then closes both.
func (t *tap) relay(c *net.TCPConn) {
	defer t.wg.Done()
	defer t.untrack(c)
	defer c.Close()
	uc, err := net.DialTimeout("tcp", t.target, tapDialTimeout)
	if err != nil {
		c.SetLinger(0) // the client sees a reset, as if the target had refused it
		return
	}
	u := uc.(*net.TCPConn)
	defer u.Close()
	if !t.track(u) {
		return
	}
	defer t.untrack(u)

	upDone := make(chan struct{})
	go func() {
		defer close(upDone)
		io.Copy(u, c)
		u.Close() // the client is gone or failed: end the download too
	}()
	if _, err := io.Copy(c, u); errors.Is(err, syscall.ECONNRESET) {
		c.SetLinger(0)
	}
	c.Close()
	<-upDone
}
