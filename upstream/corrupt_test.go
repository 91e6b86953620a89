package upstream

import (
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// fakeClock is a clock tests move by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

func newClockedRegistry(t *testing.T, clock *fakeClock, endpoints ...string) *Registry {
	t.Helper()
	r, err := New(testUpstream, endpoints, WithLogger(discardLogger), WithClock(clock.now))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return r
}

var errBadBytes = errors.New("the bytes received hash to sha256:0000: digest mismatch")

// TestCorruptBackoffSchedule: an endpoint that served a blob corrupt is
// kept from it 1 minute after the first failure, then 2, 4, 8, 16 and at
// most 30 minutes after each failure in a row; it is asked again at its
// retry time, not a second before; and a failure long after the last
// starts the schedule over.
func TestCorruptBackoffSchedule(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		// late: how long after the endpoint's retry time (or, first, now)
		// each failure in a row happens.
		late []time.Duration
		want time.Duration
	}{
		{"first failure", []time.Duration{0}, time.Minute},
		{"second", []time.Duration{0, 0}, 2 * time.Minute},
		{"third", []time.Duration{0, 0, 0}, 4 * time.Minute},
		{"fourth", []time.Duration{0, 0, 0, 0}, 8 * time.Minute},
		{"fifth", []time.Duration{0, 0, 0, 0, 0}, 16 * time.Minute},
		{"sixth: capped", []time.Duration{0, 0, 0, 0, 0, 0}, 30 * time.Minute},
		{"tenth: capped", []time.Duration{0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 30 * time.Minute},
		{"second, asked late", []time.Duration{0, 10 * time.Minute}, 2 * time.Minute},
		{"after an hour untried, anew", []time.Duration{0, 0, 0, 2 * time.Hour}, time.Minute},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			clock := newFakeClock()
			r := newClockedRegistry(t, clock, "https://a.example")
			ep := r.Endpoints()[0]
			d := digest.FromString(tt.name)
			at := clock.now()
			for _, late := range tt.late {
				at = at.Add(late)
				clock.set(at)
				if _, err := r.usableFor("org/app", d); err != nil {
					t.Fatalf("at its retry time: got %v, want the endpoint asked", err)
				}
				r.ReportCorrupt(d, fetchedFrom(ep), errBadBytes)
				st := r.Status().Corrupt
				if len(st) != 1 {
					t.Fatalf("status: got %d corrupt entries, want 1", len(st))
				}
				at = st[0].RetryAt
			}
			failedAt := clock.now()
			st := r.Status().Corrupt[0]
			if got := st.RetryAt.Sub(failedAt); got != tt.want {
				t.Errorf("wait: got %v, want %v", got, tt.want)
			}
			if st.Digest != d || st.Endpoint != ep || st.LastError != errBadBytes.Error() {
				t.Errorf("status: got %+v, want %s at %s, %q", st, d, ep, errBadBytes)
			}
			clock.set(failedAt.Add(tt.want - time.Second))
			_, err := r.usableFor("org/app", d)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "pullproxy forget "+d.String()) ||
				!strings.Contains(err.Error(), errBadBytes.Error()) {
				t.Errorf("a second before the retry time: got %v, want ErrInvalid with the cause and the fix", err)
			}
			clock.set(failedAt.Add(tt.want))
			if eps, err := r.usableFor("org/app", d); err != nil || len(eps) != 1 {
				t.Errorf("at the retry time: got %d endpoints, %v; want the endpoint asked", len(eps), err)
			}
		})
	}
}

// TestCorruptBackoffCleared: a verified fetch from an endpoint ends its wait
// for that blob only; Forget ends every endpoint's wait for the blob,
// returns what it ended, and the next failure starts the schedule anew.
func TestCorruptBackoffCleared(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	r := newClockedRegistry(t, clock, "https://a.example", "https://b.example")
	a, b := r.Endpoints()[0], r.Endpoints()[1]
	d1, d2 := digest.FromString("one"), digest.FromString("two")
	for range 3 { // waits of 1, 2 and 4 minutes
		r.ReportCorrupt(d1, fetchedFrom(a), errBadBytes)
		r.ReportCorrupt(d1, fetchedFrom(b), errBadBytes)
	}
	r.ReportCorrupt(d2, fetchedFrom(a), errBadBytes)
	if _, err := r.usableFor("org/app", d1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("d1 served corrupt by both: got %v, want ErrInvalid", err)
	}

	r.ReportVerified(d1, fetchedFrom(a))
	if eps, err := r.usableFor("org/app", d1); err != nil || len(eps) != 1 || eps[0].url.Redacted() != a {
		t.Errorf("d1 after verifying at a: got %v, %v; want a only", eps, err)
	}
	if got := len(r.Status().Corrupt); got != 2 {
		t.Errorf("entries after verifying d1 at a: got %d, want 2 (d1 at b, d2 at a)", got)
	}

	if got := r.Forget(digest.FromString("never corrupt")); len(got) != 0 {
		t.Errorf("Forget of a digest never corrupt: got %v, want nothing", got)
	}
	got := r.Forget(d1)
	if len(got) != 1 || got[0].Digest != d1 || got[0].Endpoint != b || got[0].Failures != 3 {
		t.Errorf("Forget(d1): got %+v, want d1 at b after 3 failures", got)
	}
	if eps, err := r.usableFor("org/app", d1); err != nil || len(eps) != 2 {
		t.Errorf("d1 after Forget: got %d endpoints, %v; want both", len(eps), err)
	}
	if st := r.Status().Corrupt; len(st) != 1 || st[0].Digest != d2 {
		t.Errorf("entries after Forget(d1): got %+v, want d2's only", st)
	}

	r.ReportCorrupt(d1, fetchedFrom(b), errBadBytes)
	if st := r.Status().Corrupt; len(st) != 2 || st[0].Digest != d1 && st[1].Digest != d1 {
		t.Fatalf("entries after d1 failed again: got %+v", st)
	}
	for _, st := range r.Status().Corrupt {
		if st.Digest == d1 && (st.Failures != 1 || st.RetryAt.Sub(clock.now()) != time.Minute) {
			t.Errorf("d1 failing after Forget: got %d failures, retry in %v; want 1, 1m0s", st.Failures, st.RetryAt.Sub(clock.now()))
		}
	}
	if got := r.Forget(d2); len(got) != 1 || got[0].Endpoint != a {
		t.Errorf("Forget(d2): got %+v, want d2 at a", got)
	}
}

