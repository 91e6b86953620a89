package config

import (
	"fmt"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/pullproxy/pullproxy/storage"
)

// StoreBound is max_size: a size ("100GiB"), a percentage of the data
// dir's file system ("80%"), or "off". Unset, the store keeps its file
// system below storage.DefaultMaxPercent full.
type StoreBound struct {
	bytes   int64
	percent float64
	off     bool
	set     bool
}

func (b *StoreBound) UnmarshalYAML(n *yaml.Node) error {
	v, err := ParseStoreBound(n.Value)
	if err != nil {
		return fmt.Errorf("line %d: max_size: %w", n.Line, err)
	}
	*b = v
	return nil
}

// ParseStoreBound reads max_size: a size, a percentage of the file system
// above 5% and at most 100%, or off.
func ParseStoreBound(s string) (StoreBound, error) {
	s = strings.TrimSpace(s)
	switch {
	case s == "off":
		return StoreBound{off: true, set: true}, nil
	case strings.HasSuffix(s, "%"):
		p, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(s, "%")), 64)
		if err != nil || p <= 5 || p > 100 {
			return StoreBound{}, fmt.Errorf("%q: want a percentage of the file system above 5%% and at most 100%%", s)
		}
		return StoreBound{percent: p, set: true}, nil
	}
	n, err := ParseByteSize(s)
	if err != nil || n <= 0 {
		return StoreBound{}, fmt.Errorf("%q: want a size (100GiB), a percentage of the file system (80%%) or off", s)
	}
	return StoreBound{bytes: n, set: true}, nil
}

func (b StoreBound) String() string {
	switch {
	case b.off:
		return "off"
	case b.bytes > 0:
		return strconv.FormatInt(b.bytes, 10) + " bytes"
	case b.percent > 0:
		return strconv.FormatFloat(b.percent, 'f', -1, 64) + "% of the file system"
	}
	return strconv.Itoa(storage.DefaultMaxPercent) + "% of the file system (the default)"
}

// Unbounded is the bound max_size "off" sets: none.
func Unbounded() StoreBound { return StoreBound{off: true, set: true} }

// IsSet tells whether max_size was given.
func (b StoreBound) IsSet() bool { return b.set }

// IsOff tells whether the store is unbounded.
func (b StoreBound) IsOff() bool { return b.off }

// Policy is the eviction policy the bound sets.
func (b StoreBound) Policy() storage.EvictionPolicy {
	switch {
	case b.off:
		return storage.EvictionPolicy{}
	case b.bytes > 0:
		return storage.EvictionPolicy{MaxBytes: b.bytes}
	case b.percent > 0:
		return storage.EvictionPolicy{MaxPercent: b.percent}
	}
	return storage.EvictionPolicy{MaxPercent: storage.DefaultMaxPercent}
}
