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

// covering returns the range that covers off, or off, off if none does.
func (s spans) covering(off int64) (start, end int64) {
	i, found := slices.BinarySearchFunc(s, off, func(x span, t int64) int {
		switch {
		case x.end <= t:
			return -1
		case x.start > t:
			return 1
		}
		return 0
	})
	if !found {
		return off, off
	}
	return s[i].start, s[i].end
}

// gap returns the first range at or after off, below size, that s does not
// cover, as [start, end); start == end when there is none.
func (s spans) gap(off, size int64) (start, end int64) {
	start = off
	for _, x := range s {
		if x.end <= start {
			continue
		}
		if x.start <= start {
			start = x.end
			continue
		}
		return start, min(x.start, size)
	}
	if start >= size {
		return size, size
	}
	return start, size
}

// total returns the number of bytes covered.
func (s spans) total() int64 {
	var n int64
	for _, x := range s {
		n += x.end - x.start
	}
	return n
}

// gaps appends to dst the parts of [start, end) that s does not cover, in
// order.
func (s spans) gaps(dst []span, start, end int64) []span {
	out := dst
	for start < end {
		a, b := s.gap(start, end)
		if a >= b {
			break
		}
		out = append(out, span{a, b})
		start = b
	}
	return out
}

// remove deletes [start, end) from s, splitting a range that straddles it.
func (s *spans) remove(start, end int64) {
	if start >= end {
		return
	}
	r := *s
	// First range that ends after start: everything before it is untouched.
	i, _ := slices.BinarySearchFunc(r, start, func(x span, t int64) int {
		if x.end <= t {
			return -1
		}
		return 1
	})
	j := i
	for j < len(r) && r[j].start < end {
		j++
	}
	if i == j {
		return
	}
	left, right := span{r[i].start, start}, span{end, r[j-1].end}
	switch {
	case left.start < left.end && right.start < right.end:
		*s = slices.Replace(r, i, j, left, right)
	case left.start < left.end:
		*s = slices.Replace(r, i, j, left)
	case right.start < right.end:
		*s = slices.Replace(r, i, j, right)
	default:
		*s = slices.Delete(r, i, j)
	}
}
