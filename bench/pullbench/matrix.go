package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
)

// The scenario matrix: the cold pull through pullproxy across paths that
// real sites have, each several times with a different seed of the
// carrier's random choices, against containerd's own pull over the same
// path without cuts. A controller tuned to one path hides what the others
// do to it, and a median hides the run a node waits through: each path's
// row gives its worst run, and the rows are ordered worst first.

// pathSpec is one path of the matrix.
type pathSpec struct {
	Name string `json:"name"`
	// TLS: the upstream speaks TLS, whose handshake crosses the path. Plain
	// HTTP otherwise: the carrier answers the TCP connect itself, at once
	// (as carrier equipment that counts bytes per session often does), and
	// the path's delay comes after it, so a connection's set-up says
	// nothing about how long the path is; unless HandshakeThrough, where
	// the TCP handshake crosses the path (carrier.Config.HandshakeThrough).
	TLS              bool    `json:"tls"`
	HandshakeThrough bool    `json:"handshake_through,omitempty"`
	RTTms            int64   `json:"rtt_ms"`
	JitterMs         int64   `json:"jitter_ms,omitempty"` // each session's RTT is drawn from RTT ± this
	Mode             string  `json:"mode"`                // how cut sessions die: reset, close (a FIN) or stall
	CutProb          float64 `json:"cut_probability"`
	CutMin           int64   `json:"cut_min_bytes"`
	CutMax           int64   `json:"cut_max_bytes"`
	// BadFrom and BadFor, when BadFor is not 0, make the path cut sessions
	// only from BadFrom after its first session, for BadFor: a path that
	// turns bad mid-pull and recovers.
	BadFrom float64 `json:"bad_from_seconds,omitempty"`
	BadFor  float64 `json:"bad_for_seconds,omitempty"`
}

var modes = map[string]carrier.Mode{"reset": carrier.Reset, "close": carrier.CleanClose, "stall": carrier.Stall}

// matrixPaths are the paths of the matrix.
func matrixPaths() []pathSpec {
	incident := func(p pathSpec) pathSpec { // 60% of sessions reset after 1.3–3.1 MB
		p.Mode, p.CutProb, p.CutMin, p.CutMax = cmp.Or(p.Mode, "reset"), 0.6, 1_300_000, 3_100_000
		return p
	}
	return []pathSpec{
		incident(pathSpec{Name: "TLS, 0 ms, incident's resets", TLS: true}),
		incident(pathSpec{Name: "TLS, 40 ms, incident's resets", TLS: true, RTTms: 40}),
		incident(pathSpec{Name: "TLS, 100 ms, incident's resets", TLS: true, RTTms: 100}),
		incident(pathSpec{Name: "plain HTTP, connect answered locally, 40 ms, incident's resets", RTTms: 40}),
		incident(pathSpec{Name: "plain HTTP, connect answered locally, 100 ms, incident's resets", RTTms: 100}),
		incident(pathSpec{Name: "plain HTTP, handshake through the path, 100 ms, incident's resets", RTTms: 100, HandshakeThrough: true}),
		{Name: "TLS, 0 ms, harsher: 80% reset at 0.3–0.9 MB", TLS: true, Mode: "reset", CutProb: 0.8, CutMin: 300_000, CutMax: 900_000},
		{Name: "TLS, 40 ms, milder: 40% reset at 5–12 MB", TLS: true, RTTms: 40, Mode: "reset", CutProb: 0.4, CutMin: 5_000_000, CutMax: 12_000_000},
		incident(pathSpec{Name: "TLS, 40 ms, clean closes (FIN) instead of resets", TLS: true, RTTms: 40, Mode: "close"}),
		incident(pathSpec{Name: "TLS, 0 ms, silent stalls", TLS: true, Mode: "stall"}),
		incident(pathSpec{Name: "TLS, 40 ± 30 ms jitter, incident's resets", TLS: true, RTTms: 40, JitterMs: 30}),
		incident(pathSpec{Name: "TLS, 40 ms, clean, resets from 2 s to 6 s", TLS: true, RTTms: 40, BadFrom: 2, BadFor: 4}),
	}
}

// cleanKey names the clean path a path is compared with: the same path
// without cuts.
func (p pathSpec) cleanKey() string {
	return fmt.Sprintf("tls=%v rtt=%d jitter=%d handshake=%v", p.TLS, p.RTTms, p.JitterMs, p.HandshakeThrough)
}

