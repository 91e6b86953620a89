// Package carrier simulates a degraded network path (a "carrier") as a TCP
// relay on loopback, for tests and benchmarks of the registry mirror.
//
// The carrier being modelled kills some TCP sessions once they have carried a
// certain number of bytes. A Relay listens on 127.0.0.1 and forwards every
// accepted connection to Config.Target. When a connection is accepted, the
// relay decides (from a seeded random source) whether the session is doomed
// and, if so, after how many bytes it dies:
//
//   - the byte count is taken in the target→client direction ("down"), which
//     is where layer data flows, as the client receives them; bytes sent by
//     the client are never counted;
//   - exactly that many bytes are forwarded to the client, then the session
//     is killed as Config.Mode says (Reset, CleanClose or Stall).
//
// A session that ends on its own before reaching its cut is not killed and is
// not counted in Stats.Cut.
//
// Down traffic of all sessions together can be capped with Config.Bandwidth,
// a token bucket shared by all sessions: bytes are forwarded in writes of at
// most 32 KiB, each waiting for its tokens in turn, so concurrent sessions
// interleave in small slices; the bucket holds max(64 KiB, 4 ms worth of
// Bandwidth), which absorbs Go's ~1 ms timer granularity.
//
// A wide-area path is modelled with Config.RTT: each direction is delayed by
// half of it (a delay line per direction, which keeps the byte stream's
// timing), Config.SetupRTTs round trips pass before the first byte of a new
// session moves (TCP's handshake; a TLS handshake between the ends is real
// and costs its own round trips through the delay), and with
// Config.SlowStart the target→client direction may have at most a
// congestion window of bytes unacknowledged, where a byte counts as
// acknowledged one RTT after it was sent and each acknowledged byte grows the
// window by one (TCP slow start: the window doubles each round trip), from
// InitialWindow up to MaxWindow. Cuts count bytes as the client receives
// them, after the delay.
//
// Bytes are counted twice: where the client receives them (Stats.BytesDown)
// and where they leave the target (Stats.BytesEgress), as a carrier's bill
// counts them. The two differ by what was in flight when a session ended:
// bytes on the delay line, and bytes the target sent that the relay had not
// read yet, which a client closing a connection early (a hedge that lost,
// a request given up) never receives but the target sent all the same.
//
// Closing: when either direction of a session ends (EOF or error on one side)
// both sides are closed; half-closes are not propagated.
//
// Exactness of Reset: an RST makes the kernel discard data that is still in
// the relay's send buffer, so before resetting, the relay waits until the
// client's kernel has acknowledged every forwarded byte (Linux: ioctl
// SIOCOUTQ). A client that stops reading therefore holds its doomed session
// open until it reads, closes, or the relay is closed. On other systems the
// wait is skipped and a Reset client may see fewer bytes than the cut.
package carrier

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Mode is how a doomed session dies.
type Mode int

const (
	// Reset closes the client-facing socket with SO_LINGER 0, so the client
	// receives an RST (a Go reader sees an error matching
	// syscall.ECONNRESET), and closes the upstream socket.
	Reset Mode = iota
	// CleanClose closes both sides normally (FIN) mid-transfer: a reader
	// sees io.EOF, an HTTP body with a Content-Length io.ErrUnexpectedEOF.
	CleanClose
	// Stall makes the path go dark: nothing more is forwarded in either
	// direction (client data is read and discarded, upstream is no longer
	// read), both sockets stay open until the client closes its side or the
	// relay is closed. A reader sees no error until its deadline fires.
	Stall
)

