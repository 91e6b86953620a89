package storage

import "slices"

// span is the half-open byte range [start, end).
type span struct{ start, end int64 }

// spans is a sorted set of disjoint, non-adjacent byte ranges.
type spans []span

// add inserts [start, end), merging it with ranges it touches.
func (s *spans) add(start, end int64) {
	if start >= end {
		return
	}
	r := *s
	// First range that ends at or after start: everything before it is untouched.
	i, _ := slices.BinarySearchFunc(r, start, func(x span, t int64) int {
		switch {
		case x.end < t:
			return -1
		case x.end > t:
			return 1
		}
		return 0
	})
	j := i
	for j < len(r) && r[j].start <= end {
		start = min(start, r[j].start)
		end = max(end, r[j].end)
		j++
	}
	*s = slices.Replace(r, i, j, span{start, end})
}

// contiguous returns the end of the range covering off, or off if none does.
func (s spans) contiguous(off int64) int64 {
	for _, x := range s {
		if x.start > off {
			break
		}
		if off < x.end {
			return x.end
		}
	}
	return off
}
