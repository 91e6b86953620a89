package main

import (
	"slices"
	"testing"
)

func TestSummarise(t *testing.T) {
	samples := []sample{{Total: 3}, {Total: 1}, {Total: 2}, {Total: 5}}
	got := summarise(samples, func(s sample) float64 { return s.Total })
	if !slices.Equal(got.Runs, []float64{3, 1, 2, 5}) || got.Median != 2.5 || got.Worst != 5 {
		t.Errorf("summarise = %+v, want runs in order, median 2.5, worst 5", got)
	}
}
