package main

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/storage"
)

// storeBound is max_size: a size ("100GiB"), a percentage of the data
// dir's file system ("80%"), or "off". Unset, the store keeps its file
// system below storage.DefaultMaxPercent full.
type storeBound struct {
	bytes   int64
	percent float64
	off     bool
	set     bool
}

func (b *storeBound) UnmarshalYAML(n *yaml.Node) error {
	v, err := parseStoreBound(n.Value)
	if err != nil {
		return fmt.Errorf("line %d: max_size: %w", n.Line, err)
	}
	*b = v
	return nil
}

func parseStoreBound(s string) (storeBound, error) {
	s = strings.TrimSpace(s)
	switch {
	case s == "off":
		return storeBound{off: true, set: true}, nil
	case strings.HasSuffix(s, "%"):
		p, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(s, "%")), 64)
		if err != nil || p <= 5 || p > 100 {
			return storeBound{}, fmt.Errorf("%q: want a percentage of the file system above 5%% and at most 100%%", s)
		}
		return storeBound{percent: p, set: true}, nil
	}
	n, err := parseByteSize(s)
	if err != nil || n <= 0 {
		return storeBound{}, fmt.Errorf("%q: want a size (100GiB), a percentage of the file system (80%%) or off", s)
	}
	return storeBound{bytes: n, set: true}, nil
}

func (b storeBound) String() string {
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

// policy is the eviction policy the bound sets.
func (b storeBound) policy() storage.EvictionPolicy {
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

// pinnedDigests returns the resolver of the pin list's blobs, as the store
// holds them when eviction asks.
func pinnedDigests(store *storage.Store, pins []imageref.Ref) func(context.Context) (map[digest.Digest]bool, error) {
	if len(pins) == 0 {
		return nil
	}
	return func(ctx context.Context) (map[digest.Digest]bool, error) {
		out := map[digest.Digest]bool{}
		for _, p := range pins {
			if err := store.ImageDigests(ctx, p.Upstream, p.Repo, p.Ref, out); err != nil {
				return nil, fmt.Errorf("pinned %s/%s:%s: %w", p.Upstream, p.Repo, p.Ref, err)
			}
		}
		return out, nil
	}
}

// evictionInterval is how often the evictor looks at the file system
// besides after each commit: other files may fill it.
const evictionInterval = time.Minute

// startEviction sets the store's bound, registers its metrics and runs the
// evictor until ctx ends; the returned func waits for it.
//
// A command (seed, import, export: background false) evicts only with an
// explicit max_size, and only to make room: it must not take away, on a
// disk filled by other things, what a site cannot fetch again.
func startEviction(ctx context.Context, cfg fileConfig, store *storage.Store, reg prometheus.Registerer, log *slog.Logger, background bool) (wait func(), err error) {
	var pins []imageref.Ref
	for _, s := range cfg.Pin {
		p, err := imageref.Parse(s)
		if err != nil {
			return nil, err
		}
		pins = append(pins, p)
	}
	bound := cfg.MaxSize
	offline := cfg.Offline
	for _, u := range cfg.Upstreams {
		offline = offline || u.Offline
	}
	switch {
	case offline && !bound.set:
		// What is evicted offline could not be fetched again.
		bound = storeBound{off: true, set: true}
		log.Info("an upstream is offline: nothing is evicted unless max_size is set")
	case !background && !bound.set:
		bound = storeBound{off: true, set: true}
	}
	policy := bound.policy()
	policy.Pinned = pinnedDigests(store, pins)
	store.SetEviction(policy)
	for _, m := range []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_store_bytes",
			Help: "Bytes of the blobs stored, manifests included."},
			func() float64 { b, _ := store.Usage(); return float64(b) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_store_blobs",
			Help: "Blobs stored, manifests included."},
			func() float64 { _, n := store.Usage(); return float64(n) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_store_max_bytes",
			Help: "The bound max_size sets on the store's bytes; 0 when the bound is on the file system, or off."},
			func() float64 { return float64(policy.MaxBytes) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_store_filesystem_free_bytes",
			Help: "Bytes free (to unprivileged users) on the data dir's file system."},
			func() float64 { free, _ := store.FileSystem(); return float64(free) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "pullproxy_store_filesystem_size_bytes",
			Help: "Size of the data dir's file system."},
			func() float64 { _, size := store.FileSystem(); return float64(size) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "pullproxy_evicted_blobs_total",
			Help: "Blobs evicted to keep the store within its bound."},
			func() float64 { n, _ := store.Evictions(); return float64(n) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "pullproxy_evicted_bytes_total",
			Help: "Bytes of the blobs evicted to keep the store within its bound."},
			func() float64 { _, b := store.Evictions(); return float64(b) }),
	} {
		if err := reg.Register(m); err != nil {
			return nil, err
		}
	}
	bytes, blobs := store.Usage()
	log.Info("store bound", "max_size", bound.String(), "pinned_images", len(pins), "store_bytes", bytes, "store_blobs", blobs)
	if bound.off || !background {
		return func() {}, nil
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		store.RunEvictor(ctx, evictionInterval)
	}()
	return func() { <-done }, nil
}
