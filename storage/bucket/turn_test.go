package bucket

import (
	"bytes"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/storage"
)

const testTurn = "sync/rule"

func wantAny([]byte) bool { return true }

// Replicas asking for one turn at once: exactly one gets it; once it is
// done, the next asking gets it at once.
func TestTurnTakenOnce(t *testing.T) {
	t.Parallel()
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket}
	rs := make([]testReplica, 4)
	for i := range rs {
		rs[i] = newReplica(t, srv, "r"+string(rune('a'+i)), cfg)
	}
	ctx := t.Context()
	turns := make([]*Turn, len(rs))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, r := range rs {
		wg.Go(func() {
			<-start
			turn, err := r.b.TakeTurn(ctx, testTurn, wantAny)
			switch {
			case err == nil:
				turns[i] = turn
			case !errors.Is(err, ErrTurnTaken):
				t.Errorf("replica %d: got %v, want the turn or ErrTurnTaken", i, err)
			}
		})
	}
	close(start)
	wg.Wait()
	var holder *Turn
	won := 0
	for _, turn := range turns {
		if turn != nil {
			holder = turn
			won++
		}
	}
	if won != 1 {
		t.Fatalf("%d replicas took the turn at once, want 1", won)
	}
	// Held: every replica asking again is refused, the holder's own too.
	for i, r := range rs {
		if _, err := r.b.TakeTurn(ctx, testTurn, wantAny); !errors.Is(err, ErrTurnTaken) {
			t.Errorf("replica %d asking for a held turn: got %v, want ErrTurnTaken", i, err)
		}
	}
	if err := holder.Err(); err != nil {
		t.Fatalf("the holder's turn: %v, want it held", err)
	}
	if err := holder.Done(ctx, nil); err != nil {
		t.Fatal(err)
	}
	next, err := rs[len(rs)-1].b.TakeTurn(ctx, testTurn, wantAny)
	if err != nil {
		t.Fatalf("taking a released turn: %v", err)
	}
	if err := next.Done(ctx, nil); err != nil {
		t.Fatal(err)
	}
}

// The state the holder leaves is what the next is asked about; a turn
// not wanted is left as it was; a nil state keeps the one before.
func TestTurnStateHandedOn(t *testing.T) {
	t.Parallel()
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket}
	a, b := newReplica(t, srv, "a", cfg), newReplica(t, srv, "b", cfg)
	ctx := t.Context()
	var asked [][]byte
	record := func(state []byte) bool { asked = append(asked, state); return true }

	if _, err := a.b.ReadTurn(ctx, testTurn); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("reading a turn never taken: got %v, want not found", err)
	}
	turn, err := a.b.TakeTurn(ctx, testTurn, record)
	if err != nil {
		t.Fatal(err)
	}
	if len(asked) != 1 || asked[0] != nil || turn.State() != nil {
		t.Fatalf("first turn: want asked with %q, state %q; want nil", asked, turn.State())
	}
	if st, err := b.b.ReadTurn(ctx, testTurn); err != nil || st.Holder != "a" {
		t.Fatalf("turn held: %+v, %v; want held by a", st, err)
	}
	round1 := []byte(`{"round":1,"tags":["v1","v2"]}`)
	if err := turn.Done(ctx, round1); err != nil {
		t.Fatal(err)
	}

	turn, err = b.b.TakeTurn(ctx, testTurn, record)
	if err != nil {
		t.Fatal(err)
	}
	if len(asked) != 2 || !bytes.Equal(asked[1], round1) || !bytes.Equal(turn.State(), round1) {
		t.Fatalf("next turn: want asked with %q, state %q; want %s", asked[1:], turn.State(), round1)
	}
	if err := turn.Done(ctx, nil); err != nil {
		t.Fatal(err)
	}

	before, err := a.b.readLease(ctx, a.b.turnLease(testTurn))
	if err != nil {
		t.Fatal(err)
	}
	var declined []byte
	_, err = a.b.TakeTurn(ctx, testTurn, func(state []byte) bool { declined = state; return false })
	if !errors.Is(err, ErrTurnNotWanted) {
		t.Fatalf("a turn declined: got %v, want ErrTurnNotWanted", err)
	}
	if !bytes.Equal(declined, round1) {
		t.Errorf("declined given state %s, want %s (kept by a nil state)", declined, round1)
	}
	after, err := a.b.readLease(ctx, a.b.turnLease(testTurn))
	if err != nil {
		t.Fatal(err)
	}
	if after.etag != before.etag {
		t.Errorf("a turn declined was written: ETag %s, want %s", after.etag, before.etag)
	}

	// A state that is not JSON is refused, and the turn released as it was.
	turn, err = a.b.TakeTurn(ctx, testTurn, wantAny)
	if err != nil {
		t.Fatal(err)
	}
	if err := turn.Done(ctx, []byte("not json")); err == nil {
		t.Error("Done with a state that is not JSON: got nil, want an error")
	}
	if st, err := b.b.ReadTurn(ctx, testTurn); err != nil || st.Holder != "" || !bytes.Equal(st.State, round1) {
		t.Errorf("turn after a state refused: %+v, %v; want released with %s", st, err, round1)
	}
}

