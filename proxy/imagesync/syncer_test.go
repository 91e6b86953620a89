package imagesync

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// memState is a StateStore in memory.
type memState struct {
	mu sync.Mutex
	m  map[string]json.RawMessage
}

func (s *memState) SyncState(ctx context.Context, rule string) (json.RawMessage, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if b, ok := s.m[rule]; ok {
		return b, nil
	}
	return nil, storage.ErrNotFound
}

func (s *memState) PutSyncState(ctx context.Context, rule string, state json.RawMessage) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = map[string]json.RawMessage{}
	}
	s.m[rule] = state
	return nil
}

func (c *fakeCore) set(tag string, d digest.Digest) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tags[tag] = d
}

func (c *fakeCore) seededSoFar() []digest.Digest {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.seeded)
}

// runSyncer runs s over core until the test's bubble ends.
func runSyncer(t *testing.T, s *Syncer, core Core) {
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx, core) }()
	t.Cleanup(func() { cancel(); <-done })
}

func imagesOf(s *Syncer) []digest.Digest {
	var out []digest.Digest
	for _, im := range s.Images() {
		out = append(out, im.Digest)
	}
	return out
}

// TestSyncerTargets is the targets on a fake core, in a bubble of
// fake time: with a 5 s interval, v1 is cached within two intervals and dev
// never; a v2 pushed later within two intervals; each is pinned while
// kept; and a restart pins what was kept before its first round.
func TestSyncerTargets(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		v1, v2, dev := digest.FromString("v1"), digest.FromString("v2"), digest.FromString("dev")
		core := &fakeCore{tags: map[string]digest.Digest{"v1": v1, "dev": dev}}
		state := &memState{}
		rules := []Rule{{Upstream: "reg", Repository: "team/app", Tags: []string{"^v[0-9]+$"}, Interval: 5 * time.Second}}
		s, err := New(t.Context(), rules, "a", WithStateStore(state))
		if err != nil {
			t.Fatal(err)
		}
		runSyncer(t, s, core)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if got := core.seededSoFar(); !slices.Equal(got, []digest.Digest{v1}) {
			t.Fatalf("after two intervals: fetched %v, want v1 alone", got)
		}
		if got := imagesOf(s); !slices.Equal(got, []digest.Digest{v1}) {
			t.Errorf("pinned: got %v, want v1", got)
		}
		core.set("v2", v2)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if got := core.seededSoFar(); !slices.Equal(got, []digest.Digest{v1, v2}) {
			t.Fatalf("two intervals after v2 was pushed: fetched %v, want v1 then v2", got)
		}
		st := s.Status()[0]
		if st.TagsCached != 2 || st.Rounds < 3 || st.Failures != 0 || st.NextRound.IsZero() {
			t.Errorf("status: %+v", st)
		}

		// A restart: what was kept is pinned before any round.
		again, err := New(t.Context(), rules, "a", WithStateStore(state))
		if err != nil {
			t.Fatal(err)
		}
		if got := imagesOf(again); len(got) != 2 {
			t.Errorf("after a restart, before a round: pinned %v, want v1 and v2", got)
		}
	})
}

// TestSyncerPrefix: a prefix rule syncs every repository the catalog
// lists under it, and no other.
func TestSyncerPrefix(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		v1 := digest.FromString("v1")
		core := &fakeCore{repos: []string{"other/x", "team/a", "team/b"}, tags: map[string]digest.Digest{"v1": v1}}
		s, err := New(t.Context(), []Rule{{Upstream: "reg", Repository: "team/*", Interval: time.Minute}}, "a")
		if err != nil {
			t.Fatal(err)
		}
		runSyncer(t, s, core)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		var repos []string
		for _, im := range s.Images() {
			repos = append(repos, im.Repository)
		}
		if !slices.Equal(repos, []string{"team/a", "team/b"}) {
			t.Errorf("repositories kept: got %v, want team/a and team/b", repos)
		}
	})
}