// matrixRow is one path's row.
type matrixRow struct {
	Path pathSpec `json:"path"`
	// Clean is containerd's own pull over the path without cuts; Proxy the
	// cold pull through pullproxy over the path, one run per seed.
	Clean *benchrun.Summary `json:"clean_direct_seconds,omitempty"`
	Proxy *benchrun.Summary `json:"pullproxy_seconds,omitempty"`
	// VsClean is each pullproxy run's time over the clean pull's median.
	VsClean *benchrun.Summary `json:"vs_clean_direct_median,omitempty"`
	// Egress is each pullproxy run's bytes leaving the upstream (counted by
	// the carrier where it reads them from the upstream, delivered or not)
	// over the image's bytes.
	Egress *benchrun.Summary `json:"egress_bytes_ratio,omitempty"`
	// Head, Unused and Tail are each run's time before the carrier carried
	// the registry's first byte, the cap's capacity unused between that
	// and the end of the last body it carried, and the time after it (see
	// carrier.Stats): where the time beyond the link's went.
	Head   *benchrun.Summary `json:"head_seconds,omitempty"`
	Unused *benchrun.Summary `json:"unused_seconds,omitempty"`
	Tail   *benchrun.Summary `json:"tail_seconds,omitempty"`
	// Discarded and Abandoned are what pullproxy counted of the upstream's
	// bytes it threw away and asked for but hung up on, over the image's;
	// Overtaken its chunk requests overtaken by a hedge or the request it
	// hedged (see pullproxy_upstream_wasted_bytes_total).
	Discarded *benchrun.Summary `json:"discarded_ratio,omitempty"`
	Abandoned *benchrun.Summary `json:"abandoned_ratio,omitempty"`
	Overtaken *benchrun.Summary `json:"overtaken,omitempty"`
	PeakRSS   *benchrun.Summary `json:"peak_rss_mib,omitempty"` // pullproxy's peak resident memory
	Sessions  *benchrun.Summary `json:"sessions,omitempty"`     // sessions the carrier accepted
	Cut       *benchrun.Summary `json:"sessions_cut,omitempty"`
	Error     string            `json:"error,omitempty"`
}

// matrix measures every path: the clean pull of each distinct path first
// (cleanRuns times), then pullproxy's cold pull, once per seed.
func (b *bench) matrix(ctx context.Context) []matrixRow {
	clean := map[string]*benchrun.Summary{}
	cleanErr := map[string]string{}
	var rows []matrixRow
	only := regexp.MustCompile(b.cfg.MatrixPaths) // checked in parseFlags
	for _, p := range matrixPaths() {
		if !only.MatchString(p.Name) {
			continue
		}
		row := matrixRow{Path: p}
		key := p.cleanKey()
		if _, done := clean[key]; !done && cleanErr[key] == "" {
			var runs []float64
			for i := range b.cfg.MatrixCleanRuns {
				s, err := b.matrixPull(ctx, p, uint64(i+1), false, false)
				if err != nil {
					cleanErr[key] = fmt.Sprintf("clean direct pull, run %d: %v", i+1, err)
					break
				}
				runs = append(runs, s.seconds)
			}
			if cleanErr[key] == "" {
				sum := benchrun.Summarise(runs, false)
				clean[key] = &sum
			}
		}
		if row.Error = cleanErr[key]; row.Error != "" {
			rows = append(rows, row)
			log.Printf("matrix: %s: %s", p.Name, row.Error)
			continue
		}
		row.Clean = clean[key]
		var samples []sample
		var sessions, cut []float64
		for seed := range b.cfg.MatrixSeeds {
			s, err := b.matrixPull(ctx, p, uint64(seed+1), true, true)
			if err != nil {
				row.Error = fmt.Sprintf("seed %d: %v", seed+1, err)
				break
			}
			samples = append(samples, s)
			sessions, cut = append(sessions, s.sessions), append(cut, s.cut)
		}
		if len(samples) > 0 {
			row.Proxy = summarise(samples, func(s sample) float64 { return s.seconds })
			row.VsClean = summarise(samples, func(s sample) float64 { return s.seconds / row.Clean.Median })
			row.Egress = summarise(samples, func(s sample) float64 { return s.upstream })
			row.Head = summarise(samples, func(s sample) float64 { return s.head })
			row.Unused = summarise(samples, func(s sample) float64 { return s.unused })
			row.Tail = summarise(samples, func(s sample) float64 { return s.tail })
			row.Discarded = summarise(samples, func(s sample) float64 { return s.discarded })
			row.Abandoned = summarise(samples, func(s sample) float64 { return s.abandoned })
			row.Overtaken = summarise(samples, func(s sample) float64 { return s.overtaken })
			row.PeakRSS = summarise(samples, func(s sample) float64 { return s.rssMiB })
			sum, cuts := benchrun.Summarise(sessions, false), benchrun.Summarise(cut, false)
			row.Sessions, row.Cut = &sum, &cuts
		}
		if row.Error != "" {
			log.Printf("matrix: %s: failed: %s", p.Name, row.Error)
		} else {
			log.Printf("matrix: %s: %.2fx the clean direct pull, worst %.2fx; egress worst %.3fx",
				p.Name, row.VsClean.Median, row.VsClean.Worst, row.Egress.Worst)
		}
		rows = append(rows, row)
	}
	// Worst first: a failed path, then by the worst run's time, then by
	// the worst run's bytes.
	slices.SortStableFunc(rows, func(a, b matrixRow) int {
		if (a.Error != "") != (b.Error != "") {
			if a.Error != "" {
				return -1
			}
			return 1
		}
		if a.VsClean == nil || b.VsClean == nil {
			return 0
		}
		return cmp.Or(cmp.Compare(b.VsClean.Worst, a.VsClean.Worst), cmp.Compare(b.Egress.Worst, a.Egress.Worst))
	})
	return rows
}

