package mirror

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/proxy/imagesync"
	"github.com/pullproxy/pullproxy/storage"
)

// pinnedDigests returns the resolver of the blobs pinned, as the store
// holds them when eviction asks: the pin list's, and those of the images
// the sync rules keep (sync may be nil).
func pinnedDigests(store *storage.Store, pins []imageref.Ref, sync *imagesync.Syncer) func(context.Context) (map[digest.Digest]bool, error) {
	if len(pins) == 0 && sync == nil {
		return nil
	}
	return func(ctx context.Context) (map[digest.Digest]bool, error) {
		out := map[digest.Digest]bool{}
		for _, p := range pins {
			if err := store.ImageDigests(ctx, p.Upstream, p.Repo, p.Ref, out); err != nil {
				return nil, fmt.Errorf("pinned %s/%s:%s: %w", p.Upstream, p.Repo, p.Ref, err)
			}
		}
		if sync == nil {
			return out, nil
		}
		for _, im := range sync.Images() {
			if err := store.ImageDigests(ctx, im.Upstream, im.Repository, im.Digest.String(), out); err != nil {
				return nil, fmt.Errorf("kept by sync: %s/%s@%s: %w", im.Upstream, im.Repository, im.Digest, err)
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
func startEviction(ctx context.Context, cfg config.File, store *storage.Store, sync *imagesync.Syncer, reg prometheus.Registerer, log *slog.Logger, background bool) (wait func(), err error) {
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
	case offline && !bound.IsSet():
		// What is evicted offline could not be fetched again.
		bound = config.Unbounded()
		log.Info("an upstream is offline: nothing is evicted unless max_size is set")
	case !background && !bound.IsSet():
		bound = config.Unbounded()
	}
	policy := bound.Policy()
	policy.Pinned = pinnedDigests(store, pins, sync)
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
	log.Info("store bound", "max_size", bound.String(), "pinned_images", len(pins), "synced_images", len(sync.Images()),
		"store_bytes", bytes, "store_blobs", blobs)
	if bound.IsOff() || !background {
		return func() {}, nil
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		store.RunEvictor(ctx, evictionInterval)
	}()
	return func() { <-done }, nil
}
