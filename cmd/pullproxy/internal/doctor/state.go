package doctor

// The path's live state from a running server, and the local disk and
// the shared bucket.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/upstream"
)

// pathCutPercent is the share of recent chunks cut from which doctor
// calls a path one that cuts sessions. A clean path cuts none; a chunk cut
// is resumed by a smaller one that usually completes, so even a path that
// kills most sessions shows well under half its chunks cut.
const pathCutPercent = 10

// path reports the live cut rates of the upstream's endpoints, from a
// running server.
func (d *doctorRun) path(ctx context.Context, name string) {
	if d.serverErr != nil {
		d.warn("path", d.serverErr.Error(), "no live state", "the admin endpoint cannot be reached as given", "here")
		return
	}
	if d.server == nil {
		d.skip("path", "give --server (the admin endpoint) for the fetcher's live cut rates, or run pullproxy probe")
		return
	}
	resp, err := admin.Call(ctx, *d.server, http.MethodGet, "/debug/upstreams", "", nil)
	if err != nil {
		d.warn("path", err.Error(), "no live state", "the admin endpoint does not answer", "here")
		return
	}
	defer resp.Body.Close()
	var st []upstream.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		d.warn("path", err.Error(), "no live state", "the admin endpoint's answer is not the upstreams' state", "here")
		return
	}
	for _, u := range st {
		if u.Name != name {
			continue
		}
		d.corrupt(u.Corrupt, time.Now())
		var received int64
		for _, e := range u.Endpoints {
			received += e.ReceivedBytes
		}
		for _, e := range u.Endpoints {
			step := "path to " + e.URL
			if len(u.Endpoints) > 1 && received > 0 {
				// Endpoints sharing content fetch blobs together: each one's
				// part says which paths carry the pulls.
				step += fmt.Sprintf(" (%d%% of the upstream's blob bytes)", e.ReceivedBytes*100/received)
			}
			switch {
			case e.RecentChunks < 8:
				d.ok(step, fmt.Sprintf("%d chunks lately: too few to judge", e.RecentChunks))
			case e.CutPercent >= pathCutPercent && len(e.CutPoints) > 0:
				d.warn(step, fmt.Sprintf("%d%% of recent chunks cut, sessions dying after %s to %s; budget %s",
					e.CutPercent, progress.Bytes(e.CutPoints[0]), progress.Bytes(e.CutPoints[len(e.CutPoints)-1]), progress.Bytes(e.BudgetBytes)),
					"path cuts sessions", "the carrier kills sessions by byte count: pulls go on through pullproxy, slower; take it to the carrier, or prefer another region's endpoint", "upstream")
			case e.CutPercent >= pathCutPercent:
				d.warn(step, fmt.Sprintf("%d%% of recent chunks cut", e.CutPercent), "path drops sessions",
					"connections die before carrying anything: the path or the registry drops them", "upstream")
			default:
				d.ok(step, fmt.Sprintf("%d%% of %d recent chunks cut; goodput %s/s", e.CutPercent, e.RecentChunks, progress.Bytes(int64(e.GoodputBytesPerSecond))))
			}
		}
	}
}

// disk reports the data dir's free space.
func (d *doctorRun) disk() {
	dir := d.cfg.DataDir
	if _, err := os.Stat(dir); err != nil {
		d.skip("disk "+dir, "no data dir yet")
		return
	}
	space := d.space
	if space == nil {
		space = fsutil.Space
	}
	free, total, err := space(dir)
	if err != nil {
		d.warn("disk "+dir, err.Error(), "disk", "cannot tell the free space", "here")
		return
	}
	detail := fmt.Sprintf("%s free of %s", progress.Bytes(free), progress.Bytes(total))
	if total > 0 && free*10 < total {
		d.fail("disk "+dir, detail, "disk nearly full", "cold pulls need room: free or grow the disk, or lower max_size so eviction keeps it", "here")
		return
	}
	d.ok("disk "+dir, detail)
}

// bucket checks the bucket replicas share, when they share one: reachable,
// writable with the credentials at hand, conditional writes honoured.
func (d *doctorRun) bucket(ctx context.Context) {
	st := d.cfg.Storage
	if !st.Shared() {
		return
	}
	step := "bucket " + st.Bucket
	b, err := bucket.Open(ctx, st.BucketConfig(), bucket.WithLogger(slog.New(slog.DiscardHandler)))
	if err == nil {
		defer b.Close()
		err = b.Check(ctx) // Open only warns when conditional writes are ignored
	}
	if err != nil {
		class, fix := bucket.Diagnose(err)
		if errors.Is(err, bucket.ErrNoConditionalWrites) {
			d.warn(step, err.Error(), class, fix, "here")
			return
		}
		d.fail(step, err.Error(), class, fix, "here")
		return
	}
	d.ok(step, "reachable, writable, conditional writes honoured")
}

// gaugeValue reads a gauge of reg labelled upstream=name.
func gaugeValue(reg *prometheus.Registry, metric, name string) (float64, bool) {
	families, err := reg.Gather()
	if err != nil {
		return 0, false
	}
	for _, f := range families {
		if f.GetName() != metric {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "upstream" && l.GetValue() == name {
					return m.GetGauge().GetValue(), true
				}
			}
		}
	}
	return 0, false
}

// corrupt adds doctor's steps for the blobs an upstream's endpoints served
// corrupt lately: a failure when the image being walked needs the blob.
func (d *doctorRun) corrupt(entries []upstream.CorruptStatus, now time.Time) {
	for _, c := range entries {
		step := "blob " + c.Digest.String() + " from " + c.Endpoint
		detail := fmt.Sprintf("served corrupt %d time(s) in a row (%s); not asked for it again before %s",
			c.Failures, c.LastError, c.RetryAt.Format(time.TimeOnly))
		if !c.RetryAt.After(now) {
			detail = fmt.Sprintf("served corrupt %d time(s) in a row (%s); asked for it again at the next pull", c.Failures, c.LastError)
		}
		if d.imageBlobs[c.Digest] {
			d.fail(step, detail, "served corrupt", upstream.CorruptFix(c.Digest), "upstream")
		} else {
			d.warn(step, detail, "served corrupt", upstream.CorruptFix(c.Digest), "upstream")
		}
	}
}
