package benchrun

import (
	"os"
	"slices"
	"testing"
)

// TestReadCPUTime: this process's CPU time, read from /proc, grows as it
// spins and never goes back.
func TestReadCPUTime(t *testing.T) {
	before, err := ReadCPUTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for {
		after, err := ReadCPUTime(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		if after.User < before.User || after.Sys < before.Sys {
			t.Fatalf("CPU time went back: from %+v to %+v", before, after)
		}
		if after.Total() >= before.Total()+0.02 {
			return
		}
	}
}

func TestSummarise(t *testing.T) {
	for _, tt := range []struct {
		runs          []float64
		lowerIsWorse  bool
		median, worst float64
	}{
		{[]float64{3, 1, 2}, false, 2, 3},
		{[]float64{3, 1, 2, 5}, false, 2.5, 5},
		{[]float64{3, 1, 2}, true, 2, 1},
		{nil, false, 0, 0},
	} {
		got := Summarise(tt.runs, tt.lowerIsWorse)
		if got.Median != tt.median || got.Worst != tt.worst {
			t.Errorf("Summarise(%v, %v) = %+v, want median %v, worst %v", tt.runs, tt.lowerIsWorse, got, tt.median, tt.worst)
		}
	}
}

func TestRoundRatios(t *testing.T) {
	for _, tt := range []struct {
		a, b              []float64
		rounds            []float64
		median, low, high float64
		says              string
	}{
		{[]float64{2, 3, 4}, []float64{2, 2, 8}, []float64{1, 1.5, 0.5}, 1, 0.5, 1.5, "1.00x (0.50-1.50 over 3 rounds)"},
		{[]float64{2, 3, 4}, []float64{4}, []float64{0.5}, 0.5, 0.5, 0.5, "0.50x (0.50-0.50 over 1 round)"},
		{[]float64{2, 3}, []float64{0, 3}, []float64{1}, 1, 1, 1, "1.00x (1.00-1.00 over 1 round)"},
		{nil, []float64{1}, nil, 0, 0, 0, "no round measured both"},
	} {
		got := RoundRatios("a/b", tt.a, tt.b)
		if !slices.Equal(got.Rounds, tt.rounds) || got.Median != tt.median || got.Low != tt.low || got.High != tt.high {
			t.Errorf("RoundRatios(%v, %v) = %+v, want rounds %v, median %v, range %v-%v", tt.a, tt.b, got, tt.rounds, tt.median, tt.low, tt.high)
		}
		if got.String() != tt.says {
			t.Errorf("RoundRatios(%v, %v) says %q, want %q", tt.a, tt.b, got, tt.says)
		}
	}
}