// String returns the name of the mode.
func (m Mode) String() string {
	switch m {
	case Reset:
		return "Reset"
	case CleanClose:
		return "CleanClose"
	case Stall:
		return "Stall"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Config describes the simulated path.
type Config struct {
	// Target is the host:port every session is forwarded to.
	Target string
	// CutProb is the probability (0..1) that a new session is doomed.
	CutProb float64
	// A doomed session dies after a number of bytes drawn uniformly from
	// [CutMin, CutMax] (both inclusive), counted in the target→client
	// direction only. 0 <= CutMin <= CutMax; a cut of 0 kills the session
	// before any byte is forwarded.
	CutMin, CutMax int64
	// Mode is how doomed sessions die.
	Mode Mode
	// Bandwidth caps the target→client bytes per second of all sessions
	// together; 0 means unlimited. The client→target direction is never
	// limited.
	Bandwidth int64
	// RTT is the path's round-trip time: each direction is delayed by half
	// of it. 0: no delay.
	RTT time.Duration
	// Jitter spreads RTT across sessions: each session's round-trip time is
	// drawn uniformly from [RTT-Jitter, RTT+Jitter] (not below 0), as
	// connections of one path take different routes through a carrier.
	Jitter time.Duration
	// SetupRTTs is how many round trips a new session waits before any of
	// its bytes move, for the handshakes the relay does not see: 1 for TCP's
	// (a TLS handshake spoken through the relay pays its own). Needs RTT.
	// The client's connect returns at once: the carrier answers it, and the
	// delay comes after, as equipment that terminates TCP does.
	SetupRTTs int
	// HandshakeThrough makes the TCP handshake itself cross the path: each
	// SYN to the relay is held for RTT before the relay's kernel sees it, so
	// a client's connect takes a round trip, as when nothing on the path
	// terminates TCP (SetupRTTs is then usually 0). Linux only; needs root
	// and iptables (a NFQUEUE rule on the relay's port, removed by Close).
	// Jitter does not apply to the SYN's hold.
	HandshakeThrough bool
	// SlowStart limits each session's unacknowledged target→client bytes to
	// a congestion window that starts at InitialWindow (default 10 segments
	// of 1448 bytes, as Linux) and doubles each round trip up to MaxWindow
	// (default 6 MiB, Linux's largest autotuned receive window). Needs RTT.
	SlowStart                bool
	InitialWindow, MaxWindow int64
	// Seed seeds the random source (math/rand/v2 PCG). Each accepted
	// session consumes the same amount of randomness whatever the config,
	// so relays with the same seed make the same decisions for their n-th
	// accepted session, given the same CutProb/CutMin/CutMax.
	Seed uint64
}

func (c Config) validate() error {
	if c.Target == "" {
		return errors.New("carrier: empty Target")
	}
	if !(c.CutProb >= 0 && c.CutProb <= 1) {
		return fmt.Errorf("carrier: CutProb %v not in [0, 1]", c.CutProb)
	}
	if c.CutMin < 0 || c.CutMax < c.CutMin {
		return fmt.Errorf("carrier: need 0 <= CutMin <= CutMax, have CutMin=%d CutMax=%d", c.CutMin, c.CutMax)
	}
	switch c.Mode {
	case Reset, CleanClose, Stall:
	default:
		return fmt.Errorf("carrier: unknown mode %v", c.Mode)
	}
	if c.Bandwidth < 0 {
		return fmt.Errorf("carrier: negative Bandwidth %d", c.Bandwidth)
	}
	if c.RTT < 0 || c.Jitter < 0 || c.SetupRTTs < 0 || c.InitialWindow < 0 || c.MaxWindow < 0 {
		return errors.New("carrier: negative RTT, Jitter, SetupRTTs or window")
	}
	if iw, mw := c.windows(); c.SlowStart && mw < iw {
		return fmt.Errorf("carrier: MaxWindow %d below InitialWindow %d", mw, iw)
	}
	return nil
}

const (
	defaultInitialWindow = 10 * 1448
	defaultMaxWindow     = 6 << 20
)

// windows returns the slow-start windows, defaults applied.
func (c Config) windows() (initial, ceiling int64) {
	initial, ceiling = c.InitialWindow, c.MaxWindow
	if initial == 0 {
		initial = defaultInitialWindow
	}
	if ceiling == 0 {
		ceiling = max(defaultMaxWindow, initial)
	}
	return initial, ceiling
}

// Stats are the relay's counters since Start.
type Stats struct {
	Sessions  int64 // connections accepted
	PeakOpen  int64 // the most sessions open at once
	Cut       int64 // sessions killed by the relay (they reached their cut)
	BytesDown int64 // target→client bytes forwarded, as the client received them
	// BytesEgress is the target→client bytes that left the target: read by
	// the relay, delivered or not, and, at a session's end, those waiting
	// unread in the relay's socket (on Linux; up to one read more may be
	// counted for a session closed while the relay read).
	BytesEgress int64
	BytesUp     int64 // client→target bytes forwarded
	// FirstDown is when the first target→client byte was forwarded, and
	// LastData when the last write of at least dataWrite bytes was: where
	// the last response body ended, as handshakes and headers are smaller
	// (zero: none yet).
	FirstDown, LastData time.Time
	// Unused is how long the bandwidth cap went unused between FirstDown and
	// LastData: the bytes it would have let through that no session was
	// there to send, as time at the cap. Gaps shorter than the bucket's
	// depth (burstTime) are not counted: the bucket absorbs them. Zero
	// without a cap.
	Unused time.Duration
}

const (
	bufSize  = 32 << 10 // copy buffer per direction per session; max bytes per limiter wait
	minBurst = 64 << 10 // token bucket depth, at least
	minChunk = 1 << 10  // smallest read size under a low bandwidth cap
	// dataWrite is the least a write must carry to count as body data in
	// Stats.LastData: more than a TLS handshake's flight or a response's
	// headers.
	dataWrite = 8 << 10
)

// Relay is a running simulated carrier. Its methods are safe for concurrent
// use.
type Relay struct {
	ln     net.Listener
	target string          // cfg.Target, which never changes
	syns   *synDelay       // with cfg.HandshakeThrough
	ctx    context.Context // canceled by Close
	cancel context.CancelFunc
	lim    limiter
	wg     sync.WaitGroup // accept loop and session goroutines
	pool   sync.Pool      // *[]byte of bufSize for the delay lines

	mu       sync.Mutex
	cfg      Config
	rng      *rand.Rand
	jitter   *rand.Rand // sessions' round trips: a stream of its own, so that Jitter leaves the cuts' draws as they were
	sessions map[*session]struct{}
	closed   bool

	nSessions, nCut, bytesDown, bytesUp atomic.Int64
	bytesEgress                         atomic.Int64
	open, peakOpen                      atomic.Int64
	firstDown, lastData                 atomic.Int64 // UnixNano; 0: none yet
	unusedAtFirst, unusedAtLast         atomic.Int64 // the limiter's unused bytes then
}

// Start validates cfg, listens on 127.0.0.1 on a free port and starts
// relaying. The target is dialled for each accepted connection, not here.
func Start(cfg Config) (*Relay, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("carrier: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Relay{
		ln:       ln,
		target:   cfg.Target,
		ctx:      ctx,
		cancel:   cancel,
		cfg:      cfg,
		rng:      rand.New(rand.NewPCG(cfg.Seed, 0x9e3779b97f4a7c15)),
		jitter:   rand.New(rand.NewPCG(cfg.Seed, 0x6a09e667f3bcc908)),
		sessions: make(map[*session]struct{}),
	}
	r.lim.init(cfg.Bandwidth)
	r.pool.New = func() any { b := make([]byte, bufSize); return &b }
	if cfg.HandshakeThrough {
		r.syns, err = startSynDelay(ln.Addr().(*net.TCPAddr).Port, func() time.Duration { return r.Config().RTT })
		if err != nil {
			ln.Close()
			cancel()
			return nil, err
		}
	}
	r.wg.Add(1)
	go r.acceptLoop()
	return r, nil
}

// Addr returns the host:port the relay listens on.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

// URL returns "http://" + Addr().
func (r *Relay) URL() string { return "http://" + r.Addr() }

// Config returns the current configuration.
func (r *Relay) Config() Config {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cfg
}

// SetConfig changes the configuration at run time, typically
// cfg := r.Config(); cfg.CutProb = 0; r.SetConfig(cfg) to make the path
// clean. CutProb, CutMin, CutMax and Mode apply to sessions accepted
// afterwards (sessions already accepted keep their fate); Bandwidth applies
// at once to all sessions, RTT to SYNs held afterwards. Target, Seed and
// HandshakeThrough cannot change.
func (r *Relay) SetConfig(cfg Config) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if cfg.Target != r.target || cfg.Seed != r.cfg.Seed || cfg.HandshakeThrough != r.cfg.HandshakeThrough {
		return errors.New("carrier: SetConfig cannot change Target, Seed or HandshakeThrough")
	}
	r.cfg = cfg
	r.lim.setRate(cfg.Bandwidth)
	return nil
}

// Stats returns a snapshot of the counters. After Close returns they are
// final.
func (r *Relay) Stats() Stats {
	return Stats{
		Sessions:    r.nSessions.Load(),
		PeakOpen:    r.peakOpen.Load(),
		Cut:         r.nCut.Load(),
		BytesDown:   r.bytesDown.Load(),
		BytesEgress: r.bytesEgress.Load(),
		BytesUp:     r.bytesUp.Load(),
		FirstDown:   unixNano(r.firstDown.Load()),
		LastData:    unixNano(r.lastData.Load()),
		Unused:      r.lim.asTime(r.unusedAtLast.Load() - r.unusedAtFirst.Load()),
	}
}

func unixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// Close stops listening, closes every session (stalled ones included, with a
// normal close) and waits for all the relay's goroutines to exit. Calling it
// again returns nil.
func (r *Relay) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	err := r.ln.Close()
	r.cancel()
	for s := range r.sessions {
		s.close(false)
	}
	r.mu.Unlock()
	r.wg.Wait()
	if r.syns != nil {
		err = errors.Join(err, r.syns.close())
	}
	return err
}