// fetchedFrom is the report of a fetch whose bytes came from endpoints,
// without the ranges each brought.
func fetchedFrom(endpoints ...string) FetchReport {
	var rep FetchReport
	for _, ep := range endpoints {
		rep.Sources = append(rep.Sources, SourceShare{Endpoint: ep})
	}
	return rep
}

// covering is the report of a fetch in which each endpoint's answers
// covered the ranges given, as pairs of offsets.
func covering(bySource map[string][]int64) FetchReport {
	var rep FetchReport
	for ep, offs := range bySource {
		src := SourceShare{Endpoint: ep}
		for i := 0; i+1 < len(offs); i += 2 {
			src.Spans.Add(offs[i], offs[i+1])
			src.Bytes += offs[i+1] - offs[i]
		}
		rep.Sources = append(rep.Sources, src)
	}
	return rep
}

// TestCorruptSuspects: a blob that fails verification with bytes from
// several endpoints has the ranges of the endpoint that brought the fewest
// fetched again from the others, that endpoint left out of the next fetch;
// if the digest then matches, it is to blame; if not, the next is
// suspected, with what each brought before kept in mind, until one
// endpoint brought every byte (it is to blame) or none is left (the blob
// comes from one endpoint at a time).
func TestCorruptSuspects(t *testing.T) {
	t.Parallel()
	const a, b, c = "https://a.example", "https://b.example", "https://c.example"
	type round struct {
		fetched  map[string][]int64 // what this fetch's sources covered
		verified bool               // the digest matched this time
		wantOut  string             // left out of the next fetch
		wantRedo []int64            // ranges returned to fetch again
	}
	tests := []struct {
		name      string
		endpoints []string
		rounds    []round
		wantBlame []string // kept from the blob at the end
		wantAlone bool     // the blob comes from one endpoint at a time
	}{
		{"the one with fewer is corrupt", []string{a, b}, []round{
			{fetched: map[string][]int64{a: {0, 300}, b: {300, 1000}}, wantOut: a, wantRedo: []int64{0, 300}},
			{fetched: map[string][]int64{b: {0, 300}}, verified: true},
		}, []string{a}, false},
		{"the one with more is corrupt", []string{a, b}, []round{
			{fetched: map[string][]int64{a: {0, 300}, b: {300, 1000}}, wantOut: a, wantRedo: []int64{0, 300}},
			{fetched: map[string][]int64{b: {0, 300}}}, // every byte is b's now
		}, []string{b}, false},
		{"three, the second suspected is corrupt", []string{a, b, c}, []round{
			{fetched: map[string][]int64{a: {0, 100, 500, 600}, b: {100, 300}, c: {300, 500, 600, 1000}}, wantOut: a, wantRedo: []int64{0, 100, 500, 600}},
			// b brought more of a's ranges: b's are 0-100 and 100-300 now.
			{fetched: map[string][]int64{b: {0, 100}, c: {500, 600}}, wantOut: b, wantRedo: []int64{0, 300}},
			{fetched: map[string][]int64{a: {0, 150}, c: {150, 300}}, verified: true},
		}, []string{b}, false},
		{"no ranges reported", []string{a, b}, []round{
			{fetched: map[string][]int64{a: nil, b: nil}},
		}, nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := newClockedRegistry(t, newFakeClock(), tt.endpoints...)
			d := digest.FromString(tt.name)
			for i, rd := range tt.rounds {
				rep := covering(rd.fetched)
				if rd.verified {
					r.ReportVerified(d, rep)
					continue
				}
				redo := r.ReportCorrupt(d, rep, errBadBytes)
				var got []int64
				for _, sp := range redo {
					got = append(got, sp.Start, sp.End)
				}
				if !slices.Equal(got, rd.wantRedo) {
					t.Errorf("round %d: ranges to fetch again: got %v, want %v", i+1, got, rd.wantRedo)
				}
				eps, err := r.usableFor("org/app", d)
				if err != nil {
					t.Fatalf("round %d: usableFor: %v", i+1, err)
				}
				for _, ep := range eps {
					if ep.url.Redacted() == rd.wantOut {
						t.Errorf("round %d: %s is asked for the blob, want it left out", i+1, rd.wantOut)
					}
				}
				if rd.wantOut != "" && len(eps) != len(tt.endpoints)-1 {
					t.Errorf("round %d: got %d endpoints asked, want all but %s", i+1, len(eps), rd.wantOut)
				}
			}
			var blamed []string
			for _, st := range r.Status().Corrupt {
				blamed = append(blamed, st.Endpoint)
			}
			if !slices.Equal(blamed, tt.wantBlame) {
				t.Errorf("kept from the blob: got %v, want %v", blamed, tt.wantBlame)
			}
			if got := r.corrupt.alone(d, r.now()); got != tt.wantAlone {
				t.Errorf("one endpoint at a time: got %v, want %v", got, tt.wantAlone)
			}
			if got := r.corrupt.suspected(d, r.now()); got != "" {
				t.Errorf("suspected at the end: got %s, want none", got)
			}
		})
	}
}