// A holder that stops renewing (its network to the bucket cut, as a
// killed process's would be) is taken over, with the state it took, only
// once the other replica has seen the turn unchanged for LeaseTTL. The old
// holder learns it lost the turn, and what it would leave is not written.
func TestTurnTakenOverOnlyAfterLeaseTTL(t *testing.T) {
	t.Parallel()
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket, LeaseTTL: time.Second}
	net := &cuttable{}
	a := newReplica(t, srv, "dying", cfg, withHTTPClient(&http.Client{Transport: net}))
	b := newReplica(t, srv, "b", cfg)
	ctx := t.Context()
	round1 := []byte(`{"round":1}`)
	turn, err := a.b.TakeTurn(ctx, testTurn, wantAny)
	if err != nil {
		t.Fatal(err)
	}
	if err := turn.Done(ctx, round1); err != nil {
		t.Fatal(err)
	}
	dying, err := a.b.TakeTurn(ctx, testTurn, wantAny)
	if err != nil {
		t.Fatal(err)
	}
	net.cut.Store(true)

	firstSeen := time.Now()
	if _, err := b.b.TakeTurn(ctx, testTurn, wantAny); !errors.Is(err, ErrTurnTaken) {
		t.Fatalf("a turn first seen held: got %v, want ErrTurnTaken", err)
	}
	var taken *Turn
	waitFor(t, "b to take the turn over", func() bool {
		taken, err = b.b.TakeTurn(ctx, testTurn, wantAny)
		if err != nil && !errors.Is(err, ErrTurnTaken) {
			t.Fatal(err)
		}
		return err == nil
	})
	if waited := time.Since(firstSeen); waited < cfg.LeaseTTL {
		t.Errorf("taken over %v after b first saw it held, want at least LeaseTTL (%v)", waited, cfg.LeaseTTL)
	}
	if !bytes.Equal(taken.State(), round1) {
		t.Errorf("state taken over: %s, want %s", taken.State(), round1)
	}

	select {
	case <-dying.Lost():
	case <-time.After(time.Minute):
		t.Fatal("the old holder's Lost not closed a minute after its turn was taken over")
	}
	if err := dying.Err(); !errors.Is(err, ErrTurnLost) {
		t.Errorf("the old holder's Err: %v, want ErrTurnLost", err)
	}
	// Its network back, the old holder still writes nothing.
	net.cut.Store(false)
	if err := dying.Done(ctx, []byte(`{"round":"stale"}`)); !errors.Is(err, ErrTurnLost) {
		t.Errorf("the old holder's Done: %v, want ErrTurnLost", err)
	}
	if st, err := b.b.ReadTurn(ctx, testTurn); err != nil || st.Holder != "b" || !bytes.Equal(st.State, round1) {
		t.Errorf("turn after the old holder's Done: %+v, %v; want held by b with %s", st, err, round1)
	}
	round2 := []byte(`{"round":2}`)
	if err := taken.Done(ctx, round2); err != nil {
		t.Fatal(err)
	}
	if st, err := a.b.ReadTurn(ctx, testTurn); err != nil || st.Holder != "" || !bytes.Equal(st.State, round2) {
		t.Errorf("turn after the new holder's Done: %+v, %v; want released with %s", st, err, round2)
	}
}

