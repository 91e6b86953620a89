package bucket

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/pullproxy/pullproxy/storage"
)

// A turn is a lease on a named piece of work rather than on a blob: one
// replica at a time holds it and does the work, then leaves a small state
// (what it did, as JSON) for whoever holds it next. Work that replicas
// share on a schedule, such as a sync rule's rounds, takes a turn so that
// one replica runs each round.
//
// It is a lease object (lease.go), at turns/<name>, written only with
// conditional writes, as a blob's is:
//
//   - taken with If-None-Match: * when there is none, and with If-Match
//     over one released;
//   - renewed by its holder every LeaseTTL/3 with If-Match;
//   - taken over with If-Match once this replica has seen its ETag
//     unchanged for LeaseTTL by its own clock (clocks are never compared
//     across replicas);
//   - released by Done with If-Match, with the state the holder leaves.
//
// Turns are not under uploads/: the janitor removes what is there once
// nobody touched it for StaleUploads, and a turn released stays untouched
// for as long as its work waits for a next round.

// ErrTurnTaken: another replica holds the turn, and renewed it within
// LeaseTTL as this replica saw it; or took it first.
var ErrTurnTaken = errors.New("another replica holds the turn")

// ErrTurnNotWanted: TakeTurn's want declined the turn, given its state.
var ErrTurnNotWanted = errors.New("turn not wanted, given its state")

// ErrTurnLost: a turn is no longer this replica's (taken over, or not
// renewed in time): its holder is to stop its work, and the state it
// would leave is not written.
var ErrTurnLost = errors.New("the turn is no longer this replica's")

// Turn is a turn this replica holds, renewed until Done.
type Turn struct {
	name  string
	state []byte
	h     *holding
}

func (b *Bucket) turnKey(name string) string { return b.prefix + "turns/" + name }

// turnLease is the lease object of the turn named name.
func (b *Bucket) turnLease(name string) leaseRef {
	return leaseRef{key: b.turnKey(name), what: "turn " + name}
}

// TakeTurn takes the turn named name (a key under turns/, such as
// "sync/<hash of a rule>"), unless another replica holds it.
//
// want is called, before anything is written, with the state the last
// holder left (nil if none); returning false leaves the turn untouched
// and TakeTurn returns ErrTurnNotWanted. want is not called when the
// turn is held.
//
// A turn another replica holds is taken over once this replica has seen
// it unchanged (the same ETag) for LeaseTTL, by its own clock, over calls
// of TakeTurn: each call that finds it held remembers what it saw, and
// returns ErrTurnTaken until then.
//
// While the bucket is degraded, and when a call finds it so, the error
// wraps ErrDegraded: the caller may do the work alone. Other errors are
// the bucket's failures.
func (b *Bucket) TakeTurn(ctx context.Context, name string, want func(state []byte) bool) (*Turn, error) {
	if err := checkTurnName(name); err != nil {
		return nil, err
	}
	ref := b.turnLease(name)
	cur, err := b.readLease(ctx, ref)
	switch {
	case errors.Is(err, ErrDegraded):
		return nil, fmt.Errorf("taking %s: %w", ref.what, err)
	case errors.Is(err, storage.ErrNotFound):
		cur = held{} // never taken: created with If-None-Match
	case err != nil:
		return nil, b.turnFailed(ref, err)
	}
	var since time.Time // a holder's ETag seen unchanged since, by this replica's clock
	if cur.Holder != "" {
		since = b.turnsSeen.see(name, cur.etag, time.Now())
		if time.Since(since) < b.cfg.LeaseTTL {
			return nil, fmt.Errorf("%s, held by %s: %w", ref.what, cur.Holder, ErrTurnTaken)
		}
	}
	if !want(cur.State) {
		return nil, fmt.Errorf("%s: %w", ref.what, ErrTurnNotWanted)
	}
	h, err := b.take(ctx, ref, cur.lease, cur.etag)
	switch {
	case errors.Is(err, errPrecondition):
		return nil, fmt.Errorf("%s, taken by another replica first: %w", ref.what, ErrTurnTaken)
	case err != nil:
		return nil, b.turnFailed(ref, err)
	}
	b.turnsSeen.forget(name)
	if !since.IsZero() {
		b.log.Info("took over a turn from a replica that stopped renewing it", "turn", name,
			"previous_holder", cur.Holder, "unchanged_for", time.Since(since).Round(time.Millisecond))
	}
	return &Turn{name: name, state: cur.State, h: h}, nil
}

