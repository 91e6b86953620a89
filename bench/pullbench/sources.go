package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"os"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
)

// Several endpoints: one upstream reached at several endpoints that hold
// the same content (a registry replicated to another region, behind two
// carriers), each behind a path of its own. pullproxy fetches one blob's
// chunks from all of them at once; the rows say how that compares with
// containerd's own clean pull over the fastest path alone, and what a
// path that stalls every session costs the others.

// sourcePath is one endpoint's path.
type sourcePath struct {
	Name      string  `json:"name"`
	Bandwidth int64   `json:"bandwidth_bytes_per_second"`
	Mode      string  `json:"mode"` // how cut sessions die: reset or stall
	CutProb   float64 `json:"cut_probability"`
	CutMin    int64   `json:"cut_min_bytes"`
	CutMax    int64   `json:"cut_max_bytes"`
}

// sourcesScenario is one row: the image pulled cold through pullproxy with
// one endpoint per path.
type sourcesScenario struct {
	Name  string       `json:"name"`
	Paths []sourcePath `json:"paths"`
	// Against: what its time is compared with: "clean" (containerd's own
	// pull over the first path without cuts) or the name of another
	// scenario (its median).
	Against string `json:"against"`
	// CorruptPath, when not 0, is the path (from 1) whose endpoint serves
	// the image's largest layer corrupt. The pull is made again, by a new
	// containerd, as kubelet would, until it succeeds (three times at
	// most); the time is the attempts' together.
	CorruptPath int `json:"corrupt_path,omitempty"`
}

func sourcesScenarios() []sourcesScenario {
	incident := func(name string, bw int64) sourcePath {
		return sourcePath{Name: name, Bandwidth: bw, Mode: "reset", CutProb: 0.6, CutMin: 1_300_000, CutMax: 3_100_000}
	}
	a, b := incident("A: 32 MB/s, incident's resets", 32e6), incident("B: 16 MB/s, incident's resets", 16e6)
	stalls := sourcePath{Name: "C: 32 MB/s, every session stalls after 0–1.3 MB", Bandwidth: 32e6, Mode: "stall",
		CutProb: 1, CutMin: 0, CutMax: 1_300_000}
	two := "two endpoints: A and B"
	return []sourcesScenario{
		{Name: two, Paths: []sourcePath{a, b}, Against: "clean"},
		{Name: "three endpoints: A, B and C, which stalls every session", Paths: []sourcePath{a, b, stalls}, Against: two},
		{Name: "two endpoints, B serving the largest layer corrupt", Paths: []sourcePath{a, b}, Against: two, CorruptPath: 2},
		{Name: "two endpoints, A serving the largest layer corrupt", Paths: []sourcePath{a, b}, Against: two, CorruptPath: 1},
	}
}

// sourcesRow is one scenario's results.
type sourcesRow struct {
	Scenario sourcesScenario   `json:"scenario"`
	Baseline *benchrun.Summary `json:"baseline_seconds,omitempty"` // what Against names
	Proxy    *benchrun.Summary `json:"pullproxy_seconds,omitempty"`
	Vs       *benchrun.Summary `json:"vs_baseline_median,omitempty"`
	Egress   *benchrun.Summary `json:"egress_bytes_ratio,omitempty"` // all paths' egress over the image's bytes
	// Shares are each path's egress over all paths', median of the runs.
	Shares []float64 `json:"shares,omitempty"`
	Error  string    `json:"error,omitempty"`
}

