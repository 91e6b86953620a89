package storage

import (
	"slices"
	"testing"
)

func TestSpansAdd(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		adds []span
		want spans
	}{
		{"empty range ignored", []span{{5, 5}}, nil},
		{"in order merges", []span{{0, 10}, {10, 20}}, spans{{0, 20}}},
		{"gap kept", []span{{0, 10}, {20, 30}}, spans{{0, 10}, {20, 30}}},
		{"fills gap", []span{{0, 10}, {20, 30}, {10, 20}}, spans{{0, 30}}},
		{"out of order", []span{{20, 30}, {0, 5}}, spans{{0, 5}, {20, 30}}},
		{"overlap swallows several", []span{{0, 2}, {4, 6}, {8, 10}, {1, 9}}, spans{{0, 10}}},
		{"inside existing", []span{{0, 10}, {3, 4}}, spans{{0, 10}}},
		{"extends left", []span{{10, 20}, {5, 12}}, spans{{5, 20}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s spans
			for _, a := range tc.adds {
				s.add(a.start, a.end)
			}
			if !slices.Equal(s, tc.want) {
				t.Errorf("got %v, want %v", s, tc.want)
			}
		})
	}
}

func TestSpansContiguous(t *testing.T) {
	t.Parallel()
	s := spans{{0, 10}, {20, 30}}
	for _, tc := range []struct{ off, want int64 }{
		{0, 10}, {5, 10}, {10, 10}, {15, 15}, {20, 30}, {29, 30}, {30, 30},
	} {
		if got := s.contiguous(tc.off); got != tc.want {
			t.Errorf("contiguous(%d): got %d, want %d", tc.off, got, tc.want)
		}
	}
}

func TestSpansRemove(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		s      spans
		remove span
		want   spans
	}{
		{"empty set", nil, span{0, 10}, nil},
		{"empty range", spans{{0, 10}}, span{5, 5}, spans{{0, 10}}},
		{"whole range", spans{{0, 10}, {20, 30}}, span{0, 10}, spans{{20, 30}}},
		{"middle splits", spans{{0, 30}}, span{10, 20}, spans{{0, 10}, {20, 30}}},
		{"head", spans{{0, 30}}, span{0, 10}, spans{{10, 30}}},
		{"tail", spans{{0, 30}}, span{20, 30}, spans{{0, 20}}},
		{"in a gap", spans{{0, 10}, {20, 30}}, span{10, 20}, spans{{0, 10}, {20, 30}}},
		{"across ranges", spans{{0, 10}, {20, 30}, {40, 50}}, span{5, 45}, spans{{0, 5}, {45, 50}}},
		{"covers all", spans{{0, 10}, {20, 30}}, span{0, 30}, nil},
		{"past the last", spans{{0, 10}}, span{10, 20}, spans{{0, 10}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := slices.Clone(tc.s)
			s.remove(tc.remove.start, tc.remove.end)
			if len(s) == 0 && len(tc.want) == 0 {
				return
			}
			if !slices.Equal(s, tc.want) {
				t.Errorf("got %v, want %v", s, tc.want)
			}
		})
	}
}

func TestSpansCovering(t *testing.T) {
	t.Parallel()
	s := spans{{0, 10}, {20, 30}}
	for _, tc := range []struct{ off, start, end int64 }{
		{0, 0, 10}, {9, 0, 10}, {10, 10, 10}, {15, 15, 15}, {20, 20, 30}, {29, 20, 30}, {30, 30, 30},
	} {
		if a, z := s.covering(tc.off); a != tc.start || z != tc.end {
			t.Errorf("covering(%d): got [%d, %d), want [%d, %d)", tc.off, a, z, tc.start, tc.end)
		}
	}
	if a, z := spans(nil).covering(5); a != 5 || z != 5 {
		t.Errorf("covering(5) of nothing: got [%d, %d), want [5, 5)", a, z)
	}
}
