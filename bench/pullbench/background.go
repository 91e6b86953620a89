package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"os"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// Beside a sync: what a sync fetching another image costs a node's pull
// through the same pullproxy and the same path. The image is pulled cold
// alone, beside another node's pull of a second image (both clients: they
// share the path), and beside a sync rule fetching that second image
// (background work: below the node's pull, within half the connections).

const otherRepo = "node/tools" // the second image: what the other node, or the sync, fetches

// backgroundLeg is one way of pulling the image.
type backgroundLeg struct {
	Name   string `json:"name"`
	Beside string `json:"beside"` // "", "client" or "sync"
}

var backgroundLegs = []backgroundLeg{
	{Name: "alone"},
	{Name: "beside another node's pull of a second image", Beside: "client"},
	{Name: "beside a sync rule fetching that second image", Beside: "sync"},
}

// backgroundRow is one leg's results, over the matrix's seeds.
type backgroundRow struct {
	Leg     backgroundLeg     `json:"leg"`
	Seconds *benchrun.Summary `json:"pull_seconds,omitempty"`
	Vs      *benchrun.Summary `json:"vs_alone_median,omitempty"`
	// Other is how long the second image took, from the start of its
	// fetch to its end (the other node's pull, or the sync's round).
	Other  *benchrun.Summary `json:"other_seconds,omitempty"`
	Egress *benchrun.Summary `json:"egress_bytes_ratio,omitempty"` // the path's egress over both images' bytes
	Error  string            `json:"error,omitempty"`
}

// besidePath is the path of every leg: the incident's resets at 32 MB/s.
var besidePath = sourcePath{Name: "32 MB/s, incident's resets", Bandwidth: 32e6, Mode: "reset", CutProb: 0.6,
	CutMin: 1_300_000, CutMax: 3_100_000}

// pushOther pushes the second image: two layers of the image's sizes.
func (b *bench) pushOther(ctx context.Context) (int64, error) {
	sizes := b.cfg.LayerSizes[2:4]
	other, err := b.reg.Push(ctx, registrytest.Image{Repo: otherRepo, Tag: "v1", LayerSizes: sizes, Seed: 2})
	if err != nil {
		return 0, fmt.Errorf("pushing the second image: %w", err)
	}
	n := other.Manifest.Size + other.Config.Size
	for _, l := range other.Layers {
		n += l.Size
	}
	return n, nil
}

// background measures every leg once per seed.
func (b *bench) background(ctx context.Context) []backgroundRow {
	otherBytes, err := b.pushOther(ctx)
	if err != nil {
		return []backgroundRow{{Error: err.Error()}}
	}
	var rows []backgroundRow
	var alone float64
	for _, leg := range backgroundLegs {
		row := backgroundRow{Leg: leg}
		var took, others, egress []float64
		for seed := range b.cfg.MatrixSeeds {
			t, o, e, err := b.besidePull(ctx, leg, uint64(seed+1), otherBytes)
			if err != nil {
				row.Error = fmt.Sprintf("seed %d: %v", seed+1, err)
				break
			}
			took, egress = append(took, t), append(egress, e)
			if leg.Beside != "" {
				others = append(others, o)
			}
		}
		if row.Error == "" && len(took) > 0 {
			s, e := benchrun.Summarise(took, false), benchrun.Summarise(egress, false)
			row.Seconds, row.Egress = &s, &e
			if leg.Beside == "" {
				alone = s.Median
			}
			if alone > 0 {
				vs := make([]float64, len(took))
				for i, t := range took {
					vs[i] = t / alone
				}
				v := benchrun.Summarise(vs, false)
				row.Vs = &v
			}
			if len(others) > 0 {
				o := benchrun.Summarise(others, false)
				row.Other = &o
			}
			log.Printf("beside a sync: %s: median %.2f s, worst %.2f s; egress worst %.3fx", leg.Name, s.Median, s.Worst, e.Worst)
		} else {
			log.Printf("beside a sync: %s: failed: %s", leg.Name, row.Error)
		}
		rows = append(rows, row)
	}
	return rows
}