func (r *Relay) acceptLoop() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			if r.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Transient (e.g. EMFILE): back off briefly.
			select {
			case <-r.ctx.Done():
				return
			case <-time.After(5 * time.Millisecond):
			}
			continue
		}
		r.nSessions.Add(1)
		for n := r.open.Add(1); ; {
			peak := r.peakOpen.Load()
			if n <= peak || r.peakOpen.CompareAndSwap(peak, n) {
				break
			}
		}
		r.mu.Lock()
		// Always draw the same amount of randomness per session so that the
		// sequence does not depend on the configuration.
		f, v, j := r.rng.Float64(), r.rng.Uint64(), r.jitter.Float64()
		cfg := r.cfg
		if r.closed {
			r.mu.Unlock()
			r.open.Add(-1)
			c.Close()
			return
		}
		s := &session{r: r, c: c.(*net.TCPConn), cut: -1, mode: cfg.Mode, path: cfg}
		if cfg.Jitter > 0 {
			s.path.RTT = max(0, cfg.RTT+time.Duration((2*j-1)*float64(cfg.Jitter)))
		}
		if f < cfg.CutProb {
			// Modulo bias is below 2^-40 for any realistic range.
			s.cut = cfg.CutMin + int64(v%(uint64(cfg.CutMax-cfg.CutMin)+1))
		}
		s.ctx, s.cancel = context.WithCancel(r.ctx)
		r.sessions[s] = struct{}{}
		r.wg.Add(1)
		r.mu.Unlock()
		go s.serve()
	}
}