// TestSyncerRetries: a failed round is tried again sooner than the
// interval, backing off, or when the upstream's Retry-After says; the
// kept images stay pinned meanwhile.
func TestSyncerRetries(t *testing.T) {
	tests := []struct {
		name         string
		err          error
		wantFailures int           // at least, rounds failed in the 7 minutes after the interval (jittered by 6)
		wantNext     time.Duration // the next round no later than this after the last failure
	}{
		// Backing off from a minute (an eighth of the hour, at most a
		// minute): 1, 2, 4 minutes.
		{name: "unavailable", err: &upstream.Error{Upstream: "reg", Op: "GET /v2/team/app/tags/list", Kind: upstream.ErrUnavailable, Message: "connection refused"},
			wantFailures: 2, wantNext: 10 * time.Minute},
		{name: "rate limited", err: &upstream.Error{Upstream: "reg", Op: "GET /v2/team/app/tags/list", Kind: upstream.ErrTooManyRequests, Status: 429, RetryAfter: 40 * time.Minute},
			wantFailures: 1, wantNext: 45 * time.Minute},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				v1 := digest.FromString("v1")
				core := &fakeCore{tags: map[string]digest.Digest{"v1": v1}}
				s, err := New(t.Context(), []Rule{{Upstream: "reg", Repository: "team/app", Interval: time.Hour}}, "a")
				if err != nil {
					t.Fatal(err)
				}
				runSyncer(t, s, core)
				time.Sleep(10 * time.Second) // the first round, which succeeds
				synctest.Wait()
				core.mu.Lock()
				core.listErr = tt.err
				core.mu.Unlock()
				time.Sleep(time.Hour + 7*time.Minute) // the second, which fails, and what follows
				synctest.Wait()
				st := s.Status()[0]
				if st.Failures < tt.wantFailures || st.Failures > 2*tt.wantFailures || st.LastError == "" || st.TagsCached != 1 {
					t.Fatalf("after failed rounds: %d failures, want %d: %+v", st.Failures, tt.wantFailures, st)
				}
				if next := st.NextRound.Sub(st.LastRound); next > tt.wantNext || next < time.Second {
					t.Errorf("next round %v after the last, want at most %v", next, tt.wantNext)
				}
				if len(s.Images()) != 1 {
					t.Errorf("the kept image is no longer pinned after a failed round")
				}
			})
		})
	}
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	unavailable := &upstream.Error{Kind: upstream.ErrUnavailable}
	tests := []struct {
		interval time.Duration
		failures int
		err      error
		min, max time.Duration
	}{
		{time.Hour, 1, unavailable, 54 * time.Second, 66 * time.Second},                    // an eighth, at most a minute
		{time.Hour, 3, unavailable, 216 * time.Second, 264 * time.Second},                  // doubled twice
		{time.Hour, 20, unavailable, 54 * time.Minute, 66 * time.Minute},                   // up to the interval
		{5 * time.Second, 1, unavailable, 900 * time.Millisecond, 1100 * time.Millisecond}, // at least a second
		{time.Hour, 1, fmt.Errorf("round: %w", errors.Join(errors.New("x"),
			&upstream.Error{Kind: upstream.ErrTooManyRequests, RetryAfter: 2 * time.Hour})), 2 * time.Hour, 2*time.Hour + 12*time.Minute},
	}
	for _, tt := range tests {
		for range 20 {
			if got := backoff(tt.interval, tt.failures, tt.err); got < tt.min || got > tt.max {
				t.Errorf("backoff(%v, %d, %v) = %v, want %v to %v", tt.interval, tt.failures, tt.err, got, tt.min, tt.max)
			}
		}
	}
}

// TestSyncerHoldsOff: while the guard refuses (the rate-limit window
// nearly spent), nothing is fetched, and the round says why.
func TestSyncerHoldsOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		core := &fakeCore{tags: map[string]digest.Digest{"v1": digest.FromString("v1")}}
		var mu sync.Mutex
		left := int64(3)
		guard := PullsLeftGuard(func(string) (int64, int64, bool) { mu.Lock(); defer mu.Unlock(); return left, 100, true })
		s, err := New(t.Context(), []Rule{{Upstream: "reg", Repository: "team/app", Interval: time.Minute}}, "a", WithFetchGuard(guard))
		if err != nil {
			t.Fatal(err)
		}
		runSyncer(t, s, core)
		time.Sleep(10 * time.Second)
		synctest.Wait()
		if got := core.seededSoFar(); len(got) != 0 {
			t.Fatalf("fetched %v with 3 pulls of 100 left", got)
		}
		if st := s.Status()[0]; st.Failures != 1 || !strings.Contains(st.LastError, "holding off") {
			t.Errorf("status: %+v", st)
		}
		mu.Lock()
		left = 80
		mu.Unlock()
		time.Sleep(2 * time.Minute)
		synctest.Wait()
		if got := core.seededSoFar(); len(got) != 1 {
			t.Errorf("with 80 pulls of 100 left: fetched %v, want v1", got)
		}
	})
}

