package bucket

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/pullproxy/pullproxy/storage"
)

// The bucket is a cache, never a dependency. A call a client waits on is
// bounded by clientTimeout; a bucket that lets one run out (or refuses
// connections) is marked degraded, and while it is, every call fails at
// once with ErrDegraded, which wraps storage.ErrNotFound: callers go on
// as if the bucket did not hold what they asked for, with the local store
// and the upstream. A probe in the background clears the state once the
// bucket answers.

// ErrDegraded: the bucket did not answer in time lately, and is not asked
// until a probe finds it answering. It wraps storage.ErrNotFound.
var ErrDegraded = fmt.Errorf("the shared bucket is degraded (it did not answer in time): not asked until it answers a probe: %w", storage.ErrNotFound)

// errCallTimeout is the cause of a call's context ending on the deadline
// this package set, as opposed to the caller's cancelling it.
var errCallTimeout = errors.New("the shared bucket did not answer in time")

const (
	// clientTimeout bounds a call a client waits on: a small object's
	// request, or the first byte of a blob's. A bucket next to its
	// replicas answers in milliseconds.
	clientTimeout = 2 * time.Second
	// probeFirst and probeMax bound the wait between probes of a
	// degraded bucket: doubling from the first to the most.
	probeFirst = 2 * time.Second
	probeMax   = 30 * time.Second
)

// Health is the bucket's state as this replica sees it.
type Health struct {
	Degraded bool      `json:"degraded"`
	Since    time.Time `json:"since,omitzero"` // degraded since
	// Transitions counts the times the bucket became degraded.
	Transitions int64     `json:"transitions"`
	LastError   string    `json:"last_error,omitempty"`
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
	NextProbe   time.Time `json:"next_probe,omitzero"` // while degraded
	// QueuedWrites and DroppedWrites are background writes (blobs
	// committed here, to share) waiting, and dropped because the queue
	// was full or the bucket degraded.
	QueuedWrites  int   `json:"queued_writes"`
	DroppedWrites int64 `json:"dropped_writes"`
}

// health holds the degraded state, and runs the probe.
type health struct {
	m    *metrics
	kick chan struct{} // a transition to degraded; capacity 1

	mu          sync.Mutex
	degraded    bool
	since       time.Time
	transitions int64
	lastErr     string
	lastErrAt   time.Time
	nextProbe   time.Time
}

func newHealth(m *metrics) *health {
	return &health{m: m, kick: make(chan struct{}, 1)}
}

// skip returns ErrDegraded while the bucket is degraded.
func (h *health) skip() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.degraded {
		return ErrDegraded
	}
	return nil
}

// fail marks the bucket degraded for err; it reports whether this was a
// transition.
func (h *health) fail(err error) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lastErr, h.lastErrAt = err.Error(), time.Now()
	if h.degraded {
		return false
	}
	h.degraded, h.since = true, time.Now()
	h.transitions++
	h.m.degraded.Set(1)
	h.m.degradedTotal.Inc()
	select {
	case h.kick <- struct{}{}:
	default:
	}
	return true
}

// recover clears the degraded state.
func (h *health) recover() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.degraded, h.since, h.nextProbe = false, time.Time{}, time.Time{}
	h.m.degraded.Set(0)
}

// Health returns the bucket's state as this replica sees it.
func (b *Bucket) Health() Health {
	h := b.health
	h.mu.Lock()
	st := Health{Degraded: h.degraded, Since: h.since, Transitions: h.transitions,
		LastError: h.lastErr, LastErrorAt: h.lastErrAt, NextProbe: h.nextProbe}
	h.mu.Unlock()
	st.QueuedWrites, st.DroppedWrites = len(b.writes), b.dropped.Load()
	return st
}

// Degraded reports whether the bucket is degraded: calls fail at once.
func (b *Bucket) Degraded() bool { return b.health.skip() != nil }