// session is one relayed connection.
type session struct {
	r      *Relay
	c      *net.TCPConn // client side
	cut    int64        // bytes down before the kill; -1 if not doomed
	mode   Mode
	path   Config          // RTT, set-up and slow start, as when the session was accepted
	ctx    context.Context // canceled when the session closes
	cancel context.CancelFunc
	dead   atomic.Bool // cut reached: client data is discarded from now on

	mu      sync.Mutex
	u       *net.TCPConn // upstream side; nil until dialled
	uClosed bool         // u is closed
	closed  bool
}

// close closes both sides once; rst sends an RST to the client.
func (s *session) close(rst bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	s.cancel()
	if rst {
		s.c.SetLinger(0)
	}
	s.c.Close()
	s.closeTargetLocked()
}

// closeTargetLocked closes the target side, once, counting as egress the
// bytes the target sent that wait unread in the socket: they left it, and
// a bill counts them. s.mu must be held.
func (s *session) closeTargetLocked() {
	if s.u == nil || s.uClosed {
		return
	}
	s.uClosed = true
	if n, err := unreadBytes(s.u); err == nil {
		s.r.bytesEgress.Add(int64(n))
	}
	s.u.Close()
}

func (s *session) serve() {
	r := s.r
	defer func() {
		s.close(false)
		r.mu.Lock()
		delete(r.sessions, s)
		r.mu.Unlock()
		r.open.Add(-1)
		r.wg.Done()
	}()
	if s.path.RTT > 0 && s.path.SetupRTTs > 0 {
		t := time.NewTimer(time.Duration(s.path.SetupRTTs) * s.path.RTT)
		select {
		case <-t.C:
		case <-s.ctx.Done():
			t.Stop()
			return
		}
	}
	d := net.Dialer{Timeout: 10 * time.Second}
	uc, err := d.DialContext(s.ctx, "tcp", r.target)
	if err != nil {
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		uc.Close()
		return
	}
	s.u = uc.(*net.TCPConn)
	s.mu.Unlock()

	upDone := make(chan struct{})
	go func() {
		defer close(upDone)
		s.up()
	}()
	s.down()
	<-upDone
}

