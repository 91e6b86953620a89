package main

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
)

// runTimeout bounds one run of a measurement.
const runTimeout = 15 * time.Minute

// sample is what one run of a measurement observed.
type sample struct {
	seconds   float64 // measured by pullbench, see pull.go
	upstream  float64 // bytes carried from the registry / bytes needed
	rssMiB    float64 // pullproxy's peak resident memory (VmHWM)
	peakConns float64 // the most sessions open at once on the carrier
	// head runs from the pull's start to the first byte the carrier carried
	// from the registry, tail from the end of the last body it carried to
	// the pull's end: the time spent outside the transfer itself (a
	// whole-image pull's only). unused is how long the path's cap went
	// unused between them (see carrier.Stats.Unused).
	head, tail, unused float64
	sessions, cut      float64 // sessions the carrier accepted, and cut
	// What pullproxy counted (its /metrics): the upstream's bytes it
	// discarded and abandoned over the image's (see
	// pullproxy_upstream_wasted_bytes_total), and chunk requests overtaken.
	discarded, abandoned, overtaken float64
}

// measurement is one row of the table, measured cfg.Runs times.
type measurement struct {
	name       string
	run        func(context.Context) (sample, error)
	upstream   bool // run measures sample.upstream
	rss        bool // run measures sample.rssMiB
	wholeImage bool // a pull of the whole image, comparable with the clean direct pull
	overLink   bool // its bytes cross the carrier: the share of the link and peak sessions mean something
	rtt        time.Duration
}

// result is one row of the table.
type result struct {
	Name          string            `json:"name"`
	RTTms         int64             `json:"rtt_ms"` // the path's round-trip time
	Seconds       *benchrun.Summary `json:"seconds,omitempty"`
	VsClean       float64           `json:"median_vs_clean_direct_median,omitempty"`        // Seconds.Median / the clean direct pull's at the same RTT
	LinkShare     float64           `json:"image_bytes_per_median_second_of_cap,omitempty"` // image bytes / Seconds.Median / the bandwidth cap
	PeakConns     *benchrun.Summary `json:"peak_sessions,omitempty"`                        // the most sessions open at once on the carrier
	UpstreamRatio *benchrun.Summary `json:"upstream_bytes_ratio,omitempty"`                 // bytes carried from the registry / bytes needed
	PeakRSSMiB    *benchrun.Summary `json:"peak_rss_mib,omitempty"`                         // pullproxy's peak resident memory
	Head          *benchrun.Summary `json:"head_seconds,omitempty"`                         // the pull's start to the registry's first byte across the carrier
	Tail          *benchrun.Summary `json:"tail_seconds,omitempty"`                         // the end of the last body across the carrier to the pull's end
	Unused        *benchrun.Summary `json:"unused_seconds,omitempty"`                       // the carrier's cap unused between head and tail, as time at the cap
	Direct        *series           `json:"direct_attempts,omitempty"`                      // the direct pull across the carrier
	Error         string            `json:"error,omitempty"`                                // why the measurement stopped
}

// measureAll measures every row, in the table's order: at each round-trip
// time, the clean direct pull and pullproxy's cold pulls over a clean and a
// cutting path; at the first, the other rows too.
func (b *bench) measureAll(ctx context.Context) []result {
	var results []result
	for i, ms := range b.cfg.RTTs {
		rtt := time.Duration(ms) * time.Millisecond
		direct := measurement{name: "containerd direct, clean path", upstream: true, wholeImage: true, overLink: true, rtt: rtt,
			run: func(ctx context.Context) (sample, error) { return b.direct(ctx, 0, rtt) }}
		clean := b.measure(ctx, direct)
		b.fill(&clean, direct, clean)
		results = append(results, clean)
		if i == 0 && b.cfg.Extras {
			r := b.directAttempts(ctx, rtt)
			logResult(r)
			results = append(results, r)
		}
		for _, m := range b.measurements(rtt, i == 0 && b.cfg.Extras, i == 0 && b.cfg.Replicas) {
			r := b.measure(ctx, m)
			b.fill(&r, m, clean)
			results = append(results, r)
		}
	}
	return results
}

// fill adds the figures a whole-image pull is compared by.
func (b *bench) fill(r *result, m measurement, clean result) {
	if r.Seconds == nil || !m.wholeImage {
		return
	}
	if clean.Seconds != nil {
		r.VsClean = r.Seconds.Median / clean.Seconds.Median
	}
	if m.overLink {
		r.LinkShare = float64(b.bytes) / r.Seconds.Median / float64(b.cfg.Bandwidth)
	}
}

