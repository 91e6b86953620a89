package spans

import (
	"slices"
	"testing"
)

func TestSpansAdd(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		adds []Span
		want Set
	}{
		{"empty range ignored", []Span{{5, 5}}, nil},
		{"in order merges", []Span{{0, 10}, {10, 20}}, Set{{0, 20}}},
		{"gap kept", []Span{{0, 10}, {20, 30}}, Set{{0, 10}, {20, 30}}},
		{"fills gap", []Span{{0, 10}, {20, 30}, {10, 20}}, Set{{0, 30}}},
		{"out of order", []Span{{20, 30}, {0, 5}}, Set{{0, 5}, {20, 30}}},
		{"overlap swallows several", []Span{{0, 2}, {4, 6}, {8, 10}, {1, 9}}, Set{{0, 10}}},
		{"inside existing", []Span{{0, 10}, {3, 4}}, Set{{0, 10}}},
		{"extends left", []Span{{10, 20}, {5, 12}}, Set{{5, 20}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s Set
			for _, a := range tc.adds {
				s.Add(a.Start, a.End)
			}
			if !slices.Equal(s, tc.want) {
				t.Errorf("got %v, want %v", s, tc.want)
			}
		})
	}
}

func TestSpansContiguous(t *testing.T) {
	t.Parallel()
	s := Set{{0, 10}, {20, 30}}
	for _, tc := range []struct{ off, want int64 }{
		{0, 10}, {5, 10}, {10, 10}, {15, 15}, {20, 30}, {29, 30}, {30, 30},
	} {
		if got := s.Contiguous(tc.off); got != tc.want {
			t.Errorf("contiguous(%d): got %d, want %d", tc.off, got, tc.want)
		}
	}
}

func TestSpansRemove(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		s      Set
		remove Span
		want   Set
	}{
		{"empty set", nil, Span{0, 10}, nil},
		{"empty range", Set{{0, 10}}, Span{5, 5}, Set{{0, 10}}},
		{"whole range", Set{{0, 10}, {20, 30}}, Span{0, 10}, Set{{20, 30}}},
		{"middle splits", Set{{0, 30}}, Span{10, 20}, Set{{0, 10}, {20, 30}}},
		{"head", Set{{0, 30}}, Span{0, 10}, Set{{10, 30}}},
		{"tail", Set{{0, 30}}, Span{20, 30}, Set{{0, 20}}},
		{"in a gap", Set{{0, 10}, {20, 30}}, Span{10, 20}, Set{{0, 10}, {20, 30}}},
		{"across ranges", Set{{0, 10}, {20, 30}, {40, 50}}, Span{5, 45}, Set{{0, 5}, {45, 50}}},
		{"covers all", Set{{0, 10}, {20, 30}}, Span{0, 30}, nil},
		{"past the last", Set{{0, 10}}, Span{10, 20}, Set{{0, 10}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := slices.Clone(tc.s)
			s.Remove(tc.remove.Start, tc.remove.End)
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
	s := Set{{0, 10}, {20, 30}}
	for _, tc := range []struct{ off, start, end int64 }{
		{0, 0, 10}, {9, 0, 10}, {10, 10, 10}, {15, 15, 15}, {20, 20, 30}, {29, 20, 30}, {30, 30, 30},
	} {
		if a, z := s.Covering(tc.off); a != tc.start || z != tc.end {
			t.Errorf("covering(%d): got [%d, %d), want [%d, %d)", tc.off, a, z, tc.start, tc.end)
		}
	}
	if a, z := Set(nil).Covering(5); a != 5 || z != 5 {
		t.Errorf("covering(5) of nothing: got [%d, %d), want [5, 5)", a, z)
	}
}