// up copies client→target, half a round trip late, until the client side
// fails; after the cut it only reads (to notice the client closing) and
// discards.
func (s *session) up() {
	forward := func(p []byte) error {
		if s.dead.Load() {
			return nil
		}
		w, err := s.u.Write(p)
		s.r.bytesUp.Add(int64(w))
		if err != nil && !s.dead.Load() {
			return err
		}
		return nil
	}
	var line *delayLine
	if s.path.RTT > 0 {
		line = newDelayLine(s.ctx, &s.r.pool, s.path.RTT/2, forward, func(bool) { s.close(false) })
		forward = line.send
	}
	buf := make([]byte, bufSize)
	for {
		n, err := s.c.Read(buf)
		if n > 0 && forward(buf[:n]) != nil {
			break
		}
		if err != nil {
			break
		}
	}
	if line != nil {
		line.close() // what the client sent before it closed still arrives
	}
	s.close(false)
}

// down copies target→client, rate limited (and window limited in slow
// start), half a round trip late, up to the cut, then kills the session. It
// closes the session when it returns, except on a stall.
func (s *session) down() {
	r := s.r
	remaining := s.cut
	if remaining == 0 {
		s.kill()
		return
	}
	var win *window
	if s.path.SlowStart && s.path.RTT > 0 {
		initial, ceiling := s.path.windows()
		win = newWindow(s.path.RTT, initial, ceiling)
	}
	deliver := func(p []byte) error {
		w, err := s.c.Write(p)
		if w > 0 {
			r.bytesDown.Add(int64(w))
			now := time.Now().UnixNano()
			if r.firstDown.CompareAndSwap(0, now) {
				r.unusedAtFirst.Store(r.lim.unusedBytes())
			}
			if w >= dataWrite {
				r.lastData.Store(now)
				r.unusedAtLast.Store(r.lim.unusedBytes())
			}
		}
		return err
	}
	// end runs once everything read is delivered: the cut, or the target's end.
	end := func(failed bool) {
		switch {
		case failed:
			s.close(false)
		case remaining == 0:
			s.kill()
		default:
			s.c.CloseWrite() // the target finished (or failed): pass the end on after the data
			s.close(false)
		}
	}
	var line *delayLine
	if s.path.RTT > 0 {
		line = newDelayLine(s.ctx, &r.pool, s.path.RTT/2, deliver, end)
		defer line.close() // its end runs end once the bytes read are delivered
	}
	buf := make([]byte, bufSize)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		p := buf[:r.lim.chunk(len(buf))]
		if remaining >= 0 && remaining < int64(len(p)) {
			p = p[:remaining]
		}
		n, rerr := s.u.Read(p)
		r.bytesEgress.Add(int64(n))
		for sent := 0; sent < n; {
			k := n - sent
			if win != nil {
				var err error
				if k, err = win.reserve(s.ctx, k); err != nil {
					s.close(false)
					return
				}
			}
			if err := r.lim.wait(s.ctx, timer, k); err != nil {
				s.close(false)
				return
			}
			q := p[sent : sent+k]
			sent += k
			if line != nil {
				if line.send(q) != nil {
					return
				}
				continue
			}
			if deliver(q) != nil {
				s.close(false)
				return
			}
		}
		if remaining >= 0 {
			remaining -= int64(n)
		}
		if remaining == 0 || rerr != nil {
			if line == nil {
				end(false)
			}
			return
		}
	}
}

// kill ends a session that reached its cut, according to its mode.
func (s *session) kill() {
	s.dead.Store(true)
	s.r.nCut.Add(1)
	switch s.mode {
	case Stall:
		// Keep both sockets open; up keeps reading and discarding until the
		// client or the relay closes the session.
		return
	case CleanClose:
		s.mu.Lock()
		s.closeTargetLocked()
		s.mu.Unlock()
		s.c.CloseWrite() // FIN after the data already written
		// Close only once the FIN is acknowledged: closing a socket with
		// unread data would turn the FIN into an RST.
		waitDrained(s.ctx, s.c)
		s.close(false)
	case Reset:
		s.mu.Lock()
		s.closeTargetLocked()
		s.mu.Unlock()
		// An RST discards unsent data: let the client receive all of it.
		waitDrained(s.ctx, s.c)
		s.close(true)
	}
}

