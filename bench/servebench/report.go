package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
)

// report is what the JSON file holds.
type report struct {
	benchrun.Provenance
	Config  config   `json:"config"`
	Results []result `json:"results"`
	// Ratios: pullproxy's bytes/s over nginx's, per blob, round by round.
	Ratios []blobRatio `json:"ratios,omitempty"`
}

// blobRatio is a round-by-round ratio for one blob.
type blobRatio struct {
	Blob string `json:"blob"`
	benchrun.Ratio
}

// roundRatios divides pullproxy's bytes/s (default logging) by nginx's for
// each blob, round by round: the two take turns in each.
func roundRatios(cfg config, results []result) []blobRatio {
	var ratios []blobRatio
	for _, b := range cfg.Blobs {
		var proxy, nginx []float64
		for _, r := range results {
			switch {
			case r.Blob != b.Name:
			case r.Server == serverProxy:
				proxy = r.BytesPerSec.Runs
			case r.Server == serverNginx:
				nginx = r.BytesPerSec.Runs
			}
		}
		ratios = append(ratios, blobRatio{b.Name, benchrun.RoundRatios(serverProxy+"/"+serverNginx+" bytes/s", proxy, nginx)})
	}
	return ratios
}

// printTable prints one row per blob and one column per server: requests/s
// and GiB/s, each as the median and the worst run.
func printTable(w io.Writer, rep report) {
	cfg := rep.Config
	fmt.Fprintf(w, "%s\n\n", rep.Provenance)
	fmt.Fprintf(w, "wrk, %d threads, keep-alive, %v per run, %d runs; each cell: requests/s and GiB/s as wrk "+
		"reports them, the server's CPU time per request (user + system, from /proc; distribution's includes "+
		"the idle benchmark process it runs in), and the whole machine's busy time per request (/proc/stat: the "+
		"server, wrk and the kernel's work for both) with the share of the machine busy over the run; median "+
		"(worst).\n\n", cfg.Threads, cfg.Duration, cfg.Runs)
	fmt.Fprintf(w, "| blob | connections | %s |\n", strings.Join(servers, " | "))
	fmt.Fprintf(w, "| --- | ---: |%s\n", strings.Repeat(" ---: |", len(servers)))
	for _, b := range cfg.Blobs {
		cells := []string{b.Name, fmt.Sprint(b.Connections)}
		for _, s := range servers {
			cells = append(cells, cell(rep.Results, b.Name, s))
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}
	if len(rep.Ratios) > 0 {
		fmt.Fprintln(w, "\nRound by round (the servers take turns in each round), median (lowest-highest):")
		for _, r := range rep.Ratios {
			fmt.Fprintf(w, "- %s, %s: %s\n", r.Blob, r.Of, r.Ratio)
		}
	}
}

func cell(results []result, blob, server string) string {
	for _, r := range results {
		if r.Blob != blob || r.Server != server {
			continue
		}
		if r.Error != "" {
			first, _, _ := strings.Cut(r.Error, "\n")
			return "failed: " + first
		}
		const gib = 1 << 30
		return fmt.Sprintf("%.0f (%.0f) req/s, %.2f (%.2f) GiB/s, %.1f (%.1f) CPU-µs/req, machine %.1f (%.1f) CPU-µs/req, "+
			"%.0f%% (%.0f%%) busy", r.RequestsPerSec.Median, r.RequestsPerSec.Worst, r.BytesPerSec.Median/gib,
			r.BytesPerSec.Worst/gib, r.CPUMicros.Median, r.CPUMicros.Worst, r.MachineMicros.Median, r.MachineMicros.Worst,
			100*r.MachineBusy.Median, 100*r.MachineBusy.Worst)
	}
	return ""
}
