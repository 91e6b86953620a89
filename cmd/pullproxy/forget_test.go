package main

import (
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/upstream"
)

// TestCorruptShownWithFix: doctor shows each blob served corrupt, and fails
// the walk when the image needs the blob, with the fix naming pullproxy
// forget.
func TestCorruptShownWithFix(t *testing.T) {
	t.Parallel()
	now := time.Now()
	needed, unrelated := digest.FromString("a layer of the image"), digest.FromString("another image's")
	entries := []upstream.CorruptStatus{
		{Digest: needed, Endpoint: "https://a.test", Failures: 2, Since: now.Add(-time.Minute), RetryAt: now.Add(2 * time.Minute), LastError: "hash to sha256:0000"},
		{Digest: unrelated, Endpoint: "https://a.test", Failures: 1, Since: now.Add(-5 * time.Minute), RetryAt: now.Add(-4 * time.Minute)},
	}
	d := &doctorRun{imageBlobs: map[digest.Digest]bool{needed: true}}
	d.corrupt(entries, now)
	if len(d.steps) != 2 {
		t.Fatalf("doctor steps: got %+v, want 2", d.steps)
	}
	for i, want := range []string{"fail", "warn"} {
		s := d.steps[i]
		if s.Verdict != want || s.Where != "upstream" || !strings.Contains(s.Fix, "pullproxy forget "+entries[i].Digest.String()) {
			t.Errorf("doctor step %d: got %+v, want %s, upstream, the fix naming pullproxy forget", i, s, want)
		}
	}
}
