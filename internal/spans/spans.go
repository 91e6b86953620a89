// Package spans keeps sets of byte ranges: what of a blob is written, claimed,
// or brought by whom.
package spans

import "slices"

// Span is the half-open byte range [start, end).
type Span struct{ Start, End int64 }

// Set is a sorted set of disjoint, non-adjacent byte ranges.
type Set []Span

// Add inserts [start, end), merging it with ranges it touches.
func (s *Set) Add(start, end int64) {
	if start >= end {
		return
	}
	r := *s
	// First range that ends at or after start: everything before it is untouched.
	i, _ := slices.BinarySearchFunc(r, start, func(x Span, t int64) int {
		switch {
		case x.End < t:
			return -1
		case x.End > t:
			return 1
		}
		return 0
	})
	j := i
	for j < len(r) && r[j].Start <= end {
		start = min(start, r[j].Start)
		end = max(end, r[j].End)
		j++
	}
	*s = slices.Replace(r, i, j, Span{start, end})
}

// Contiguous returns the end of the range covering off, or off if none does.
func (s Set) Contiguous(off int64) int64 {
	for _, x := range s {
		if x.Start > off {
			break
		}
		if off < x.End {
			return x.End
		}
	}
	return off
}

// Covering returns the range that covers off, or off, off if none does.
func (s Set) Covering(off int64) (start, end int64) {
	i, found := slices.BinarySearchFunc(s, off, func(x Span, t int64) int {
		switch {
		case x.End <= t:
			return -1
		case x.Start > t:
			return 1
		}
		return 0
	})
	if !found {
		return off, off
	}
	return s[i].Start, s[i].End
}

// Gap returns the first range at or after off, below size, that s does not
// cover, as [start, end); start == end when there is none.
func (s Set) Gap(off, size int64) (start, end int64) {
	start = off
	for _, x := range s {
		if x.End <= start {
			continue
		}
		if x.Start <= start {
			start = x.End
			continue
		}
		return start, min(x.Start, size)
	}
	if start >= size {
		return size, size
	}
	return start, size
}

// Total returns the number of bytes covered.
func (s Set) Total() int64 {
	var n int64
	for _, x := range s {
		n += x.End - x.Start
	}
	return n
}

// Gaps appends to dst the parts of [start, end) that s does not cover, in
// order.
func (s Set) Gaps(dst []Span, start, end int64) []Span {
	out := dst
	for start < end {
		a, b := s.Gap(start, end)
		if a >= b {
			break
		}
		out = append(out, Span{a, b})
		start = b
	}
	return out
}

// Remove deletes [start, end) from s, splitting a range that straddles it.
func (s *Set) Remove(start, end int64) {
	if start >= end {
		return
	}
	r := *s
	// First range that ends after start: everything before it is untouched.
	i, _ := slices.BinarySearchFunc(r, start, func(x Span, t int64) int {
		if x.End <= t {
			return -1
		}
		return 1
	})
	j := i
	for j < len(r) && r[j].Start < end {
		j++
	}
	if i == j {
		return
	}
	left, right := Span{r[i].Start, start}, Span{end, r[j-1].End}
	switch {
	case left.Start < left.End && right.Start < right.End:
		*s = slices.Replace(r, i, j, left, right)
	case left.Start < left.End:
		*s = slices.Replace(r, i, j, left)
	case right.Start < right.End:
		*s = slices.Replace(r, i, j, right)
	default:
		*s = slices.Delete(r, i, j)
	}
}
