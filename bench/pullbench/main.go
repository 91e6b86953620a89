// Command pullbench measures pulling the incident's image (layers of 223,
// 197, 149 and 29 MiB plus small ones) across a simulated carrier that kills
// 60% of TCP sessions after 1.3–3.1 MB, under one shared bandwidth cap:
// containerd pulling directly (the baseline, on a clean path and on the
// carrier), and through pullproxy cold and warm. It prints a Markdown table
// and writes the results as JSON.
//
//	go run ./bench/pullbench -runs 3 -json bench/results.json
//
// Every cold measurement starts from an empty pullproxy data dir and a new
// containerd. It needs root, containerd and ctr (see bench/README.md).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

const (
	registryHost = "registry.bench:5000" // what containerd asks for; never resolvable
	repo         = "node/app"
	mib          = 1 << 20
)

type config struct {
	Runs           int     `json:"runs"`
	Bandwidth      int64   `json:"bandwidth_bytes_per_second"`
	CutProb        float64 `json:"cut_probability"`
	CutMin         int64   `json:"cut_min_bytes"`
	CutMax         int64   `json:"cut_max_bytes"`
	Scale          float64 `json:"scale"`
	DirectAttempts int     `json:"direct_max_attempts"`
	Clients        int     `json:"clients"`
	LayerSizes     []int64 `json:"layer_sizes"`
}

// result is one row of the table.
type result struct {
	Name          string    `json:"name"`
	Seconds       []float64 `json:"seconds"`                  // each run
	Median        float64   `json:"median_seconds"`           // median of Seconds
	VsClean       float64   `json:"vs_clean_direct"`          // Median / clean direct median
	UpstreamRatio float64   `json:"upstream_bytes_ratio"`     // bytes carried from the registry / bytes needed
	Attempts      int       `json:"attempts,omitempty"`       // pull attempts until success
	PeakRSSMiB    float64   `json:"peak_rss_mib,omitempty"`   // pullproxy's peak resident memory
	Simulated     bool      `json:"simulated_time,omitempty"` // Seconds include simulated kubelet backoff
	Note          string    `json:"note,omitempty"`
	wholeImage    bool      // a pull of the image, comparable with the clean direct pull
}

type bench struct {
	cfg    config
	dir    string
	bin    string
	reg    *registrytest.Registry
	pushed registrytest.Pushed
	ref    string
	bytes  int64 // bytes of the image containerd fetches for one platform
}