// matrixPull pulls the image across path p with the carrier seeded with
// seed: through a fresh pullproxy (proxied), or containerd directly; with
// cuts, the path's cuts, else none.
func (b *bench) matrixPull(ctx context.Context, p pathSpec, seed uint64, proxied, cuts bool) (sample, error) {
	ctx, cancel := context.WithTimeout(ctx, runTimeout)
	defer cancel()
	relay, err := b.pathCarrier(ctx, p, seed, cuts)
	if err != nil {
		return sample{}, err
	}
	defer relay.Close()
	scheme, hosts := "https", b.directHosts
	if !p.TLS {
		scheme, hosts = "http", mirrorHosts
	}
	target := relay.Addr()
	var px *proxyProcess
	if proxied {
		if px, err = startProxy(ctx, b, scheme+"://"+relay.Addr()); err != nil {
			return sample{}, err
		}
		defer px.stop()
		target, hosts = px.Addr, mirrorHosts
	}
	s, err := b.pullAcross(ctx, relay, target, hosts, "pull")
	if err != nil {
		return sample{}, err
	}
	if px != nil {
		const discarded, abandoned, overtaken = `pullproxy_upstream_wasted_bytes_total{kind="discarded"}`,
			`pullproxy_upstream_wasted_bytes_total{kind="abandoned"}`, `pullproxy_upstream_chunks_total{result="overtaken"}`
		c, err := px.counters(ctx, discarded, abandoned, overtaken)
		if err != nil {
			return sample{}, err
		}
		s.discarded, s.abandoned = c[discarded]/float64(b.bytes), c[abandoned]/float64(b.bytes)
		s.overtaken = c[overtaken]
		s.rssMiB = px.PeakRSSMiB()
	}
	return s, nil
}

// pathCarrier starts the carrier for path p; with cuts, it cuts as p says
// (from its first session's BadFrom on, for BadFor, if p turns bad
// mid-pull).
func (b *bench) pathCarrier(ctx context.Context, p pathSpec, seed uint64, cuts bool) (*carrier.Relay, error) {
	target := b.reg.Host()
	if !p.TLS {
		target = b.plainReg.Host()
	}
	clean := carrier.Config{Target: target, Bandwidth: b.cfg.Bandwidth, Seed: seed,
		RTT: time.Duration(p.RTTms) * time.Millisecond, Jitter: time.Duration(p.JitterMs) * time.Millisecond,
		SlowStart: true, HandshakeThrough: p.HandshakeThrough}
	if p.TLS {
		// TCP's handshake; plain HTTP's is answered by the carrier (see
		// pathSpec.TLS), its round trip paid by the first request.
		clean.SetupRTTs = b.cfg.SetupRTTs
	}
	bad := clean
	bad.Mode, bad.CutProb, bad.CutMin, bad.CutMax = modes[p.Mode], p.CutProb, p.CutMin, p.CutMax
	first := clean
	if cuts && p.BadFor == 0 {
		first = bad
	}
	r, err := carrier.Start(first)
	if err != nil {
		return nil, fmt.Errorf("starting the carrier: %w", err)
	}
	if cuts && p.BadFor > 0 {
		go turnBad(ctx, r, bad, clean, p)
	}
	return r, nil
}

