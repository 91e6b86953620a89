package upstream

import (
	"errors"
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
				r.ReportCorrupt(d, []string{ep}, errBadBytes)
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
		r.ReportCorrupt(d1, []string{a}, errBadBytes)
		r.ReportCorrupt(d1, []string{b}, errBadBytes)
	}
	r.ReportCorrupt(d2, []string{a}, errBadBytes)
	if _, err := r.usableFor("org/app", d1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("d1 served corrupt by both: got %v, want ErrInvalid", err)
	}

	r.ReportVerified(d1, []string{a})
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

	r.ReportCorrupt(d1, []string{b}, errBadBytes)
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