// isTimeout reports whether err is a deadline's: the call's own, an
// HTTP client timeout, or a stall cut by watch.
func isTimeout(ctx context.Context, err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(context.Cause(ctx), errCallTimeout) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// isUnreachable reports whether err is a failure to connect at all.
func isUnreachable(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "dial"
}

// settle counts a request made with ctx by its outcome, and marks the
// bucket degraded when it did not answer in time or could not be reached.
// A caller that cancelled (a client gone) says nothing of the bucket.
func (b *Bucket) settle(ctx context.Context, op string, err error) {
	timeout := isTimeout(ctx, err)
	b.metrics.request(op, err, timeout)
	if timeout || isUnreachable(err) {
		if b.health.fail(err) {
			class, fix := Diagnose(err)
			b.log.Warn("the shared bucket did not answer: serving from the local store and the upstream until a probe finds it answering",
				"op", op, "class", class, "err", err, "fix", fix)
		}
	}
}

// withClientTimeout bounds a call a client waits on.
func (b *Bucket) withClientTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, b.clientTimeout, errCallTimeout)
}

// probe runs while the bucket is open: each time it becomes degraded, it
// lists one key, after probeFirst, then after waits doubling to probeMax,
// until the bucket answers.
func (b *Bucket) probe(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-b.health.kick:
		}
		wait := b.probeFirst
		for b.Degraded() {
			b.health.mu.Lock()
			b.health.nextProbe = time.Now().Add(wait)
			b.health.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
			err := b.ping(ctx)
			if ctx.Err() != nil {
				return
			}
			if err == nil {
				b.health.recover()
				b.log.Info("the shared bucket answers again: using it")
				break
			}
			b.health.mu.Lock()
			b.health.lastErr, b.health.lastErrAt = err.Error(), time.Now()
			b.health.mu.Unlock()
			wait = min(2*wait, probeMax)
		}
	}
}

// ping lists one key under the prefix, bounded as a client's call is.
func (b *Bucket) ping(ctx context.Context) error {
	ctx, cancel := b.withClientTimeout(ctx)
	defer cancel()
	_, err := b.client.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: &b.name, Prefix: &b.prefix, MaxKeys: aws.Int32(1)})
	b.metrics.request("probe", err, isTimeout(ctx, err))
	if err != nil {
		return b.wrap("probing", b.prefix, err)
	}
	return nil
}

// writeQueue bounds the background writes waiting: past it they are
// dropped (other replicas then fetch those blobs themselves).
const writeQueue = 64

// writers is how many background writes run at once.
const writers = 2

// background queues a write that no client waits on, bounded by
// opTimeout. It never blocks: while the bucket is degraded, or the queue
// is full, the write is dropped and counted.
func (b *Bucket) background(op string, write func(ctx context.Context) error, drop func()) {
	switch {
	case b.closed.Load():
		b.dropWrite(op, "closed", drop)
		return
	case b.Degraded():
		b.dropWrite(op, "degraded", drop)
		return
	}
	select {
	case b.writes <- backgroundWrite{op: op, write: write, drop: drop}:
	default:
		b.dropWrite(op, "queue_full", drop)
	}
}

type backgroundWrite struct {
	op    string
	write func(ctx context.Context) error
	drop  func() // releases what the write holds, when it is not run
}

func (b *Bucket) dropWrite(op, reason string, drop func()) {
	b.dropped.Add(1)
	b.metrics.dropped.WithLabelValues(reason).Inc()
	b.log.Debug("dropped a write to the shared bucket: other replicas fetch it themselves", "op", op, "reason", reason)
	if drop != nil {
		drop()
	}
}

// runWrites runs queued writes until ctx ends, then drops what is left.
func (b *Bucket) runWrites(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			for {
				select {
				case w := <-b.writes:
					b.dropWrite(w.op, "closed", w.drop)
				default:
					return
				}
			}
		case w := <-b.writes:
			if b.Degraded() {
				b.dropWrite(w.op, "degraded", w.drop)
				continue
			}
			wctx, cancel := context.WithTimeoutCause(ctx, opTimeout, errCallTimeout)
			err := w.write(wctx)
			cancel()
			if err != nil && !errors.Is(err, errPrecondition) && !errors.Is(err, ErrDegraded) && ctx.Err() == nil {
				b.log.Warn("a background write to the shared bucket failed: other replicas fetch it themselves", "op", w.op, "err", err)
			}
		}
	}
}

// Close stops the probe and the background writes (those queued are
// dropped). The bucket fails every call after it.
func (b *Bucket) Close() {
	b.closeOnce.Do(func() {
		b.closed.Store(true)
		b.stop()
		b.bg.Wait()
	})
}
