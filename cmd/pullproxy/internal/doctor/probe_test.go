package doctor

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/upstream"
)

// TestSummarize: sessions cut after carrying bytes are counted, their cut
// points ranged and binned, and a budget below them is proposed.
func TestSummarize(t *testing.T) {
	t.Parallel()
	var results []upstream.SessionResult
	for i := range 10 {
		results = append(results, upstream.SessionResult{Outcome: "reset", Bytes: int64(2<<20 + i<<10), Took: time.Second})
	}
	results = append(results, upstream.SessionResult{Outcome: "complete", Bytes: 16 << 20, Took: time.Second})
	s, err := Summarize("https://a.test/blob", results)
	if err != nil {
		t.Fatal(err)
	}
	if s.Sessions != 11 || s.Cut != 10 || s.Outcomes["reset"] != 10 || s.Outcomes["complete"] != 1 {
		t.Errorf("got %d sessions, %d cut, outcomes %v; want 11, 10, 10 reset and 1 complete", s.Sessions, s.Cut, s.Outcomes)
	}
	if s.CutMin != 2<<20 || s.CutMax != 2<<20+9<<10 {
		t.Errorf("cut points: got %d to %d, want %d to %d", s.CutMin, s.CutMax, 2<<20, 2<<20+9<<10)
	}
	binned := 0
	for _, b := range s.Hist {
		binned += b.Count
	}
	if binned != 10 {
		t.Errorf("the histogram holds %d cuts, want 10", binned)
	}
	if s.Budget <= 0 || s.Budget >= s.CutMin {
		t.Errorf("budget %d, want one below the cuts (%d)", s.Budget, s.CutMin)
	}
	var out bytes.Buffer
	WriteProbe(&out, s)
	if !strings.Contains(out.String(), "cut after carrying bytes: 10 of 11") {
		t.Errorf("the report says\n%s\nwant it to count the cuts", out.String())
	}
}

func TestExitCode(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		steps []Step
		want  int
	}{
		{[]Step{{Verdict: "ok"}, {Verdict: "warn", Where: "here"}}, 0},
		{[]Step{{Verdict: "fail", Where: "upstream"}}, FixUpstream},
		{[]Step{{Verdict: "fail", Where: "upstream"}, {Verdict: "fail", Where: "here"}}, FixHere},
	} {
		if got := ExitCode(tt.steps); got != tt.want {
			t.Errorf("ExitCode(%+v): got %d, want %d", tt.steps, got, tt.want)
		}
	}
}