// turnBad makes r cut as bad says from p.BadFrom after its first session,
// for p.BadFor, then clean again, unless ctx ends first.
func turnBad(ctx context.Context, r *carrier.Relay, bad, clean carrier.Config, p pathSpec) {
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for r.Stats().Sessions == 0 {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
	for _, step := range []struct {
		after time.Duration
		cfg   carrier.Config
	}{{seconds(p.BadFrom), bad}, {seconds(p.BadFor), clean}} {
		select {
		case <-ctx.Done():
			return
		case <-time.After(step.after):
		}
		if err := r.SetConfig(step.cfg); err != nil {
			log.Printf("matrix: %s: %v", p.Name, err)
			return
		}
	}
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// printMatrix prints the matrix as Markdown, worst path first.
func printMatrix(w io.Writer, rep report) {
	if len(rep.Matrix) == 0 {
		return
	}
	cfg := rep.Config
	fmt.Fprintf(w, "\nScenario matrix: the cold pull through pullproxy across each path, once per carrier seed (%d), "+
		"against containerd's own direct pull over the same path without cuts (median of %d); %.0f MB/s shared; "+
		"slow start at every RTT above 0. Egress: the bytes leaving the registry, counted where the carrier reads "+
		"them from it (delivered or in flight), over the image's. Head / unused / tail (medians): the time before "+
		"the carrier carried the registry's first byte, the cap's capacity unused between that and the end of the "+
		"last body it carried, as time at the cap, and the time after that end. Waste: what pullproxy itself counted, "+
		"worst runs: the upstream's bytes it discarded and those it asked for and hung up on (at most what the "+
		"upstream sent besides), as shares of the image, and chunk requests overtaken by a hedge. Worst path first.\n\n",
		cfg.MatrixSeeds, cfg.MatrixCleanRuns, float64(cfg.Bandwidth)/1e6)
	fmt.Fprintln(w, "| path | clean direct, median | pullproxy, median | pullproxy, worst | worst / clean "+
		"| median / clean | egress, worst | waste: discarded / abandoned / overtaken | head / unused / tail "+
		"| sessions cut / accepted, median | peak RSS, worst | note |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
	for _, r := range rep.Matrix {
		cells := []string{r.Path.Name, "", "", "", "", "", "", "", "", "", "", ""}
		if r.Clean != nil {
			cells[1] = fmt.Sprintf("%.2f s", r.Clean.Median)
		}
		if r.Proxy != nil {
			cells[2], cells[3] = fmt.Sprintf("%.2f s", r.Proxy.Median), fmt.Sprintf("%.2f s", r.Proxy.Worst)
			cells[4], cells[5] = fmt.Sprintf("%.2fx", r.VsClean.Worst), fmt.Sprintf("%.2fx", r.VsClean.Median)
			cells[6] = fmt.Sprintf("%.3fx", r.Egress.Worst)
			cells[7] = fmt.Sprintf("%.2f%% / %.2f%% / %.0f", 100*r.Discarded.Worst, 100*r.Abandoned.Worst, r.Overtaken.Worst)
			cells[8] = fmt.Sprintf("%.2f / %.2f / %.2f s", r.Head.Median, r.Unused.Median, r.Tail.Median)
			cells[9] = fmt.Sprintf("%.0f / %.0f", r.Cut.Median, r.Sessions.Median)
			cells[10] = fmt.Sprintf("%.0f MiB", r.PeakRSS.Worst)
		}
		if r.Error != "" {
			cells[11] = "failed: " + strings.ReplaceAll(r.Error, "\n", " ")
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}
}
