package bucket

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
)

// A lease says which replica is fetching a blob from the upstream, and how
// far its upload has got. It is one small object per blob, written only
// with conditional writes:
//
//   - taken with If-None-Match: * (exactly one replica creates it);
//   - renewed by its holder every LeaseTTL/3, and at every part uploaded,
//     with If-Match: <the ETag it last wrote> (a holder that lost it finds
//     out at its next write);
//   - taken over, once its ETag has not changed for LeaseTTL by the
//     follower's own clock, with If-Match: <that ETag> (exactly one
//     follower wins; clocks are never compared across replicas).
//
// The holder deletes it once the blob is in the bucket whole, or when its
// download fails, keeping the parts for whoever comes next.
//
// A turn (turn.go) is the same object on a piece of work rather than a
// blob: its part fields stay zero, and State carries what its last holder
// left for the next.
type lease struct {
	Holder   string `json:"holder"`
	Size     int64  `json:"size"`      // -1 until the holder knows it
	PartSize int64  `json:"part_size"` // parts are [i*PartSize, (i+1)*PartSize)
	// Uploaded has a '1' for each part uploaded, by index. Parts go up as
	// soon as they are whole, in whatever order the download fills them.
	Uploaded string `json:"uploaded"`
	Writes   int64  `json:"writes"` // changes at every write, so the ETag does
	// State is a turn's: what its last holder left, as JSON. Omitted
	// when empty, so a blob's lease reads as it always did.
	State json.RawMessage `json:"state,omitempty"`
}

// uploaded reports whether part i is in the bucket.
func (l lease) uploaded(i int) bool { return i < len(l.Uploaded) && l.Uploaded[i] == '1' }

// setUploaded marks part i as in the bucket.
func (l *lease) setUploaded(i int) {
	b := []byte(l.Uploaded)
	for len(b) <= i {
		b = append(b, '0')
	}
	b[i] = '1'
	l.Uploaded = string(b)
}

// clearUploaded marks part i as not in the bucket.
func (l *lease) clearUploaded(i int) {
	if i < len(l.Uploaded) {
		b := []byte(l.Uploaded)
		b[i] = '0'
		l.Uploaded = string(b)
	}
}

// count returns how many parts are in the bucket.
func (l lease) count() int { return strings.Count(l.Uploaded, "1") }

// numParts is how many parts a blob of the lease's size is uploaded in.
func (l lease) numParts() int {
	if l.Size <= 0 || l.PartSize <= 0 {
		return 1
	}
	return int((l.Size + l.PartSize - 1) / l.PartSize)
}

// part returns part i's range.
func (l lease) part(i int) (start, end int64) {
	start = int64(i) * l.PartSize
	return start, min(start+l.PartSize, l.Size)
}

// partSizeFor returns the part size for a blob of size bytes: the
// configured one, or larger when S3's 10,000 parts would not hold it.
func (b *Bucket) partSizeFor(size int64) int64 {
	ps := b.cfg.PartSize
	if size > ps*maxParts {
		ps = (size/maxParts + 1<<20) &^ (1<<20 - 1)
	}
	return ps
}

// leaseRef names a lease object: its key, and what it is the lease of, as
// log lines and errors say it ("lease of sha256:…", "turn sync/…").
type leaseRef struct {
	key  string
	what string
}

// blobLease is the lease of d's download.
func (b *Bucket) blobLease(d digest.Digest) leaseRef {
	return leaseRef{key: b.leaseKey(d), what: "lease of " + d.String()}
}

// held is a lease as read from the bucket.
type held struct {
	lease
	etag string
}

// readLease reads the lease ref names, or returns an error wrapping
// storage.ErrNotFound.
func (b *Bucket) readLease(ctx context.Context, ref leaseRef) (held, error) {
	body, o, err := b.getSmall(ctx, "get_lease", ref.key)
	if err != nil {
		return held{}, err
	}
	var l lease
	if err := json.Unmarshal(body, &l); err != nil {
		return held{}, fmt.Errorf("reading %s: %w", ref.what, err)
	}
	return held{l, o.etag}, nil
}

// writeLease writes l as the lease ref names: created when ifMatch is "",
// else over the lease with that ETag. It fails with errPrecondition when
// another replica got there first.
func (b *Bucket) writeLease(ctx context.Context, ref leaseRef, l lease, ifMatch string) (string, error) {
	body, err := json.Marshal(l)
	if err != nil {
		return "", fmt.Errorf("writing %s: %w", ref.what, err)
	}
	ifNoneMatch := ""
	if ifMatch == "" {
		ifNoneMatch = "*"
	}
	return b.putBytes(ctx, "put_lease", ref.key, body, ifNoneMatch, ifMatch, nil)
}

// holding is a lease this replica holds, kept alive by keep until release
// (or leave).
//
// It is this replica's only while valid: until a lease_ttl after the last
// write that succeeded was sent, less a third of it for margin. A follower
// takes a lease over once it has seen it unchanged for lease_ttl, which
// starts no earlier than that write was sent; so a holder that checks
// valid before each write of its own (a part, the assembly, a deletion)
// never acts after another replica took over, whatever the network did
// to its renewals.
type holding struct {
	b         *Bucket
	ref       leaseRef
	inherited bool // taken over or taken released: others held it before
	cancel    context.CancelFunc
	done      chan struct{} // closed when keep returns

	mu       sync.Mutex
	state    lease
	etag     string
	dirty    bool          // state changed since last written
	wake     chan struct{} // a change to write at once; capacity 1
	lost     error         // set when the lease is no longer this replica's
	lostCh   chan struct{} // closed when lost is set
	sent     time.Time     // when the last write that succeeded was sent
	released bool
}

