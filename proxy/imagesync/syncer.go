package imagesync

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
)

// StateStore keeps each rule's state on this replica (the store's
// metadata): what it keeps cached is pinned from the start, before a
// round, and is not fetched again unless it moved.
type StateStore interface {
	SyncState(ctx context.Context, rule string) (json.RawMessage, error)
	PutSyncState(ctx context.Context, rule string, state json.RawMessage) error
}

// Turns lets replicas that share a bucket take turns at a rule's rounds,
// so that one replica at a time runs it; the state a round leaves goes
// with the turn to the next replica.
type Turns interface {
	// TakeTurn takes the turn named name, or returns ErrTurnTaken (another
	// replica holds it), or ErrTurnNotWanted (want, given the state the
	// last holder left, declined it). Any other error: the bucket cannot
	// say, and the replica syncs alone.
	TakeTurn(ctx context.Context, name string, want func(state []byte) bool) (Turn, error)
}

// Turn is a turn held: the state its last holder left, a channel closed
// once it is lost, and Done to hand it on with this round's state.
type Turn interface {
	State() []byte
	Lost() <-chan struct{}
	Done(ctx context.Context, state []byte) error
}

var (
	// ErrTurnTaken: another replica is running the rule's round.
	ErrTurnTaken = errors.New("another replica is running this rule's round")
	// ErrTurnNotWanted: another replica ran the rule's round since this
	// one last looked.
	ErrTurnNotWanted = errors.New("another replica ran this rule's round lately")
)

// Syncer runs the sync rules: a loop per rule, each round over the
// repositories it names, each round's state kept for the next one.
type Syncer struct {
	rules   []*ruleRun
	log     *slog.Logger
	state   StateStore // nil: kept in memory only
	turns   Turns      // nil: no bucket shared with other replicas
	guard   func(ctx context.Context, upstreamName string) error
	metrics *metrics
	wrap    func(context.Context) context.Context
	replica string // as named in the state handed between replicas
}

// Option configures a Syncer.
type Option func(*Syncer)

// WithLogger sets where rounds are logged (default: slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(s *Syncer) { s.log = l } }

// WithStateStore keeps each rule's state in st across restarts (default:
// in memory only).
func WithStateStore(st StateStore) Option { return func(s *Syncer) { s.state = st } }

// WithTurns has replicas sharing a bucket take turns at each rule
// (default: every round runs here).
func WithTurns(t Turns) Option { return func(s *Syncer) { s.turns = t } }

// WithFetchGuard has each image's fetch asked first of guard, which
// refuses it (with the reason) while the upstream's rate-limit window is
// nearly spent: what is left is for clients. Default: none.
func WithFetchGuard(guard func(ctx context.Context, upstreamName string) error) Option {
	return func(s *Syncer) { s.guard = guard }
}

// WithFetchContext has each image fetched under wrap(ctx): the caller
// marks it as background work, below what clients wait for.
func WithFetchContext(wrap func(context.Context) context.Context) Option {
	return func(s *Syncer) { s.wrap = wrap }
}

// WithMetrics registers the rules' metrics with m (default: none).
func WithMetrics(m *Metrics) Option {
	return func(s *Syncer) {
		if m != nil {
			s.metrics = m.m
		}
	}
}

// ruleRun is a rule and what its rounds found.
type ruleRun struct {
	sel  *Selector
	id   string // stable across restarts and replicas: the rule's hash
	name string // as logged and labelled: upstream/repository

	mu     sync.Mutex
	state  ruleState
	seen   int64 // state.Rounds when this replica last looked; -1: never
	status RuleStatus
	// fetching are the images the round in progress fetches: pinned from
	// the start, or eviction, which a fetch into a full store sets off,
	// could take the blobs committed first before the round keeps them.
	fetching []Image
}

// ruleState is what a rule keeps, as recorded locally and handed on with
// the bucket's turn.
type ruleState struct {
	Repositories map[string]Kept `json:"repositories"`
	Rounds       int64           `json:"rounds"`       // rounds completed, by any replica
	Last         time.Time       `json:"last"`         // when the last round ended, by its replica's clock
	By           string          `json:"by,omitempty"` // the replica that ran it
	LastError    string          `json:"lastError,omitempty"`
}