// sources measures every scenario: containerd's clean pull over the first
// path (MatrixCleanRuns times), then each scenario once per seed.
func (b *bench) sources(ctx context.Context) []sourcesRow {
	var clean *benchrun.Summary
	var cleanErr string
	scenarios := sourcesScenarios()
	var runs []float64
	for i := range b.cfg.MatrixCleanRuns {
		relay, err := startSourcePath(b, scenarios[0].Paths[0], uint64(i+1), false)
		if err == nil {
			var s sample
			s, err = b.pullAcross(ctx, relay, relay.Addr(), b.directHosts, "clean direct pull over the first path")
			relay.Close()
			runs = append(runs, s.seconds)
		}
		if err != nil {
			cleanErr = err.Error()
			break
		}
	}
	if cleanErr == "" {
		sum := benchrun.Summarise(runs, false)
		clean = &sum
	}
	medians := map[string]float64{}
	var rows []sourcesRow
	for _, sc := range scenarios {
		row := sourcesRow{Scenario: sc}
		switch {
		case sc.Against == "clean" && clean != nil:
			row.Baseline = clean
		case sc.Against == "clean":
			row.Error = "clean direct pull: " + cleanErr
		case medians[sc.Against] > 0:
			s := benchrun.Summarise([]float64{medians[sc.Against]}, false)
			row.Baseline = &s
		default:
			row.Error = sc.Against + " was not measured"
		}
		var took, egress []float64
		shares := make([][]float64, len(sc.Paths))
		for seed := range b.cfg.MatrixSeeds {
			if row.Error != "" {
				break
			}
			t, e, sh, err := b.sourcesPull(ctx, sc, uint64(seed+1))
			if err != nil {
				row.Error = fmt.Sprintf("seed %d: %v", seed+1, err)
				break
			}
			took, egress = append(took, t), append(egress, e)
			for i := range sh {
				shares[i] = append(shares[i], sh[i])
			}
		}
		if len(took) > 0 && row.Error == "" {
			p, e := benchrun.Summarise(took, false), benchrun.Summarise(egress, false)
			row.Proxy, row.Egress = &p, &e
			vs := make([]float64, len(took))
			for i, t := range took {
				vs[i] = t / row.Baseline.Median
			}
			v := benchrun.Summarise(vs, false)
			row.Vs = &v
			for _, s := range shares {
				row.Shares = append(row.Shares, benchrun.Summarise(s, false).Median)
			}
			medians[sc.Name] = p.Median
			log.Printf("several endpoints: %s: %.2fx %s, worst %.2fx; egress worst %.3fx", sc.Name, v.Median, sc.Against, v.Worst, e.Worst)
		} else {
			log.Printf("several endpoints: %s: failed: %s", sc.Name, row.Error)
		}
		rows = append(rows, row)
	}
	return rows
}

// sourcesPull pulls the image cold through a fresh pullproxy whose
// upstream has one endpoint per path of sc, each through its own carrier
// seeded from seed. It returns the pull's time, the egress of all paths
// over the image's bytes, and each path's share of that egress.
func (b *bench) sourcesPull(ctx context.Context, sc sourcesScenario, seed uint64) (float64, float64, []float64, error) {
	ctx, cancel := context.WithTimeout(ctx, runTimeout)
	defer cancel()
	var relays []*carrier.Relay
	defer func() {
		for _, r := range relays {
			r.Close()
		}
	}()
	var urls []string
	for i, p := range sc.Paths {
		r, err := startSourcePath(b, p, seed*10+uint64(i), true)
		if err != nil {
			return 0, 0, nil, err
		}
		relays = append(relays, r)
		urls = append(urls, "https://"+r.Addr())
	}
	dataDir, err := os.MkdirTemp(b.dir, "data")
	if err != nil {
		return 0, 0, nil, err
	}
	if sc.CorruptPath > 0 {
		b.corrupt.set(relays[sc.CorruptPath-1].Addr(), b.largestLayer())
		defer b.corrupt.set(relays[sc.CorruptPath-1].Addr(), "")
	}
	px, err := startProxyWith(ctx, b, urls, dataDir, "", nil)
	if err != nil {
		return 0, 0, nil, err
	}
	defer px.stop()
	var took time.Duration
	for attempt := 1; ; attempt++ {
		f, err := b.pull(ctx, px.Addr, mirrorHosts)
		if err != nil {
			return 0, 0, nil, err
		}
		took += f.took
		if f.failure == "" {
			break
		}
		if sc.CorruptPath == 0 || attempt == 3 {
			return 0, 0, nil, fmt.Errorf("pull %d failed after %.2fs: %s", attempt, f.took.Seconds(), f.failure)
		}
	}
	var total int64
	egress := make([]int64, len(relays))
	for i, r := range relays {
		r.Close()
		egress[i] = r.Stats().BytesEgress
		total += egress[i]
	}
	shares := make([]float64, len(relays))
	for i, e := range egress {
		shares[i] = ratio(e, total)
	}
	return took.Seconds(), ratio(total, b.bytes), shares, nil
}