// take tries to create the lease ref names (ifMatch "") or to take over
// the one with ETag ifMatch, starting from from's state. It returns
// errPrecondition when another replica holds it.
func (b *Bucket) take(ctx context.Context, ref leaseRef, from lease, ifMatch string) (*holding, error) {
	l := from
	l.Holder = b.id
	l.Writes++
	sent := time.Now()
	etag, err := b.writeLease(ctx, ref, l, ifMatch)
	if err != nil {
		return nil, err
	}
	kctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	h := &holding{b: b, ref: ref, inherited: ifMatch != "", cancel: cancel, done: make(chan struct{}), state: l, etag: etag,
		wake: make(chan struct{}, 1), lostCh: make(chan struct{}), sent: sent}
	go h.keep(kctx)
	return h, nil
}

// update changes the lease's state and has it written soon.
func (h *holding) update(f func(*lease)) {
	h.mu.Lock()
	f(&h.state)
	h.dirty = true
	h.mu.Unlock()
	select {
	case h.wake <- struct{}{}:
	default:
	}
}

// current returns the lease's state as last set.
func (h *holding) current() lease {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.state
}

// Lost returns a channel closed once the lease is known lost.
func (h *holding) Lost() <-chan struct{} { return h.lostCh }

// validUntil is when the lease stops being this replica's unless renewed.
func (h *holding) validUntil() time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	ttl := h.b.cfg.LeaseTTL
	return h.sent.Add(ttl - ttl/3)
}

// valid returns nil while the lease is this replica's, else why not.
func (h *holding) valid() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lost != nil {
		return h.lost
	}
	ttl := h.b.cfg.LeaseTTL
	if until := h.sent.Add(ttl - ttl/3); time.Now().After(until) {
		return fmt.Errorf("%s not renewed since %s: %w", h.ref.what, h.sent.Format(time.RFC3339), errLeaseLost)
	}
	return nil
}

// errLeaseLost: a lease is no longer this replica's (taken over, or not
// renewed in time).
var errLeaseLost = errors.New("another replica may hold it")

// loseLocked records the lease as lost. Called with mu held.
func (h *holding) loseLocked(err error) {
	if h.lost == nil {
		h.lost = fmt.Errorf("%s lost (%w): %w", h.ref.what, errLeaseLost, err)
		close(h.lostCh)
	}
}

// keep renews the lease until cancelled, and writes updates as they come.
// Each write is conditional on the last one: a write refused means another
// replica took the lease over. Each is bounded by a third of the TTL, so a
// slow bucket makes the lease lapse here before it can be taken over there.
func (h *holding) keep(ctx context.Context) {
	defer close(h.done)
	ttl := h.b.cfg.LeaseTTL
	tick := time.NewTicker(ttl / 3)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-h.wake:
		}
		h.mu.Lock()
		l, etag := h.state, h.etag
		l.Writes++
		h.dirty = false
		h.mu.Unlock()

		sent := time.Now()
		wctx, cancel := context.WithTimeout(ctx, ttl/3)
		newEtag, err := h.b.writeLease(wctx, h.ref, l, etag)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil && !errors.Is(err, ErrDegraded) && h.b.Degraded() {
			// This write's timeout marked the bucket degraded: the next
			// would fail at once.
			err = fmt.Errorf("%w: %w", ErrDegraded, err)
		}
		h.mu.Lock()
		switch {
		case err == nil:
			h.etag, h.state.Writes, h.sent = newEtag, l.Writes, sent
		case errors.Is(err, ErrDegraded):
			// Not asked: the bucket hangs (logged once, when it was
			// marked degraded). The lease lapses; the download goes on
			// here unshared.
			h.loseLocked(err)
			h.mu.Unlock()
			return
		case errors.Is(err, errPrecondition) || errors.Is(err, storage.ErrNotFound) || time.Since(h.sent) > ttl-ttl/3:
			// Taken over, or not renewed in time: another replica may
			// hold it now.
			h.loseLocked(err)
			h.mu.Unlock()
			h.b.log.Warn("lost a lease: another replica may hold it now", "lease", h.ref.what, "err", err)
			return
		default:
			h.b.log.Warn("renewing a lease", "lease", h.ref.what, "err", err)
		}
		again := h.dirty
		h.mu.Unlock()
		if again {
			select {
			case h.wake <- struct{}{}:
			default:
			}
		}
	}
}

// stop stops renewing the lease, and waits for the renewal in flight.
func (h *holding) stop() {
	h.cancel()
	<-h.done
}

// release stops renewing the lease and marks it released, unless it was
// lost or released already: the next replica asking for the blob takes it
// at once (no wait for it to expire) and resumes from the parts it counts
// as uploaded.
func (h *holding) release(ctx context.Context) {
	err := h.leave(ctx, nil)
	if err != nil && !errors.Is(err, errLeaseLost) && !errors.Is(err, errReleased) {
		h.b.log.Info("releasing a lease: other replicas take it once it expires", "lease", h.ref.what, "err", err)
	}
}

// errReleased: a lease was released already.
var errReleased = errors.New("released already")

// leave stops renewing the lease and writes it released, with change (if
// not nil) applied to its state first. It writes nothing when the lease
// was released already (errReleased), or is no longer this replica's
// (errLeaseLost); a write refused because another replica took it over
// fails with errPrecondition.
func (h *holding) leave(ctx context.Context, change func(*lease)) error {
	h.stop()
	h.mu.Lock()
	l, etag, released := h.state, h.etag, h.released
	h.released = true
	h.mu.Unlock()
	if released {
		return fmt.Errorf("%s: %w", h.ref.what, errReleased)
	}
	if err := h.valid(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	l.Holder = ""
	l.Writes++
	if change != nil {
		change(&l)
	}
	_, err := h.b.writeLease(ctx, h.ref, l, etag)
	return err
}
