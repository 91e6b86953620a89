package mirror

import (
	"context"
	"log/slog"
	"time"

	"github.com/pullproxy/pullproxy/storage"
)

// scrubDelay is how long after start the first scrub pass waits: a mirror
// just started is often filling, and a pass is no hurry.
const scrubDelay = 10 * time.Minute

// runScrubs runs a scrub pass every interval (from one start to the next)
// until ctx ends, and logs what each found.
func runScrubs(ctx context.Context, sc *storage.Scrubber, interval time.Duration, log *slog.Logger) {
	next := time.Now().Add(scrubDelay)
	for {
		t := time.NewTimer(time.Until(next))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		start := time.Now()
		next = start.Add(interval)
		st, err := sc.Scrub(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			log.Warn("scrub pass failed", "err", err, "blobs", st.Blobs, "bytes", st.Bytes)
			continue
		}
		log.Info("scrub pass done", "blobs", st.Blobs, "bytes", st.Bytes, "damaged", st.Damaged,
			"took", time.Since(start).Round(time.Second))
	}
}
