package main

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
)

// report is what the JSON file holds.
type report struct {
	benchrun.Provenance
	Blobs     int      `json:"blobs"`
	BlobBytes int64    `json:"blob_bytes"`
	Config    config   `json:"config"`
	Results   []result `json:"results"`
	// Ratios: pullproxy's figures over the other mirrors', round by round.
	Ratios []benchrun.Ratio `json:"ratios,omitempty"`
}

// roundRatios divides pullproxy's total and machine CPU by each other
// mirror's, round by round (the mirrors take turns in each).
func roundRatios(results []result) []benchrun.Ratio {
	i := slices.IndexFunc(results, func(r result) bool { return r.Mirror == "pullproxy" })
	if i < 0 {
		return nil
	}
	proxy := results[i]
	var ratios []benchrun.Ratio
	for _, other := range results {
		if other.Mirror == proxy.Mirror {
			continue
		}
		of := "pullproxy/" + other.Mirror
		ratios = append(ratios,
			benchrun.RoundRatios(of+" total CPU", proxy.Total.Runs, other.Total.Runs),
			benchrun.RoundRatios(of+" machine CPU", proxy.Machine.Runs, other.Machine.Runs))
	}
	return ratios
}

// printTable prints the figures as Markdown, under what they were measured
// on and how.
func printTable(w io.Writer, rep report) {
	cfg := rep.Config
	fmt.Fprintf(w, "%s\n\n", rep.Provenance)
	fmt.Fprintf(w, "Cold fetch of an image through the mirror with curl: its manifests one after another, then "+
		"its %d blobs, %.1f MiB, each once, %d at a time; "+
		"a clean %.0f MB/s path from the mirror to its upstream. CPU time of the mirror process (all threads, "+
		"/proc/PID/stat) from the first request until it is quiet after the last response. "+
		"Machine CPU is the whole machine's busy time (/proc/stat) over the same window, closed by a sync, less "+
		"cpubench's own process (the upstream registry and the path, whose cost follows the number of requests "+
		"a mirror makes): it also counts work done for the mirror in kernel threads, such as writing its bytes "+
		"to disk, which a mirror that never syncs leaves to them, and the curl client, the same for every mirror. "+
		"Read calls and context switches are the mirror's (/proc/PID/io syscr, /proc/PID/task/*/status), over the same window. "+
		"Runs per mirror: %d; worst is the largest run, per column.\n\n",
		rep.Blobs, float64(rep.BlobBytes)/mib, cfg.Parallel, float64(cfg.Bandwidth)/1e6, cfg.Runs)
	if cfg.Warmup {
		fmt.Fprintf(w, "Warm process: before each measured fetch, the same mirror process fetched another image of "+
			"the same layers' sizes through the same path, unmeasured, as a mirror that has been running would have; "+
			"the measured blobs were still absent from its store.\n\n")
	}
	if cfg.ResetPages {
		fmt.Fprintf(w, "This machine reports free pages to its host: before each measured fetch its unreported free "+
			"pages were refilled, so that every run's new page cache landed on pages freed a moment before "+
			"(benchrun.ResetFreePages).\n\n")
	}
	fmt.Fprintln(w, "| mirror | user s, median | sys s, median | total CPU s, median | user s, worst | sys s, worst "+
		"| total CPU s, worst | machine CPU s, median | machine CPU s, worst | wall s, median | upstream connections, median | read calls, median | context switches, median | note |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
	for _, r := range rep.Results {
		if len(r.Samples) == 0 {
			fmt.Fprintf(w, "| %s | | | | | | | | | | | | | failed: %s |\n", r.Mirror, strings.ReplaceAll(r.Error, "\n", " "))
			continue
		}
		note := ""
		if r.Error != "" {
			note = fmt.Sprintf("%d runs; then failed: %s", len(r.Samples), strings.ReplaceAll(r.Error, "\n", " "))
		}
		fmt.Fprintf(w, "| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f | %.0f | %s |\n", r.Mirror,
			r.User.Median, r.Sys.Median, r.Total.Median, r.User.Worst, r.Sys.Worst, r.Total.Worst,
			r.Machine.Median, r.Machine.Worst, r.Wall.Median, r.Conns.Median, r.Reads.Median, r.Switch.Median, note)
	}
	if len(rep.Ratios) > 0 {
		fmt.Fprintln(w, "\nRound by round (the mirrors take turns in each round), median (lowest-highest):")
		for _, r := range rep.Ratios {
			fmt.Fprintf(w, "- %s: %s\n", r.Of, r)
		}
	}
}
