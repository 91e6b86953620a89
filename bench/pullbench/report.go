package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
)

// report is what results.json holds.
type report struct {
	benchrun.Provenance
	ImageBytes int64           `json:"image_bytes"`
	Config     config          `json:"config"`
	Results    []result        `json:"results"`
	Matrix     []matrixRow     `json:"matrix,omitempty"`
	Sources    []sourcesRow    `json:"several_endpoints,omitempty"`
	Background []backgroundRow `json:"beside_sync,omitempty"`
}

// printTable prints the figures as Markdown, under what they were measured
// on and how.
func printTable(w io.Writer, rep report) {
	cfg := rep.Config
	fmt.Fprintf(w, "%s\n\n", rep.Provenance)
	if len(rep.Results) == 0 {
		return
	}
	fmt.Fprintf(w, "Image: %d layers, %.1f MiB. Carrier: %.0f%% of sessions cut after %.1f–%.1f MB (\"carrier\" rows; "+
		"\"clean path\" rows: no cuts), %.0f MB/s shared; at a round-trip time above 0 each session waits %d round "+
		"trip(s) of set-up and then TCP slow start (10 segments doubling each round trip); the registry speaks "+
		"TLS and answers blob GETs with a redirect to its storage. Runs per measurement: %d. Times are measured by pullbench: a containerd pull from ctr's first "+
		"connection to ctr's exit, the other rows from the first request to the last byte received. "+
		"\"Of the link\" is the image's bytes over the median time, as a share of the cap (computed, not measured). "+
		"\"Head / unused / tail\": from the pull's start to the first byte the carrier carried from the registry; "+
		"how long the cap went unused between that and the end of the last response body it carried (no session "+
		"had bytes to send for longer than the cap's 4 ms bucket: the capacity the client side left idle); and from "+
		"that end (its last write of 8 KiB or more) to the pull's end (medians).\n\n",
		len(cfg.LayerSizes), float64(rep.ImageBytes)/mib, cfg.CutProb*100, float64(cfg.CutMin)/1e6,
		float64(cfg.CutMax)/1e6, float64(cfg.Bandwidth)/1e6, cfg.SetupRTTs, cfg.Runs)
	if cfg.Replicas {
		fmt.Fprintf(w, "Replica rows: two pullproxy replicas, each with an empty data dir, sharing a fresh bucket of a "+
			"MinIO server on this machine (its data on the same disk), their upstream across the carrier with resets; "+
			"new replicas and a new bucket for every run. \"replica B after A\": a containerd pulls through A "+
			"(not timed), pullbench waits until every blob of the image is in the bucket, then a new containerd "+
			"pulls through B; time and upstream bytes are B's pull's. \"two replicas at once\": two new "+
			"containerds pull the cold image together, one through each replica; the time runs from the earlier "+
			"pull's first connection to the later one's exit, upstream bytes are both pulls' over one image's, "+
			"peak RSS the larger replica's.\n\n")
	}
	n := cfg.Runs
	fmt.Fprintf(w, "| RTT | measurement | time, median of %d | time, worst of %d | median time / clean direct median "+
		"| of the link | upstream bytes / needed, worst of %d | peak sessions, worst of %d | peak RSS, worst of %d | head / unused / tail | note |\n",
		n, n, n, n, n)
	fmt.Fprintln(w, "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
	for _, r := range rep.Results {
		fmt.Fprintf(w, "| %s |\n", strings.Join(row(r), " | "))
	}
}

// row is a result's cells, in the table's order.
func row(r result) []string {
	cells := []string{fmt.Sprintf("%d ms", r.RTTms), r.Name, "", "", "", "", "", "", "", "", ""}
	switch {
	case r.Error != "":
		cells[10] = "failed: " + strings.ReplaceAll(r.Error, "\n", " ")
	case r.Direct != nil:
		cells[2], cells[10] = r.Direct.verdict(), r.Direct.describe()
	default:
		cells[2] = fmt.Sprintf("%.2f s", r.Seconds.Median)
		cells[3] = fmt.Sprintf("%.2f s", r.Seconds.Worst)
	}
	if r.VsClean != 0 {
		cells[4] = fmt.Sprintf("%.2fx", r.VsClean)
	}
	if r.LinkShare != 0 {
		cells[5] = fmt.Sprintf("%.0f%%", r.LinkShare*100)
	}
	if r.UpstreamRatio != nil {
		cells[6] = fmt.Sprintf("%.3fx", r.UpstreamRatio.Worst)
	}
	if r.PeakConns != nil {
		cells[7] = fmt.Sprintf("%.0f", r.PeakConns.Worst)
	}
	if r.PeakRSSMiB != nil {
		cells[8] = fmt.Sprintf("%.0f MiB", r.PeakRSSMiB.Worst)
	}
	if r.Head != nil && r.Tail != nil {
		cells[9] = fmt.Sprintf("%.2f / %.2f / %.2f s", r.Head.Median, r.Unused.Median, r.Tail.Median)
	}
	return cells
}

// describe lists the attempts' measured times and how they ended, e.g.
// "... they took 0.41, 0.22 s; 2 ended with: connection reset by peer".
func (s *series) describe() string {
	secs := make([]string, len(s.Attempts))
	var reasons []string
	count := map[string]int{}
	for i, a := range s.Attempts {
		secs[i] = fmt.Sprintf("%.2f", a.Seconds)
		reason := a.Outcome
		if reason != pulled {
			reason = "ended with: " + lastPart(reason)
		}
		if count[reason] == 0 {
			reasons = append(reasons, reason)
		}
		count[reason]++
	}
	for i, reason := range reasons {
		reasons[i] = fmt.Sprintf("%d %s", count[reason], reason)
	}
	return fmt.Sprintf("one series of attempts, a new containerd each, no wait between them; they took %s s; %s",
		strings.Join(secs, ", "), strings.Join(reasons, "; "))
}

// lastPart is the innermost cause of a wrapped error message: what follows
// its last ": ".
func lastPart(msg string) string {
	if i := strings.LastIndex(msg, ": "); i >= 0 {
		return msg[i+2:]
	}
	return msg
}