// A holder's renewals keep its turn past LeaseTTL: another replica asking
// all along is refused.
func TestTurnRenewed(t *testing.T) {
	t.Parallel()
	srv, bucket := testMinio(t)
	cfg := Config{Bucket: bucket, LeaseTTL: 2 * time.Second}
	a, b := newReplica(t, srv, "a", cfg), newReplica(t, srv, "b", cfg)
	ctx := t.Context()
	turn, err := a.b.TakeTurn(ctx, testTurn, wantAny)
	if err != nil {
		t.Fatal(err)
	}
	tick := time.NewTicker(cfg.LeaseTTL / 10)
	defer tick.Stop()
	for first := time.Now(); time.Since(first) < 2*cfg.LeaseTTL; <-tick.C {
		if _, err := b.b.TakeTurn(ctx, testTurn, wantAny); !errors.Is(err, ErrTurnTaken) {
			t.Fatalf("asking for a turn renewed %v after first seeing it: got %v, want ErrTurnTaken", time.Since(first), err)
		}
	}
	if err := turn.Err(); err != nil {
		t.Fatalf("the holder's turn after 2 LeaseTTL: %v, want it held", err)
	}
	select {
	case <-turn.Lost():
		t.Fatal("the holder's Lost closed")
	default:
	}
	if err := turn.Done(ctx, []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
}

// A bucket that stops answering: the holder's turn is lost for it, and
// asking for a turn fails with an error wrapping ErrDegraded, from the
// call that finds it so on.
func TestTurnWhileDegraded(t *testing.T) {
	t.Parallel()
	srv, bucket := testMinio(t)
	net := &hangable{}
	r := newReplica(t, srv, "a", Config{Bucket: bucket, LeaseTTL: time.Second},
		withHTTPClient(&http.Client{Transport: net}), withDeadlines(time.Second, time.Second), withProbe(time.Hour))
	ctx := t.Context()
	turn, err := r.b.TakeTurn(ctx, testTurn, wantAny)
	if err != nil {
		t.Fatal(err)
	}
	net.hang.Store(true)
	select {
	case <-turn.Lost():
	case <-time.After(time.Minute):
		t.Fatal("Lost not closed a minute after the bucket stopped answering")
	}
	if err := turn.Err(); !errors.Is(err, ErrTurnLost) || !errors.Is(err, ErrDegraded) {
		t.Errorf("Err with the bucket hanging: %v, want ErrTurnLost and ErrDegraded", err)
	}
	if _, err := r.b.TakeTurn(ctx, testTurn, wantAny); !errors.Is(err, ErrDegraded) {
		t.Errorf("TakeTurn while degraded: %v, want ErrDegraded", err)
	}
	if err := turn.Done(ctx, []byte(`{}`)); !errors.Is(err, ErrTurnLost) {
		t.Errorf("Done while degraded: %v, want ErrTurnLost", err)
	}

	// The call that finds the bucket hanging says it is degraded too.
	net2 := &hangable{}
	r2 := newReplica(t, srv, "b", Config{Bucket: bucket},
		withHTTPClient(&http.Client{Transport: net2}), withDeadlines(time.Second, time.Second), withProbe(time.Hour))
	net2.hang.Store(true)
	if _, err := r2.b.TakeTurn(ctx, testTurn, wantAny); !errors.Is(err, ErrDegraded) {
		t.Errorf("TakeTurn finding the bucket hanging: %v, want ErrDegraded", err)
	}
}
