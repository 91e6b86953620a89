// Command pullbench measures pulling the incident's image (layers of 223,
// 197, 149 and 29 MiB plus small ones) across a simulated carrier that kills
// 60% of TCP sessions after 1.3–3.1 MB, under one shared bandwidth cap, at
// round-trip times of 0, 40 and 100 ms (each session paying a set-up round
// trip and TCP slow start; the registry speaks TLS with a test CA, whose
// handshake crosses the path too, and redirects blob GETs to its storage,
// served by the same server, as ECR and Docker Hub redirect to theirs):
// containerd pulling directly (the
// baseline, on a clean path and on the carrier), and through pullproxy cold
// and warm; and two pullproxy replicas sharing a bucket (MinIO, on this
// machine), one pulling after the other and both at once. It prints a
// Markdown table and writes the results as JSON, with the commit they were
// measured on.
//
//	go run ./bench/pullbench -runs 3 -json bench/results.json
//
// Every time reported is measured by pullbench itself (see pull.go and
// bench/README.md); nothing is read from ctr's output. Every cold
// measurement starts from an empty pullproxy data dir and a new containerd.
// It needs root, containerd and ctr (see bench/README.md).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"strconv"
	"strings"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/miniotest"
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
	RTTs           []int64 `json:"rtts_ms"`               // the path's round-trip times measured at
	SetupRTTs      int     `json:"setup_rtts"`            // round trips of set-up per session besides TLS's own
	Extras         bool    `json:"extras"`                // the rows measured at the first RTT only were measured
	Replicas       bool    `json:"replicas"`              // the rows of two replicas sharing a MinIO bucket were measured
	ProxyFetch     string  `json:"proxy_fetch,omitempty"` // pullproxy's fetch settings, when not the defaults
	// The scenario matrix (see matrix.go): runs of pullproxy's cold pull
	// per path, one per carrier seed, and of the clean direct pull it is
	// compared with; 0: no matrix.
	MatrixSeeds     int    `json:"matrix_seeds,omitempty"`
	MatrixCleanRuns int    `json:"matrix_clean_runs,omitempty"`
	MatrixPaths     string `json:"matrix_paths,omitempty"` // a regular expression the measured paths' names match
	// Sources: measure the several-endpoint scenarios (see sources.go),
	// with the matrix's seeds and clean runs.
	Sources bool `json:"several_endpoints,omitempty"`
	// Background: measure a pull beside a sync (see background.go), with
	// the matrix's seeds.
	Background bool `json:"beside_sync,omitempty"`
}

type bench struct {
	cfg config
	dir string
	bin string
	reg *registrytest.Registry
	// plainReg serves reg's content in plain HTTP, for the matrix's paths
	// without TLS; nil without a matrix.
	plainReg *registrytest.Registry
	pushed   registrytest.Pushed
	ref      string
	bytes    int64 // bytes of the image containerd fetches for one platform

	proxyLogs string // where each pullproxy's debug log goes; "": nowhere
	corrupt   corruptHosts
}