// largestLayer returns the hex digest of the image's largest layer.
func (b *bench) largestLayer() string {
	largest := b.pushed.Layers[0]
	for _, l := range b.pushed.Layers {
		if l.Size > largest.Size {
			largest = l
		}
	}
	return largest.Digest.Encoded()
}

// startSourcePath starts the carrier of one endpoint's path, with its cuts
// or without.
func startSourcePath(b *bench, p sourcePath, seed uint64, cuts bool) (*carrier.Relay, error) {
	cfg := carrier.Config{Target: b.reg.Host(), Bandwidth: p.Bandwidth, Seed: seed}
	if cuts {
		cfg.Mode, cfg.CutProb, cfg.CutMin, cfg.CutMax = modes[p.Mode], p.CutProb, p.CutMin, p.CutMax
	}
	r, err := carrier.Start(cfg)
	if err != nil {
		return nil, fmt.Errorf("starting the carrier of %s: %w", p.Name, err)
	}
	return r, nil
}

// printSources prints the several-endpoint rows as Markdown.
func printSources(w io.Writer, rep report) {
	if len(rep.Sources) == 0 {
		return
	}
	fmt.Fprintf(w, "\nSeveral endpoints: one upstream reached at endpoints holding the same content, each behind a "+
		"carrier of its own (RTT 0), the image pulled cold through a fresh pullproxy once per seed (%d). \"Clean\": "+
		"containerd's own direct pull over the first path without cuts (median of %d). Egress: all paths' bytes "+
		"leaving the registry over the image's; shares: each path's part of them (medians). Where an endpoint serves "+
		"the largest layer corrupt, a new containerd pulls again, as kubelet would, until a pull succeeds (three at "+
		"most); the time is the attempts' together.\n\n",
		rep.Config.MatrixSeeds, rep.Config.MatrixCleanRuns)
	fmt.Fprintln(w, "| scenario | against | baseline, median | pullproxy, median | pullproxy, worst | median / baseline "+
		"| worst / baseline | egress, worst | shares | note |")
	fmt.Fprintln(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
	for _, r := range rep.Sources {
		cells := []string{r.Scenario.Name, r.Scenario.Against, "", "", "", "", "", "", "", ""}
		if r.Baseline != nil {
			cells[2] = fmt.Sprintf("%.2f s", r.Baseline.Median)
		}
		if r.Proxy != nil {
			cells[3], cells[4] = fmt.Sprintf("%.2f s", r.Proxy.Median), fmt.Sprintf("%.2f s", r.Proxy.Worst)
			cells[5], cells[6] = fmt.Sprintf("%.2fx", r.Vs.Median), fmt.Sprintf("%.2fx", r.Vs.Worst)
			cells[7] = fmt.Sprintf("%.3fx", r.Egress.Worst)
			var sh []string
			for i, s := range r.Shares {
				sh = append(sh, fmt.Sprintf("%s %.0f%%", strings.SplitN(r.Scenario.Paths[i].Name, ":", 2)[0], 100*s))
			}
			cells[8] = strings.Join(sh, ", ")
		}
		if r.Error != "" {
			cells[9] = "failed: " + strings.ReplaceAll(r.Error, "\n", " ")
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}
}