func main() {
	var cfg config
	jsonOut := flag.String("json", "", "write results as JSON to this file")
	flag.IntVar(&cfg.Runs, "runs", 3, "runs per measurement; the median is reported")
	flag.Int64Var(&cfg.Bandwidth, "bandwidth", 64e6, "shared bandwidth cap of the carrier, bytes/s")
	flag.Float64Var(&cfg.Scale, "scale", 1, "scale layer sizes (0.1 for a quick run)")
	flag.IntVar(&cfg.DirectAttempts, "direct-attempts", 12, "attempts of the direct pull across the carrier before giving up")
	flag.IntVar(&cfg.Clients, "clients", 20, "concurrent clients for the coalescing and memory measurements")
	flag.Parse()
	cfg.CutProb, cfg.CutMin, cfg.CutMax = 0.6, 1_300_000, 3_100_000
	for _, s := range []int64{223, 197, 149, 29} {
		cfg.LayerSizes = append(cfg.LayerSizes, int64(float64(s*mib)*cfg.Scale))
	}
	cfg.LayerSizes = append(cfg.LayerSizes, 1*mib, 512<<10, 256<<10, 100<<10)

	if ok, reason := containerdtest.Available(); !ok {
		log.Fatalf("pullbench needs containerd: %s", reason)
	}
	ctx := context.Background()
	b, err := setup(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(b.dir)
	defer b.reg.Close()

	var results []result
	clean := b.measure("containerd direct, clean path", func(ctx context.Context) (result, error) {
		return b.direct(ctx, 0)
	})
	results = append(results, clean)
	add := func(r result) {
		if clean.Median > 0 && r.wholeImage {
			r.VsClean = r.Median / clean.Median
		}
		results = append(results, r)
		log.Printf("%s: median %.2fs (%.2fx clean), upstream %.3fx", r.Name, r.Median, r.VsClean, r.UpstreamRatio)
	}
	add(b.directThroughCarrier(ctx))
	add(b.measure("pullproxy cold, carrier resets", func(ctx context.Context) (result, error) {
		return b.viaProxy(ctx, carrier.Reset, false)
	}))
	add(b.measure("pullproxy cold, carrier stalls", func(ctx context.Context) (result, error) {
		return b.viaProxy(ctx, carrier.Stall, false)
	}))
	add(b.measure("pullproxy warm (second node)", func(ctx context.Context) (result, error) {
		return b.viaProxy(ctx, carrier.Reset, true)
	}))
	add(b.measure(fmt.Sprintf("%d clients, one cold %d MiB layer", cfg.Clients, cfg.LayerSizes[0]/mib), b.coalesce))
	add(b.measure(fmt.Sprintf("killed halfway through a cold %d MiB layer", cfg.LayerSizes[0]/mib), b.killed))
	add(b.measure(fmt.Sprintf("cold image, %d clients at once: peak RSS", cfg.Clients), b.memory))

	printTable(os.Stdout, cfg, b, results)
	if *jsonOut != "" {
		out, _ := json.MarshalIndent(map[string]any{
			"date": time.Now().UTC().Format(time.RFC3339), "cpus": runtime.NumCPU(),
			"image_bytes": b.bytes, "config": cfg, "results": results,
		}, "", "  ")
		if err := os.WriteFile(*jsonOut, append(out, '\n'), 0o644); err != nil {
			log.Fatal(err)
		}
	}
}

// setup builds pullproxy, starts the registry and pushes the image.
func setup(ctx context.Context, cfg config) (*bench, error) {
	dir, err := os.MkdirTemp("", "pullbench")
	if err != nil {
		return nil, err
	}
	b := &bench{cfg: cfg, dir: dir, bin: filepath.Join(dir, "pullproxy"), ref: registryHost + "/" + repo + ":v1"}
	if out, err := exec.Command("go", "build", "-o", b.bin, "./cmd/pullproxy").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("building pullproxy (run from the repository root): %v\n%s", err, out)
	}
	if b.reg, err = registrytest.Start(ctx, filepath.Join(dir, "registry")); err != nil {
		return nil, err
	}
	img := registrytest.Image{Repo: repo, Tag: "v1", LayerSizes: cfg.LayerSizes, Seed: 1, Index: true}
	if b.pushed, err = b.reg.Push(ctx, img); err != nil {
		return nil, err
	}
	b.bytes = b.pushed.Index.Size + b.pushed.Manifest.Size + b.pushed.Config.Size
	for _, l := range b.pushed.Layers {
		b.bytes += l.Size
	}
	log.Printf("image: %d layers, %.1f MiB", len(b.pushed.Layers), float64(b.bytes)/mib)
	return b, nil
}