// waitDrained waits until every byte written to c has been acknowledged by
// the peer, or ctx is done. Where this cannot be known, it returns at once.
func waitDrained(ctx context.Context, c *net.TCPConn) {
	delay := 20 * time.Microsecond
	var t *time.Timer
	for {
		n, err := unackedBytes(c)
		if err != nil || n == 0 {
			break
		}
		if t == nil {
			t = time.NewTimer(delay)
		} else {
			t.Reset(delay)
		}
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		delay = min(2*delay, 2*time.Millisecond)
	}
	if t != nil {
		t.Stop()
	}
}

// limiter is a token bucket shared by all sessions of a relay. Tokens may
// go negative: a waiter reserves its bytes at once and sleeps off the debt,
// so waiters are served in the order they asked, in chunks of at most
// bufSize bytes.
type limiter struct {
	mu     sync.Mutex
	rate   float64 // bytes per second; 0 = unlimited
	burst  float64 // bucket depth in bytes
	tokens float64
	last   time.Time
	unused float64 // bytes the bucket overflowed with: the cap's capacity no one used
}

func (l *limiter) init(bps int64) {
	l.setRateLocked(bps)
	l.tokens = l.burst
	l.last = time.Now()
}

// burstTime is the minimum bucket depth in time. Go timers are only about
// 1 ms accurate (a 0.5 ms sleep takes about 1.1 ms, a 1.5 ms one 2.2 ms);
// with a shallower bucket the oversleep overflows it and is lost, which made
// a 64 MB/s cap deliver 5% less with a 64 KiB bucket.
const burstTime = 4 * time.Millisecond

// setRateLocked sets the rate and the bucket depth. l.mu must be held.
func (l *limiter) setRateLocked(bps int64) {
	l.rate = float64(bps)
	l.burst = max(minBurst, l.rate*burstTime.Seconds())
	l.tokens = min(l.tokens, l.burst)
}

// advance refills the bucket up to now. l.mu must be held.
func (l *limiter) advance(now time.Time) {
	if l.rate > 0 {
		full := l.tokens + now.Sub(l.last).Seconds()*l.rate
		l.unused += max(0, full-l.burst)
		l.tokens = min(full, l.burst)
	}
	l.last = now
}

// unusedBytes returns the capacity unused so far, brought up to now.
func (l *limiter) unusedBytes() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.advance(time.Now())
	return int64(l.unused)
}

// asTime converts n bytes to the time the cap takes to carry them; 0
// without a cap.
func (l *limiter) asTime(n int64) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.rate == 0 {
		return 0
	}
	return time.Duration(float64(n) / l.rate * float64(time.Second))
}

func (l *limiter) setRate(bps int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.advance(time.Now())
	l.setRateLocked(bps)
}

// chunk returns how many bytes (at most limit) to read at a time: about 10 ms
// worth at low rates (but at least minChunk), so that slow caps stay smooth.
func (l *limiter) chunk(limit int) int {
	l.mu.Lock()
	rate := l.rate
	l.mu.Unlock()
	if rate == 0 || rate/100 >= float64(limit) {
		return limit
	}
	return min(limit, int(max(rate/100, minChunk)))
}

// wait blocks until n bytes may be sent, or ctx is done. timer is a stopped
// timer owned by the caller, reused to avoid allocating per call.
func (l *limiter) wait(ctx context.Context, timer *time.Timer, n int) error {
	l.mu.Lock()
	if l.rate == 0 {
		l.mu.Unlock()
		return nil
	}
	l.advance(time.Now())
	l.tokens -= float64(n)
	var d time.Duration
	if l.tokens < 0 {
		d = time.Duration(-l.tokens / l.rate * float64(time.Second))
	}
	l.mu.Unlock()
	if d <= 0 {
		return nil
	}
	timer.Reset(d)
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		timer.Stop()
		l.mu.Lock()
		l.tokens = min(l.tokens+float64(n), l.burst)
		l.mu.Unlock()
		return ctx.Err()
	}
}