// RuleStatus is a rule's state as status shows it.
type RuleStatus struct {
	Rule         string        `json:"rule"` // upstream/repository
	Interval     time.Duration `json:"interval"`
	Rounds       int64         `json:"rounds"`
	LastRound    time.Time     `json:"lastRound,omitzero"`
	LastBy       string        `json:"lastBy,omitempty"` // when replicas share a bucket: which ran it
	LastDuration time.Duration `json:"lastDuration"`
	LastError    string        `json:"lastError,omitempty"`
	Failures     int           `json:"failures"` // rounds failed in a row here
	Repositories int           `json:"repositories"`
	TagsCached   int           `json:"tagsCached"`
	FetchedBytes int64         `json:"fetchedBytes"` // by this replica's rounds since it started
	NextRound    time.Time     `json:"nextRound,omitzero"`
	Running      bool          `json:"running"`
}

// Image is an image a rule keeps cached: what eviction leaves alone.
type Image struct {
	Upstream, Repository string
	Digest               digest.Digest
}

// New compiles rules and reads what each kept when last run here. replica
// names this process in the state handed between replicas.
func New(ctx context.Context, rules []Rule, replica string, opts ...Option) (*Syncer, error) {
	s := &Syncer{log: slog.Default(), replica: replica}
	for _, o := range opts {
		o(s)
	}
	names := map[string]int{}
	ids := map[string]bool{}
	for i, r := range rules {
		sel, err := Compile(r)
		if err != nil {
			return nil, fmt.Errorf("sync rule %d (%s/%s): %w", i+1, r.Upstream, r.Repository, err)
		}
		id := ruleID(sel.Rule())
		if ids[id] {
			return nil, fmt.Errorf("sync rule %d (%s/%s): the same as an earlier one", i+1, r.Upstream, r.Repository)
		}
		ids[id] = true
		name := r.Upstream + "/" + r.Repository
		if names[name]++; names[name] > 1 {
			name = fmt.Sprintf("%s#%d", name, names[name])
		}
		run := &ruleRun{sel: sel, id: id, name: name, seen: -1,
			state: ruleState{Repositories: map[string]Kept{}}}
		run.status = RuleStatus{Rule: name, Interval: sel.Rule().Interval}
		if s.state != nil {
			raw, err := s.state.SyncState(ctx, id)
			switch {
			case errors.Is(err, storage.ErrNotFound):
			case err != nil:
				return nil, err
			default:
				run.adoptLocked(raw)
			}
		}
		s.rules = append(s.rules, run)
	}
	for _, r := range s.rules {
		s.metrics.observe(r)
	}
	return s, nil
}

// ruleID names a rule by what it picks, not how often: a changed interval
// keeps what the rule cached.
func ruleID(r Rule) string {
	r.Interval = 0
	b, _ := json.Marshal(r)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// adoptLocked takes raw as the rule's state, if it reads. Called with mu
// held (or before the rule runs).
func (r *ruleRun) adoptLocked(raw []byte) {
	var st ruleState
	if len(raw) > 0 && json.Unmarshal(raw, &st) == nil {
		r.setLocked(st)
	}
}

// setLocked makes st the rule's state. Called with mu held.
func (r *ruleRun) setLocked(st ruleState) {
	if st.Repositories == nil {
		st.Repositories = map[string]Kept{}
	}
	r.state = st
	r.status.Rounds, r.status.LastRound, r.status.LastBy, r.status.LastError = st.Rounds, st.Last, st.By, st.LastError
	r.status.Repositories, r.status.TagsCached = len(st.Repositories), st.tags()
}

// Images returns the images the rules keep cached now; none for a nil s.
func (s *Syncer) Images() []Image {
	if s == nil {
		return nil
	}
	var out []Image
	for _, r := range s.rules {
		r.mu.Lock()
		for repo, kept := range r.state.Repositories {
			for _, d := range kept {
				out = append(out, Image{Upstream: r.sel.Rule().Upstream, Repository: repo, Digest: d})
			}
		}
		out = append(out, r.fetching...)
		r.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b Image) int {
		return cmp.Or(cmp.Compare(a.Upstream, b.Upstream), cmp.Compare(a.Repository, b.Repository), cmp.Compare(a.Digest, b.Digest))
	})
	return slices.Compact(out)
}

// Status returns each rule's state, in the configuration's order.
func (s *Syncer) Status() []RuleStatus {
	out := make([]RuleStatus, 0, len(s.rules))
	for _, r := range s.rules {
		r.mu.Lock()
		out = append(out, r.status)
		r.mu.Unlock()
	}
	return out
}

