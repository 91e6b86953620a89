package carrier

import (
	"context"
	"sync"
	"time"
)

// segment is bytes in flight on a delay line, or the end of the stream.
type segment struct {
	buf *[]byte // from segmentPool; nil for an end
	n   int
	due time.Time
}

// delayLine delivers what is sent into it half a round trip later, in
// order, keeping the stream's timing: a byte sent at t is written at
// t+delay. A goroutine per line does the writing, until the stream's end is
// delivered, a write fails, or ctx ends.
type delayLine struct {
	ctx     context.Context
	delay   time.Duration
	pool    *sync.Pool // of *[]byte of bufSize, shared by the relay's lines
	q       chan segment
	deliver func(p []byte) error // writes to the far side
	end     func(failed bool)    // runs once the stream's end is delivered, or a write failed
	done    chan struct{}        // closed when the goroutine exits
}

// lineDepth bounds the segments in flight on one line: past it, the sender
// waits, as a full socket buffer would make it.
const lineDepth = 1024

func newDelayLine(ctx context.Context, pool *sync.Pool, delay time.Duration, deliver func([]byte) error, end func(failed bool)) *delayLine {
	l := &delayLine{ctx: ctx, pool: pool, delay: delay, q: make(chan segment, lineDepth),
		deliver: deliver, end: end, done: make(chan struct{})}
	go l.run()
	return l
}

// send copies p onto the line. It fails only when the line's ctx ends.
func (l *delayLine) send(p []byte) error {
	for len(p) > 0 {
		buf := l.pool.Get().(*[]byte)
		n := copy(*buf, p)
		p = p[n:]
		select {
		case l.q <- segment{buf: buf, n: n, due: time.Now().Add(l.delay)}:
		case <-l.ctx.Done():
			l.pool.Put(buf)
			return l.ctx.Err()
		}
	}
	return nil
}

// close sends the end of the stream and waits for the line's goroutine to
// exit: end has run by then, unless ctx ended first.
func (l *delayLine) close() {
	select {
	case l.q <- segment{due: time.Now().Add(l.delay)}:
	case <-l.ctx.Done():
	}
	<-l.done
}

func (l *delayLine) run() {
	defer close(l.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		var seg segment
		select {
		case seg = <-l.q:
		case <-l.ctx.Done():
			return
		}
		if d := time.Until(seg.due); d > 0 {
			timer.Reset(d)
			select {
			case <-timer.C:
			case <-l.ctx.Done():
				timer.Stop()
				return
			}
		}
		if seg.buf == nil {
			l.end(false)
			return
		}
		err := l.deliver((*seg.buf)[:seg.n])
		l.pool.Put(seg.buf)
		if err != nil {
			l.end(true)
			return
		}
	}
}

// window is a session's congestion window in slow start: at most cwnd bytes
// sent and not yet acknowledged, a byte being acknowledged rtt after it was
// sent; each acknowledged byte grows cwnd by one, up to ceiling.
type window struct {
	rtt           time.Duration
	cwnd, ceiling int64
	inflight      int64
	sent          []sentRecord // oldest first
	timer         *time.Timer
}

type sentRecord struct {
	at time.Time
	n  int64
}

func newWindow(rtt time.Duration, initial, ceiling int64) *window {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &window{rtt: rtt, cwnd: initial, ceiling: ceiling, timer: t}
}

// reserve waits until at least one byte may be sent and returns how many
// (at most want), recording them as sent.
func (w *window) reserve(ctx context.Context, want int) (int, error) {
	for {
		now := time.Now()
		w.ack(now)
		if free := w.cwnd - w.inflight; free > 0 {
			n := int(min(int64(want), free))
			w.inflight += int64(n)
			w.sent = append(w.sent, sentRecord{at: now, n: int64(n)})
			return n, nil
		}
		w.timer.Reset(w.sent[0].at.Add(w.rtt).Sub(now))
		select {
		case <-w.timer.C:
		case <-ctx.Done():
			w.timer.Stop()
			return 0, ctx.Err()
		}
	}
}

// ack acknowledges what was sent at least rtt ago.
func (w *window) ack(now time.Time) {
	i := 0
	for ; i < len(w.sent) && now.Sub(w.sent[i].at) >= w.rtt; i++ {
		w.inflight -= w.sent[i].n
		w.cwnd = min(w.cwnd+w.sent[i].n, w.ceiling)
	}
	if i > 0 {
		w.sent = append(w.sent[:0], w.sent[i:]...)
	}
}