// measure runs fn cfg.Runs times and summarises.
func (b *bench) measure(name string, fn func(context.Context) (result, error)) result {
	var all []result
	for i := range b.cfg.Runs {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		r, err := fn(ctx)
		cancel()
		if err != nil {
			log.Printf("%s, run %d: %v", name, i+1, err)
			return result{Name: name, Note: "failed: " + err.Error()}
		}
		all = append(all, r)
	}
	out := all[0]
	out.Name = name
	out.wholeImage = all[0].wholeImage
	out.Seconds = nil
	for _, r := range all {
		out.Seconds = append(out.Seconds, r.Seconds...)
		out.UpstreamRatio = max(out.UpstreamRatio, r.UpstreamRatio) // worst run
		out.PeakRSSMiB = max(out.PeakRSSMiB, r.PeakRSSMiB)
	}
	out.Median = median(out.Seconds)
	return out
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func (b *bench) carrier(mode carrier.Mode, prob float64) (*carrier.Relay, error) {
	return carrier.Start(carrier.Config{Target: b.reg.Host(), CutProb: prob, CutMin: b.cfg.CutMin,
		CutMax: b.cfg.CutMax, Mode: mode, Bandwidth: b.cfg.Bandwidth, Seed: uint64(time.Now().UnixNano())})
}

// pull makes a new containerd fetch the image with hostsDir's configuration.
func (b *bench) pull(ctx context.Context, hosts func(*containerdtest.Daemon) (string, error)) (time.Duration, error) {
	dir, err := os.MkdirTemp(b.dir, "containerd")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	d, err := containerdtest.Start(ctx, dir)
	if err != nil {
		return 0, err
	}
	defer d.Stop()
	hostsDir, err := hosts(d)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	out, err := d.ContentFetch(ctx, hostsDir, b.ref)
	if err != nil {
		return time.Since(start), fmt.Errorf("%w\n%s", err, out)
	}
	return time.Since(start), nil
}

// direct is containerd pulling from the registry across the carrier.
func (b *bench) direct(ctx context.Context, prob float64) (result, error) {
	path, err := b.carrier(carrier.Reset, prob)
	if err != nil {
		return result{}, err
	}
	defer path.Close()
	took, err := b.pull(ctx, func(d *containerdtest.Daemon) (string, error) {
		return d.WriteDirectHostsDir(registryHost, path.URL())
	})
	if err != nil {
		return result{}, err
	}
	return result{Seconds: []float64{took.Seconds()}, UpstreamRatio: ratio(path.Stats().BytesDown, b.bytes),
		wholeImage: true}, nil
}

// directThroughCarrier is what the incident's nodes lived through: every
// reset fails the whole pull, and kubelet retries after 10 s, doubling to
// 300 s. The backoff is added, not slept.
func (b *bench) directThroughCarrier(ctx context.Context) result {
	r := result{Name: "containerd direct, carrier resets (+ kubelet backoff)", Simulated: true, wholeImage: true}
	var total time.Duration
	backoff := 10 * time.Second
	for attempt := 1; attempt <= b.cfg.DirectAttempts; attempt++ {
		res, err := b.direct(ctx, b.cfg.CutProb)
		if err == nil {
			total += time.Duration(res.Seconds[0] * float64(time.Second))
			r.Attempts, r.Seconds, r.Median = attempt, []float64{total.Seconds()}, total.Seconds()
			r.Note = fmt.Sprintf("succeeded on attempt %d", attempt)
			return r
		}
		total += backoff // the failed attempt's own seconds are small next to it
		backoff = min(backoff*2, 300*time.Second)
	}
	r.Attempts, r.Seconds, r.Median = b.cfg.DirectAttempts, []float64{total.Seconds()}, total.Seconds()
	r.Note = fmt.Sprintf("not done after %d attempts (%.0f min simulated)", b.cfg.DirectAttempts, total.Minutes())
	return r
}

// viaProxy is containerd pulling through a fresh pullproxy across the
// carrier; warm measures a second containerd pulling what the first did.
func (b *bench) viaProxy(ctx context.Context, mode carrier.Mode, warm bool) (result, error) {
	path, p, err := b.proxyAcross(ctx, mode)
	if err != nil {
		return result{}, err
	}
	defer path.Close()
	defer p.stop()
	mirror := func(d *containerdtest.Daemon) (string, error) { return d.WriteHostsDir(registryHost, p.url) }
	took, err := b.pull(ctx, mirror)
	if err != nil {
		return result{}, fmt.Errorf("cold pull through pullproxy: %w", err)
	}
	if warm {
		before := path.Stats().BytesDown
		if took, err = b.pull(ctx, mirror); err != nil {
			return result{}, fmt.Errorf("warm pull through pullproxy: %w", err)
		}
		return result{Seconds: []float64{took.Seconds()}, Attempts: 1, wholeImage: true,
			UpstreamRatio: ratio(path.Stats().BytesDown-before, b.bytes)}, nil
	}
	return result{Seconds: []float64{took.Seconds()}, Attempts: 1, PeakRSSMiB: p.peakRSS(), wholeImage: true,
		UpstreamRatio: ratio(path.Stats().BytesDown, b.bytes)}, nil
}

func ratio(a, b int64) float64 { return float64(a) / float64(b) }

func printTable(w io.Writer, cfg config, b *bench, results []result) {
	fmt.Fprintf(w, "Image: %d layers, %.1f MiB. Carrier: %.0f%% of sessions cut after %.1f–%.1f MB, %.0f MB/s shared. "+
		"%d runs each, median shown. %d CPUs.\n\n", len(b.pushed.Layers), float64(b.bytes)/mib, cfg.CutProb*100,
		float64(cfg.CutMin)/1e6, float64(cfg.CutMax)/1e6, float64(cfg.Bandwidth)/1e6, cfg.Runs, runtime.NumCPU())
	fmt.Fprintln(w, "| measurement | median time | vs clean direct | upstream bytes / needed | attempts | peak RSS | note |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: | --- |")
	for _, r := range results {
		t := fmt.Sprintf("%.2f s", r.Median)
		if r.Simulated {
			t = fmt.Sprintf("%.0f s (simulated)", r.Median)
		}
		opt := func(v float64, f string) string {
			if v == 0 {
				return ""
			}
			return fmt.Sprintf(f, v)
		}
		att := ""
		if r.Attempts > 0 {
			att = fmt.Sprint(r.Attempts)
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s |\n", r.Name, t, opt(r.VsClean, "%.2fx"),
			opt(r.UpstreamRatio, "%.3fx"), att, opt(r.PeakRSSMiB, "%.0f MiB"), r.Note)
	}
}