// besidePull pulls the image cold through a fresh pullproxy across the
// path, beside what leg says, and returns the pull's time, the second
// image's, and the path's egress over the bytes of the images fetched.
func (b *bench) besidePull(ctx context.Context, leg backgroundLeg, seed uint64, otherBytes int64) (took, other, egress float64, err error) {
	ctx, cancel := context.WithTimeout(ctx, runTimeout)
	defer cancel()
	relay, err := startSourcePath(b, besidePath, seed, true)
	if err != nil {
		return 0, 0, 0, err
	}
	defer relay.Close()
	dataDir, err := os.MkdirTemp(b.dir, "data")
	if err != nil {
		return 0, 0, 0, err
	}
	moreYAML := ""
	if leg.Beside == "sync" {
		// Its first round comes within a tenth of the interval.
		moreYAML = fmt.Sprintf("sync:\n  - upstream: %s\n    repository: %s\n    interval: 20s\n", registryHost, otherRepo)
	}
	px, err := startProxyWith(ctx, b, []string{"https://" + relay.Addr()}, dataDir, moreYAML, nil)
	if err != nil {
		return 0, 0, 0, err
	}
	defer px.stop()

	start := time.Now()
	otherDone := make(chan error, 1)
	switch leg.Beside {
	case "client":
		go func() {
			d, remove, err := b.newContainerd(ctx)
			if err != nil {
				otherDone <- err
				return
			}
			defer remove()
			f, err := b.pullRefOn(ctx, d, px.Addr, mirrorHosts, registryHost+"/"+otherRepo+":v1")
			if err == nil && f.failure != "" {
				err = fmt.Errorf("the other node's pull failed: %s", f.failure)
			}
			otherDone <- err
		}()
	case "sync":
		go func() { otherDone <- waitSynced(ctx, px) }()
	}
	if leg.Beside != "" {
		// The second image's fetch is under way before the node asks.
		for relay.Stats().BytesDown < 16<<20 {
			if time.Since(start) > time.Minute {
				return 0, 0, 0, fmt.Errorf("the second image's fetch did not start within a minute")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	f, err := b.pull(ctx, px.Addr, mirrorHosts)
	if err != nil {
		return 0, 0, 0, err
	}
	if f.failure != "" {
		return 0, 0, 0, fmt.Errorf("the pull failed after %.2fs: %s", f.took.Seconds(), f.failure)
	}
	fetched := b.bytes
	if leg.Beside != "" {
		if err := <-otherDone; err != nil {
			return 0, 0, 0, err
		}
		other = time.Since(start).Seconds()
		fetched += otherBytes
	}
	relay.Close()
	return f.took.Seconds(), other, ratio(relay.Stats().BytesEgress, fetched), nil
}

// waitSynced waits until px's sync rule keeps its tag cached.
func waitSynced(ctx context.Context, px *proxyProcess) error {
	for {
		c, err := px.counters(ctx, "pullproxy_sync_tags_cached")
		if err != nil {
			return err
		}
		if c["pullproxy_sync_tags_cached"] >= 1 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the sync round did not end: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// printBackground prints the legs as Markdown.
func printBackground(w io.Writer, rep report) {
	if len(rep.Background) == 0 {
		return
	}
	fmt.Fprintf(w, "\nBeside a sync: the image pulled cold by containerd through a fresh pullproxy across one path (%s, "+
		"RTT 0), once per seed (%d): alone; with another node pulling a second image (two layers, %d MiB) through it "+
		"from before the pull starts; with a sync rule fetching that second image instead. The second image's time runs "+
		"from pullproxy's start to its end. Egress: the bytes leaving the registry over both images'.\n\n",
		besidePath.Name, rep.Config.MatrixSeeds, (rep.Config.LayerSizes[2]+rep.Config.LayerSizes[3])>>20)
	fmt.Fprintln(w, "| the pull | median | worst | median / alone | worst / alone | second image, median | egress, worst | note |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
	for _, r := range rep.Background {
		cells := []string{r.Leg.Name, "", "", "", "", "", "", ""}
		if r.Seconds != nil {
			cells[1], cells[2] = fmt.Sprintf("%.2f s", r.Seconds.Median), fmt.Sprintf("%.2f s", r.Seconds.Worst)
			cells[6] = fmt.Sprintf("%.3fx", r.Egress.Worst)
		}
		if r.Vs != nil {
			cells[3], cells[4] = fmt.Sprintf("%.2fx", r.Vs.Median), fmt.Sprintf("%.2fx", r.Vs.Worst)
		}
		if r.Other != nil {
			cells[5] = fmt.Sprintf("%.2f s", r.Other.Median)
		}
		if r.Error != "" {
			cells[7] = "failed: " + strings.ReplaceAll(r.Error, "\n", " ")
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}
}