// TestWantTurn: a replica runs a round when no other ran one since it
// last looked, and otherwise takes the state the other left.
func TestWantTurn(t *testing.T) {
	t.Parallel()
	other := ruleState{Repositories: map[string]Kept{"team/app": {"v1": digest.FromString("v1")}}, Rounds: 8, By: "b"}
	tests := []struct {
		name      string
		seen      int64 // -1: never looked
		state     []byte
		want      bool
		wantTags  int
		wantRound int64 // seen after
	}{
		{name: "never taken", seen: -1, state: nil, want: true, wantRound: 0},
		{name: "first look here", seen: -1, state: mustJSON(other), want: true, wantRound: 8},
		{name: "nobody ran since", seen: 8, state: mustJSON(other), want: true, wantRound: 8},
		{name: "another ran since", seen: 7, state: mustJSON(other), want: false, wantTags: 1, wantRound: 8},
		{name: "unreadable", seen: 7, state: []byte("{"), want: true, wantRound: 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sel, err := Compile(Rule{Upstream: "reg", Repository: "team/app"})
			if err != nil {
				t.Fatal(err)
			}
			r := &ruleRun{sel: sel, seen: tt.seen, state: ruleState{Repositories: map[string]Kept{}}}
			if got := r.wantTurn(tt.state); got != tt.want {
				t.Errorf("want: got %v, want %v", got, tt.want)
			}
			if r.seen != tt.wantRound || r.status.TagsCached != tt.wantTags {
				t.Errorf("after: seen %d, tags %d; want %d, %d", r.seen, r.status.TagsCached, tt.wantRound, tt.wantTags)
			}
		})
	}
}

// fakeTurns is a bucket's turns as one replica sees them: held by another
// while taken is set, else handed out with the state last left.
type fakeTurns struct {
	mu    sync.Mutex
	taken bool   // another replica holds the turn
	state []byte // what the last holder left
	done  int    // turns handed back here
}

type fakeTurn struct {
	f     *fakeTurns
	state []byte
	lost  chan struct{}
}

func (f *fakeTurns) TakeTurn(ctx context.Context, name string, want func([]byte) bool) (Turn, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.taken {
		return nil, ErrTurnTaken
	}
	if !want(f.state) {
		return nil, ErrTurnNotWanted
	}
	return &fakeTurn{f: f, state: f.state, lost: make(chan struct{})}, nil
}

func (t *fakeTurn) State() []byte         { return t.state }
func (t *fakeTurn) Lost() <-chan struct{} { return t.lost }
func (t *fakeTurn) Done(ctx context.Context, state []byte) error {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	t.f.state, t.f.done = state, t.f.done+1
	return nil
}

func (f *fakeTurns) set(taken bool, state []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.taken, f.state = taken, state
}

// TestSyncerTakesTurns: while another replica holds the rule's turn, this
// one fetches nothing; once another ran a round, this one takes the state
// it left (what it keeps is pinned here too) and fetches nothing that did
// not move; a round it runs hands its state on.
func TestSyncerTakesTurns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		v1, v2 := digest.FromString("v1"), digest.FromString("v2")
		core := &fakeCore{tags: map[string]digest.Digest{"v1": v1}}
		turns := &fakeTurns{taken: true}
		s, err := New(t.Context(), []Rule{{Upstream: "reg", Repository: "team/app", Interval: time.Minute}}, "here", WithTurns(turns))
		if err != nil {
			t.Fatal(err)
		}
		runSyncer(t, s, core)
		time.Sleep(90 * time.Second)
		synctest.Wait()
		if got := core.seededSoFar(); len(got) != 0 {
			t.Fatalf("fetched %v while another replica held the turn", got)
		}

		// The other ran a round and released the turn: its state is taken.
		other := ruleState{Repositories: map[string]Kept{"team/app": {"v1": v1}}, Rounds: 4, By: "there"}
		turns.set(false, mustJSON(other))
		time.Sleep(time.Minute + 10*time.Second)
		synctest.Wait()
		if got := core.seededSoFar(); len(got) != 0 {
			t.Errorf("fetched %v that the other replica had fetched", got)
		}
		if got := imagesOf(s); !slices.Equal(got, []digest.Digest{v1}) {
			t.Errorf("pinned: got %v, want the other replica's v1", got)
		}

		// v2 appears: the round here fetches it and hands the state on.
		core.set("v2", v2)
		time.Sleep(2 * time.Minute)
		synctest.Wait()
		if got := core.seededSoFar(); !slices.Equal(got, []digest.Digest{v2}) {
			t.Errorf("fetched %v, want v2 alone", got)
		}
		turns.mu.Lock()
		var left ruleState
		json.Unmarshal(turns.state, &left)
		done := turns.done
		turns.mu.Unlock()
		if done == 0 || left.By != "here" || len(left.Repositories["team/app"]) != 2 || left.Rounds <= 4 {
			t.Errorf("the state handed on: %+v (%d turns handed back)", left, done)
		}
	})
}