// Run runs every rule's rounds over core until ctx ends. It never holds
// anything else back: serving goes on whatever the rounds do.
func (s *Syncer) Run(ctx context.Context, core Core) {
	var wg sync.WaitGroup
	for _, r := range s.rules {
		wg.Go(func() { s.loop(ctx, core, r) })
	}
	wg.Wait()
}

// loop runs r's rounds: the first soon after start, spread so that rules
// and replicas do not all ask at once, then one an interval after the
// last, sooner after a failure (backing off), later when the upstream
// says to wait.
func (s *Syncer) loop(ctx context.Context, core Core, r *ruleRun) {
	interval := r.sel.Rule().Interval
	wait := time.Duration(rand.Int64N(int64(min(interval/10, 10*time.Second)) + 1))
	for {
		r.mu.Lock()
		r.status.NextRound = time.Now().Add(wait)
		r.mu.Unlock()
		s.metrics.next(r, time.Now().Add(wait))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = s.round(ctx, core, r)
	}
}

// round runs one round of r, if it is this replica's turn, and returns
// the wait until the next.
func (s *Syncer) round(ctx context.Context, core Core, r *ruleRun) time.Duration {
	interval := r.sel.Rule().Interval
	turn, ok := s.takeTurn(ctx, r)
	if !ok {
		return jitter(interval)
	}
	roundCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	if turn != nil {
		go func() {
			select {
			case <-turn.Lost():
				cancel() // another replica runs the rule now
			case <-roundCtx.Done():
			}
		}()
	}
	start := time.Now()
	before := r.begin()
	repos, fetched, err := s.syncRule(roundCtx, core, r, before.Repositories)
	took := time.Since(start)
	log := s.log.With("rule", r.name)
	switch {
	case ctx.Err() != nil:
		// Shutting down: what the round got so far is kept, and the turn
		// handed on, but it is no failure.
		s.record(ctx, r, turn, r.end(before, repos, fetched, nil, took, s.replica))
		return 0
	case roundCtx.Err() != nil:
		r.abandon()
		log.Info("lost the sync rule's turn mid-round: another replica runs it", "fetched_bytes", fetched.bytes)
		s.metrics.round(r, "other_replica")
		return jitter(interval)
	}
	st := r.end(before, repos, fetched, err, took, s.replica)
	s.record(ctx, r, turn, st)
	s.metrics.addFetched(r, fetched.bytes)
	s.metrics.observe(r)
	if err != nil {
		s.metrics.round(r, "failed")
		failures := r.failures()
		wait := backoff(interval, failures, err)
		log.Warn("sync round failed: the images kept stay cached and pinned; trying again",
			"err", err, "fix", fix(err), "failures_in_a_row", failures, "retry_in", wait.Round(time.Second),
			"fetched_tags", fetched.tags, "fetched_bytes", fetched.bytes, "took", took.Round(time.Millisecond))
		return wait
	}
	s.metrics.round(r, "ok")
	log.Info("sync round", "repositories", len(repos), "tags_cached", st.tags(), "fetched_tags", fetched.tags,
		"dropped_tags", fetched.dropped, "fetched_bytes", fetched.bytes, "took", took.Round(time.Millisecond))
	return jitter(interval)
}

// takeTurn takes r's turn in the shared bucket, if replicas share one,
// and takes the state the last holder left. It reports false when this
// replica is not to run the round: another runs it, or ran one lately.
// Without a bucket, or when it cannot say, the round runs here (nil turn).
func (s *Syncer) takeTurn(ctx context.Context, r *ruleRun) (Turn, bool) {
	if s.turns == nil {
		return nil, true
	}
	t, err := s.turns.TakeTurn(ctx, "sync/"+r.id, r.wantTurn)
	switch {
	case errors.Is(err, ErrTurnTaken), errors.Is(err, ErrTurnNotWanted):
		s.log.Debug("sync round left to another replica", "rule", r.name, "why", err)
		s.metrics.round(r, "other_replica")
		s.metrics.observe(r)
		return nil, false
	case err != nil:
		s.log.Warn("the shared bucket cannot say which replica syncs this rule: syncing here", "rule", r.name, "err", err)
		return nil, true
	}
	r.mu.Lock()
	r.adoptLocked(t.State())
	r.mu.Unlock()
	return t, true
}

// begin marks a round of r as running and returns the state it starts
// from.
func (r *ruleRun) begin() ruleState {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.status.Running = true
	return r.state
}

