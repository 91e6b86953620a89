package benchrun

import (
	"os"
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