// turnFailed wraps err, the bucket's failure taking ref, with ErrDegraded
// when that failure made the bucket degraded.
func (b *Bucket) turnFailed(ref leaseRef, err error) error {
	if b.Degraded() && !errors.Is(err, ErrDegraded) {
		return fmt.Errorf("taking %s: %w: %w", ref.what, ErrDegraded, err)
	}
	return fmt.Errorf("taking %s: %w", ref.what, err)
}

// checkTurnName refuses names that would not make a key of their own
// under turns/.
func checkTurnName(name string) error {
	if name == "" || strings.HasPrefix(name, "/") || strings.HasSuffix(name, "/") || strings.Contains(name, "//") {
		return fmt.Errorf("turn name %q: want a non-empty key of /-separated names", name)
	}
	return nil
}

// Name returns the turn's name.
func (t *Turn) Name() string { return t.name }

// State returns the state the last holder left, as of taking the turn
// (nil if none).
func (t *Turn) State() []byte { return t.state }

// Lost returns a channel closed once this replica knows the turn lost,
// before Done: a renewal refused (another replica took it over) or
// failing until the turn lapsed. The holder is then to stop its work.
func (t *Turn) Lost() <-chan struct{} { return t.h.Lost() }

// Err returns nil while the turn is this replica's, until Done; else an
// error wrapping ErrTurnLost (and ErrDegraded when the bucket became
// degraded). It may say so before Lost is closed: a holder checks it
// before each step that must not run twice at once.
func (t *Turn) Err() error {
	if err := t.h.valid(); err != nil {
		return fmt.Errorf("%w: %w", ErrTurnLost, err)
	}
	return nil
}

// Done stops renewing the turn and releases it, leaving state (JSON) for
// the next holder; a nil state keeps the one the turn had. The write is
// conditional on the turn being still this replica's: when it was lost
// meanwhile, nothing is written and the error wraps ErrTurnLost. Whatever
// the error, the state was not written, and the turn is not renewed.
func (t *Turn) Done(ctx context.Context, state []byte) error {
	var change func(*lease)
	if state != nil {
		if !json.Valid(state) {
			t.h.release(ctx)
			return fmt.Errorf("leaving turn %s: its state is not JSON: %.100q", t.name, state)
		}
		change = func(l *lease) { l.State = state }
	}
	err := t.h.leave(ctx, change)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errLeaseLost) || errors.Is(err, errPrecondition) ||
		errors.Is(err, storage.ErrNotFound) && !errors.Is(err, ErrDegraded):
		return fmt.Errorf("leaving turn %s, its state not written: %w: %w", t.name, ErrTurnLost, err)
	}
	return fmt.Errorf("leaving turn %s, its state not written: %w", t.name, err)
}

// TurnStatus is a turn as last written.
type TurnStatus struct {
	// Holder is the replica holding the turn, as it names itself, or ""
	// when released. A replica that died holding it is named until
	// another takes it over.
	Holder string
	State  []byte // as the last holder left it; nil if none
}

// ReadTurn returns the turn named name as last written, or an error
// wrapping storage.ErrNotFound when it was never taken.
func (b *Bucket) ReadTurn(ctx context.Context, name string) (TurnStatus, error) {
	if err := checkTurnName(name); err != nil {
		return TurnStatus{}, err
	}
	cur, err := b.readLease(ctx, b.turnLease(name))
	if err != nil {
		return TurnStatus{}, err
	}
	return TurnStatus{Holder: cur.Holder, State: cur.State}, nil
}

// sightings remembers, per turn, the ETag this replica last saw another
// replica's holding of it have, and since when: a holder that stops
// renewing leaves its ETag unchanged, and once it has been so for
// LeaseTTL by this replica's clock, the turn is taken over.
type sightings struct {
	mu sync.Mutex
	m  map[string]sighting
}

type sighting struct {
	etag string
	at   time.Time
}

// see records etag as seen of the turn name at now, unless it was seen
// before, and returns since when it has been.
func (s *sightings) see(name, etag string, now time.Time) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	if last, ok := s.m[name]; ok && last.etag == etag {
		return last.at
	}
	if s.m == nil {
		s.m = map[string]sighting{}
	}
	s.m[name] = sighting{etag: etag, at: now}
	return now
}

// forget drops what was seen of the turn name.
func (s *sightings) forget(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, name)
}