// end records the round's outcome: the state it leaves (repos kept, the
// round counted), and, when err is set, one more failure in a row. It
// returns that state. The images the round fetched are pinned by the
// state from now on, or not at all.
func (r *ruleRun) end(before ruleState, repos map[string]Kept, fetched fetchedTotals, err error, took time.Duration, replica string) ruleState {
	st := ruleState{Repositories: repos, Rounds: before.Rounds + 1, Last: time.Now(), By: replica}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.status.Running = false
	r.status.LastDuration = took
	r.status.FetchedBytes += fetched.bytes
	if err != nil {
		st.LastError = err.Error()
		r.status.Failures++
	} else {
		r.status.Failures = 0
	}
	r.setLocked(st)
	r.fetching = nil
	r.seen = st.Rounds
	return st
}

// abandon ends a round whose turn was lost: its state is the new
// holder's to write.
func (r *ruleRun) abandon() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.status.Running = false
	r.fetching = nil
}

// record keeps st here and hands it on with the turn.
func (s *Syncer) record(ctx context.Context, r *ruleRun, turn Turn, st ruleState) {
	raw := mustJSON(st)
	if s.state != nil {
		if err := s.state.PutSyncState(context.WithoutCancel(ctx), r.id, raw); err != nil {
			s.log.Warn("recording the sync rule's state: the next start fetches again what moved", "rule", r.name, "err", err)
		}
	}
	if turn != nil {
		if err := turn.Done(context.WithoutCancel(ctx), raw); err != nil {
			s.log.Warn("handing on the sync rule's turn: another replica may run the next round from an older state",
				"rule", r.name, "err", err)
		}
	}
}

func (r *ruleRun) failures() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.status.Failures
}

// addFetching pins im until the round ends.
func (r *ruleRun) addFetching(im Image) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fetching = append(r.fetching, im)
}

// tags counts the tags st keeps, over every repository.
func (st ruleState) tags() int {
	n := 0
	for _, k := range st.Repositories {
		n += len(k)
	}
	return n
}

// wantTurn decides, given the state the last holder left, whether this
// replica runs the round: not when another ran one since this replica
// last looked (it takes that state instead). Clocks are not compared
// across replicas: only the count of rounds.
func (r *ruleRun) wantTurn(raw []byte) bool {
	var st ruleState
	if len(raw) > 0 && json.Unmarshal(raw, &st) != nil {
		return true // unreadable: this round writes a new one
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := r.seen
	r.seen = st.Rounds
	if seen >= 0 && st.Rounds != seen {
		r.adoptLocked(raw)
		return false
	}
	return true
}

// fetchedTotals is what a round fetched.
type fetchedTotals struct {
	tags    []string // repo:tag
	dropped []string
	bytes   int64
}

// syncRule runs one round over the repositories r names, from what they
// kept, and returns what they keep now. A repository that fails keeps what
// it had; the round then fails with the first cause, after the others ran.
func (s *Syncer) syncRule(ctx context.Context, core Core, r *ruleRun, kept map[string]Kept) (map[string]Kept, fetchedTotals, error) {
	rule := r.sel.Rule()
	var total fetchedTotals
	next := make(map[string]Kept, len(kept))
	repos := []string{rule.Repository}
	if r.sel.Prefix() {
		listed, err := core.Repositories(ctx, rule.Upstream, r.sel.prefix)
		if err != nil {
			return kept, total, err
		}
		repos = listed
	}
	counting := &countingCore{Core: core, guard: s.guard, wrap: s.wrap, fetching: r.addFetching}
	var errs []error
	for _, repo := range repos {
		if !r.sel.Repository(repo) {
			continue
		}
		k, round, err := SyncRepository(ctx, counting, r.sel, repo, kept[repo])
		if len(k) > 0 {
			next[repo] = k
		}
		for _, t := range round.Fetched {
			total.tags = append(total.tags, repo+":"+t)
		}
		for _, t := range round.Dropped {
			total.dropped = append(total.dropped, repo+":"+t)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, t := range slices.Sorted(maps.Keys(round.Failed)) {
			errs = append(errs, fmt.Errorf("%s/%s:%s: %w", rule.Upstream, repo, t, round.Failed[t]))
		}
	}
	total.bytes = counting.fetched.Load()
	if len(errs) > 0 {
		return next, total, errors.Join(errs...)
	}
	return next, total, nil
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // a ruleState always marshals
	}
	return b
}