func main() {
	cfg, jsonOut, proxyLogs, cpuProfile := parseFlags()
	if cpuProfile != "" {
		// The harness's own work (the registry's TLS, the carrier's
		// shaping) shares the machine with the pulls it measures.
		f, err := os.Create(cpuProfile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer f.Close()
	}
	err := run(context.Background(), cfg, jsonOut, proxyLogs)
	if cpuProfile != "" {
		pprof.StopCPUProfile()
	}
	if err != nil {
		log.Fatal(err)
	}
}

func parseFlags() (cfg config, jsonOut, proxyLogs, cpuProfile string) {
	flag.StringVar(&jsonOut, "json", "", "write results as JSON to this file")
	flag.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of pullbench itself (registry, carrier, taps) to this file")
	flag.StringVar(&proxyLogs, "proxy-logs", "", "write each pullproxy's debug log to a file in this directory")
	flag.IntVar(&cfg.Runs, "runs", 3, "runs per measurement; the median and the worst run are reported")
	flag.Int64Var(&cfg.Bandwidth, "bandwidth", 64e6, "shared bandwidth cap of the carrier, bytes/s")
	flag.Float64Var(&cfg.Scale, "scale", 1, "scale layer sizes (0.1 for a quick run)")
	flag.IntVar(&cfg.DirectAttempts, "direct-attempts", 12, "attempts of the direct pull across the carrier before giving up")
	flag.IntVar(&cfg.Clients, "clients", 20, "concurrent clients for the coalescing and memory measurements")
	rtts := flag.String("rtts", "0,40,100", `round-trip times of the path to measure the table's rows at, in ms ("": none)`)
	matrix := flag.String("matrix", "off", "the scenario matrix: off, quick (2 seeds per path, 1 clean pull) or full (5 and 3)")
	flag.StringVar(&cfg.MatrixPaths, "matrix-paths", "", "measure only the matrix's paths whose names match this regular expression")
	flag.BoolVar(&cfg.Sources, "several-endpoints", true, "with -matrix, also pull through an upstream at several endpoints, "+
		"each behind a path of its own, with the matrix's seeds")
	flag.BoolVar(&cfg.Background, "beside-sync", true, "with -matrix, also pull beside another node's pull, and beside a sync, "+
		"of a second image, with the matrix's seeds")
	flag.BoolVar(&cfg.Extras, "extras", true, "measure the direct pull across the carrier, stalls, the warm pull, coalescing, "+
		"a kill and memory, at the first RTT")
	flag.BoolVar(&cfg.Replicas, "replicas", true, "measure two pullproxy replicas sharing a MinIO bucket (a pull through one "+
		"after a pull through the other, and both at once, cold), at the first RTT; needs minio on PATH")
	flag.StringVar(&cfg.ProxyFetch, "proxy-fetch", "", `pullproxy's fetch settings, as YAML flow mapping entries, e.g. "max_connection_budget: 1MiB"`)
	flag.IntVar(&cfg.SetupRTTs, "setup-rtts", 1, "round trips of set-up per session before TLS's own (TCP's handshake)")
	flag.Parse()
	switch *matrix {
	case "off":
	case "quick":
		cfg.MatrixSeeds, cfg.MatrixCleanRuns = 2, 1
	case "full":
		cfg.MatrixSeeds, cfg.MatrixCleanRuns = 5, 3
	default:
		log.Fatalf("-matrix %q: want off, quick or full", *matrix)
	}
	if _, err := regexp.Compile(cfg.MatrixPaths); err != nil {
		log.Fatalf("-matrix-paths: %v", err)
	}
	for _, f := range strings.Split(*rtts, ",") {
		if strings.TrimSpace(f) == "" {
			continue
		}
		ms, err := strconv.ParseInt(strings.TrimSpace(f), 10, 64)
		if err != nil || ms < 0 {
			log.Fatalf("-rtts %q: want milliseconds, comma-separated", *rtts)
		}
		cfg.RTTs = append(cfg.RTTs, ms)
	}
	cfg.CutProb, cfg.CutMin, cfg.CutMax = 0.6, 1_300_000, 3_100_000
	for _, s := range []int64{223, 197, 149, 29} {
		cfg.LayerSizes = append(cfg.LayerSizes, int64(float64(s*mib)*cfg.Scale))
	}
	cfg.LayerSizes = append(cfg.LayerSizes, 1*mib, 512<<10, 256<<10, 100<<10)
	return cfg, jsonOut, proxyLogs, cpuProfile
}

func run(ctx context.Context, cfg config, jsonOut, proxyLogs string) error {
	if proxyLogs != "" {
		if err := os.MkdirAll(proxyLogs, 0o755); err != nil {
			return fmt.Errorf("-proxy-logs: %w", err)
		}
	}
	if ok, reason := containerdtest.Available(); !ok {
		return fmt.Errorf("pullbench needs containerd: %s", reason)
	}
	if cfg.Replicas {
		if ok, reason := miniotest.Available(); !ok {
			log.Printf("skipping the rows of replicas sharing a bucket: %s", reason)
			cfg.Replicas = false
		}
	}
	prov, err := benchrun.ReadProvenance(ctx, []string{"ctr", "--version"})
	if err != nil {
		return err
	}
	b, err := setup(ctx, cfg)
	if err != nil {
		return err
	}
	defer b.close()
	b.proxyLogs = proxyLogs

	rep := report{Provenance: prov, ImageBytes: b.bytes, Config: cfg, Results: b.measureAll(ctx)}
	if cfg.MatrixSeeds > 0 {
		rep.Matrix = b.matrix(ctx)
	}
	if cfg.Sources && cfg.MatrixSeeds > 0 {
		rep.Sources = b.sources(ctx)
	}
	if cfg.Background && cfg.MatrixSeeds > 0 {
		rep.Background = b.background(ctx)
	}
	printTable(os.Stdout, rep)
	printMatrix(os.Stdout, rep)
	printSources(os.Stdout, rep)
	printBackground(os.Stdout, rep)
	if jsonOut != "" {
		return benchrun.WriteJSON(jsonOut, rep)
	}
	return nil
}

// setup builds pullproxy, starts the registry and pushes the image.
func setup(ctx context.Context, cfg config) (*bench, error) {
	dir, err := os.MkdirTemp("", "pullbench")
	if err != nil {
		return nil, fmt.Errorf("creating the work dir: %w", err)
	}
	b := &bench{cfg: cfg, dir: dir, ref: registryHost + "/" + repo + ":v1"}
	if b.bin, err = benchrun.BuildPullproxy(ctx, dir); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if b.reg, err = registrytest.Start(ctx, filepath.Join(dir, "registry"), registrytest.WithTLS(), registrytest.WithBlobRedirects(),
		registrytest.WithHandlerWrapper(b.corrupt.wrap)); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting the registry: %w", err)
	}
	img := registrytest.Image{Repo: repo, Tag: "v1", LayerSizes: cfg.LayerSizes, Seed: 1, Index: true}
	if b.pushed, err = b.reg.Push(ctx, img); err != nil {
		b.close()
		return nil, fmt.Errorf("pushing the image: %w", err)
	}
	b.bytes = b.pushed.Index.Size + b.pushed.Manifest.Size + b.pushed.Config.Size
	for _, l := range b.pushed.Layers {
		b.bytes += l.Size
	}
	log.Printf("image: %d layers, %.1f MiB", len(b.pushed.Layers), float64(b.bytes)/mib)
	if cfg.MatrixSeeds > 0 {
		// The same storage, in plain HTTP.
		if b.plainReg, err = registrytest.Start(ctx, filepath.Join(dir, "registry"), registrytest.WithBlobRedirects()); err != nil {
			b.close()
			return nil, fmt.Errorf("starting the plain HTTP registry: %w", err)
		}
	}
	return b, nil
}

func (b *bench) close() {
	if b.plainReg != nil {
		b.plainReg.Close()
	}
	b.reg.Close()
	os.RemoveAll(b.dir)
}