// measurements are the rows after the direct pulls at round-trip time rtt;
// all adds those measured at one round-trip time only, and replicas the
// rows of two replicas sharing a bucket (also at one only).
func (b *bench) measurements(rtt time.Duration, all, replicas bool) []measurement {
	rows := []measurement{
		{name: "pullproxy cold, clean path", upstream: true, rss: true, wholeImage: true, overLink: true, rtt: rtt,
			run: func(ctx context.Context) (sample, error) { return b.viaProxy(ctx, carrier.Reset, 0, rtt, false) }},
		{name: "pullproxy cold, carrier resets", upstream: true, rss: true, wholeImage: true, overLink: true, rtt: rtt,
			run: func(ctx context.Context) (sample, error) {
				return b.viaProxy(ctx, carrier.Reset, b.cfg.CutProb, rtt, false)
			}},
	}
	if all {
		rows = append(rows, b.extras(rtt)...)
	}
	if replicas {
		rows = append(rows, []measurement{
			{name: "replica B after A (shared bucket)", upstream: true, wholeImage: true, rtt: rtt,
				run: func(ctx context.Context) (sample, error) { return b.replicaAfter(ctx, rtt) }},
			{name: "two replicas at once, cold (shared bucket)", upstream: true, rss: true, wholeImage: true, overLink: true, rtt: rtt,
				run: func(ctx context.Context) (sample, error) { return b.replicasAtOnce(ctx, rtt) }},
		}...)
	}
	return rows
}

// extras are the rows of one pullproxy measured at one round-trip time only.
func (b *bench) extras(rtt time.Duration) []measurement {
	layerMiB := b.cfg.LayerSizes[0] / mib
	return []measurement{
		{name: "pullproxy cold, carrier stalls", upstream: true, rss: true, wholeImage: true, overLink: true, rtt: rtt,
			run: func(ctx context.Context) (sample, error) {
				return b.viaProxy(ctx, carrier.Stall, b.cfg.CutProb, rtt, false)
			}},
		{name: "pullproxy warm (second node)", upstream: true, wholeImage: true, rtt: rtt,
			run: func(ctx context.Context) (sample, error) {
				return b.viaProxy(ctx, carrier.Reset, b.cfg.CutProb, rtt, true)
			}},
		{name: fmt.Sprintf("%d clients, one cold %d MiB layer", b.cfg.Clients, layerMiB), upstream: true, rss: true,
			run: func(ctx context.Context) (sample, error) { return b.coalesce(ctx, b.cfg.CutProb) }},
		// Without cuts, nothing but a busy host (the clients hash what
		// they get) makes chunks look slow and be asked for again.
		{name: fmt.Sprintf("%d clients, one cold %d MiB layer, clean path", b.cfg.Clients, layerMiB), upstream: true, rss: true,
			run: func(ctx context.Context) (sample, error) { return b.coalesce(ctx, 0) }},
		{name: fmt.Sprintf("killed halfway through a cold %d MiB layer", layerMiB), upstream: true,
			run: b.killed},
		{name: fmt.Sprintf("cold image, %d clients at once: peak RSS", b.cfg.Clients), upstream: true, rss: true,
			run: b.memory},
	}
}

// measure runs m cfg.Runs times and summarises the runs. It stops at the
// first run that fails.
func (b *bench) measure(ctx context.Context, m measurement) result {
	r := result{Name: m.name, RTTms: m.rtt.Milliseconds()}
	var samples []sample
	for i := range b.cfg.Runs {
		rctx, cancel := context.WithTimeout(ctx, runTimeout)
		s, err := m.run(rctx)
		cancel()
		if err != nil {
			r.Error = fmt.Sprintf("run %d: %v", i+1, err)
			logResult(r)
			return r
		}
		samples = append(samples, s)
	}
	r.Seconds = summarise(samples, func(s sample) float64 { return s.seconds })
	if m.upstream {
		r.UpstreamRatio = summarise(samples, func(s sample) float64 { return s.upstream })
	}
	if m.rss {
		r.PeakRSSMiB = summarise(samples, func(s sample) float64 { return s.rssMiB })
	}
	if m.overLink {
		r.PeakConns = summarise(samples, func(s sample) float64 { return s.peakConns })
	}
	if m.overLink && m.wholeImage && samples[0].tail != 0 {
		r.Head = summarise(samples, func(s sample) float64 { return s.head })
		r.Tail = summarise(samples, func(s sample) float64 { return s.tail })
		r.Unused = summarise(samples, func(s sample) float64 { return s.unused })
	}
	logResult(r)
	return r
}

// summarise summarises one figure of the samples; for every figure reported
// (time, upstream bytes, memory, sessions) larger is worse.
func summarise(samples []sample, figure func(sample) float64) *benchrun.Summary {
	runs := make([]float64, len(samples))
	for i, x := range samples {
		runs[i] = figure(x)
	}
	s := benchrun.Summarise(runs, false)
	return &s
}

func logResult(r result) {
	switch {
	case r.Error != "":
		log.Printf("%s: failed: %s", r.Name, r.Error)
	case r.Direct != nil:
		log.Printf("%s: %s", r.Name, r.Direct.verdict())
	default:
		log.Printf("%s, RTT %d ms: median %.2fs, worst %.2fs", r.Name, r.RTTms, r.Seconds.Median, r.Seconds.Worst)
	}
}
