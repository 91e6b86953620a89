// Command cpubench measures the CPU time a pull-through mirror spends on a
// cold fetch: pullproxy against distribution's registry in proxy mode, side
// by side, on the same upstream, the same path and the same client.
//
//	go run ./bench/cpubench -runs 3 -json bench/cpu-results.json
//
// The upstream is distribution's registry in process (internal/registrytest)
// holding the incident's image (layers of 223, 197, 149 and 29 MiB plus four
// small ones), behind the carrier relay (bench/carrier) with a 64 MB/s cap
// and no cuts. Each mirror runs as a process of its own with an empty data
// dir: the pullproxy binary (./cmd/pullproxy), and distproxy
// (./bench/cpubench/distproxy), distribution's registry with `proxy:
// remoteurl:` pointing at the relay. curl fetches the image's manifests
// through the mirror one after another, then every blob of the image once,
// three at a time, as containerd does, and the
// mirror's CPU time (user and system, all threads, from /proc/PID/stat) is
// read from just before the first request to when the last response has
// ended and the mirror has gone quiet (its work after the last byte, such
// as a commit, counts). Each stored blob is then hashed and checked against
// its digest, and each response's status and size against the blob's.
// Before each measured fetch, on a virtual machine that reports free pages
// to its host, memory is put in one state (benchrun.ResetFreePages): there,
// writing new page cache cost a mirror up to a CPU-second more per run
// depending on what the runs before it had freed.
//
// It prints a Markdown table (median and worst of -runs, per mirror) and
// writes every run's figures as JSON with the commit they were measured on.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

const (
	registryHost = "registry.bench:5000" // the upstream's name in pullproxy's --upstream
	repo         = "node/app"
	mib          = 1 << 20
)

type config struct {
	Runs       int     `json:"runs"`
	Bandwidth  int64   `json:"bandwidth_bytes_per_second"`
	Parallel   int     `json:"parallel_fetches"`
	Scale      float64 `json:"scale"`
	LayerSizes []int64 `json:"layer_sizes"`
	Only       string  `json:"only,omitempty"`
	Warmup     bool    `json:"warmup,omitempty"`              // each mirror first fetched another image of the same layers' sizes, unmeasured
	Baseline   string  `json:"baseline_binary,omitempty"`     // another pullproxy, measured as a third mirror
	ProxyBin   string  `json:"pullproxy_binary,omitempty"`    // a prebuilt pullproxy instead of ./cmd/pullproxy
	DistBin    string  `json:"distribution_binary,omitempty"` // a prebuilt distproxy instead of ./bench/cpubench/distproxy
	ResetPages bool    `json:"free_pages_reset"`              // free pages were reset before each measured fetch (benchrun.ResetFreePages)
}

type bench struct {
	cfg           config
	dir           string
	proxyBin      string
	distBin       string
	reg           *registrytest.Registry
	relay         *carrier.Relay
	manifests     []string                  // what curl fetches first, as a client resolving the image: its tag (the index), then its manifest's digest
	blobs         []registrytest.Descriptor // then these: the config, then the layers
	bytes         int64                     // the blobs' total size
	warmManifests []string                  // with -warmup: another image's, fetched before the measured ones
	warm          []registrytest.Descriptor // and its blobs
}

func main() {
	cfg, jsonOut, timeout := parseFlags()
	// Interrupted or out of time, it still stops the mirrors and removes its
	// work dir (the image, the mirrors' stores) on the way out.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	err := run(ctx, cfg, jsonOut)
	cancel()
	stop()
	if err != nil {
		log.Fatal(err)
	}
}

func parseFlags() (config, string, time.Duration) {
	var cfg config
	jsonOut := flag.String("json", "", "write results as JSON to this file")
	timeout := flag.Duration("timeout", 30*time.Minute, "give up on the whole benchmark after this long")
	flag.IntVar(&cfg.Runs, "runs", 3, "runs per mirror; the median and the worst run are reported")
	flag.Int64Var(&cfg.Bandwidth, "bandwidth", 64e6, "bandwidth cap of the path between mirror and upstream, bytes/s")
	flag.IntVar(&cfg.Parallel, "parallel", 3, "blobs fetched at once")
	flag.Float64Var(&cfg.Scale, "scale", 1, "scale layer sizes (0.1 for a quick run)")
	flag.BoolVar(&cfg.Warmup, "warmup", false, "before each measured fetch, fetch another image of the same layers' sizes through the same mirror process, unmeasured: a mirror that has been running and has learned its path")
	flag.StringVar(&cfg.Only, "only", "", "measure only this mirror: pullproxy, distribution or baseline")
	flag.StringVar(&cfg.Baseline, "baseline", "", "also measure this pullproxy binary, as the mirror \"baseline\" (e.g. one built before a change)")
	flag.StringVar(&cfg.ProxyBin, "pullproxy", "", "a pullproxy binary to measure instead of building ./cmd/pullproxy")
	flag.StringVar(&cfg.DistBin, "distribution", "", "a distproxy binary to measure instead of building ./bench/cpubench/distproxy")
	flag.Parse()
	cfg.ResetPages = benchrun.ReportsFreePages()
	for _, s := range []int64{223, 197, 149, 29} {
		cfg.LayerSizes = append(cfg.LayerSizes, int64(float64(s*mib)*cfg.Scale))
	}
	cfg.LayerSizes = append(cfg.LayerSizes, 1*mib, 512<<10, 256<<10, 100<<10)
	return cfg, *jsonOut, *timeout
}

func run(ctx context.Context, cfg config, jsonOut string) error {
	if _, err := exec.LookPath("curl"); err != nil {
		return fmt.Errorf("cpubench needs curl: %w", err)
	}
	switch cfg.Only {
	case "", "pullproxy", "distribution":
	case "baseline":
		if cfg.Baseline == "" {
			return fmt.Errorf("-only baseline needs -baseline")
		}
	default:
		return fmt.Errorf("-only %q: want pullproxy, distribution or baseline", cfg.Only)
	}
	prov, err := benchrun.ReadProvenance(ctx, []string{"curl", "--version"})
	if err != nil {
		return err
	}
	b, err := setup(ctx, cfg)
	if err != nil {
		return err
	}
	defer b.close()

	rep := report{Provenance: prov, BlobBytes: b.bytes, Blobs: len(b.blobs), Config: cfg, Results: b.measureAll(ctx)}
	rep.Ratios = roundRatios(rep.Results)
	printTable(os.Stdout, rep)
	if jsonOut != "" {
		return benchrun.WriteJSON(jsonOut, rep)
	}
	return nil
}

// setup builds both mirrors, starts the registry, pushes the image and puts
// the relay in front of the registry.
func setup(ctx context.Context, cfg config) (*bench, error) {
	dir, err := os.MkdirTemp("", "cpubench")
	if err != nil {
		return nil, fmt.Errorf("creating the work dir: %w", err)
	}
	b := &bench{cfg: cfg, dir: dir, proxyBin: filepath.Join(dir, "pullproxy"), distBin: filepath.Join(dir, "distproxy")}
	var builds [][2]string // binary, package
	if cfg.ProxyBin != "" {
		b.proxyBin = cfg.ProxyBin
	} else {
		builds = append(builds, [2]string{b.proxyBin, "./cmd/pullproxy"})
	}
	if cfg.DistBin != "" {
		b.distBin = cfg.DistBin
	} else {
		builds = append(builds, [2]string{b.distBin, "./bench/cpubench/distproxy"})
	}
	for _, bl := range builds {
		if err := benchrun.Build(ctx, bl[0], bl[1]); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	if b.reg, err = registrytest.Start(ctx, filepath.Join(dir, "registry")); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting the registry: %w", err)
	}
	img := registrytest.Image{Repo: repo, Tag: "v1", LayerSizes: cfg.LayerSizes, Seed: 1, Index: true}
	pushed, err := b.reg.Push(ctx, img)
	if err != nil {
		b.close()
		return nil, fmt.Errorf("pushing the image: %w", err)
	}
	b.manifests = []string{img.Tag, pushed.Manifest.Digest.String()}
	b.blobs = append(b.blobs, pushed.Config)
	b.blobs = append(b.blobs, pushed.Layers...)
	if cfg.Warmup {
		img.Tag, img.Seed = "warmup", 2
		warm, err := b.reg.Push(ctx, img)
		if err != nil {
			b.close()
			return nil, fmt.Errorf("pushing the warm-up image: %w", err)
		}
		b.warmManifests = []string{img.Tag, warm.Manifest.Digest.String()}
		b.warm = append(append(b.warm, warm.Config), warm.Layers...)
	}
	for _, d := range b.blobs {
		b.bytes += d.Size
	}
	if b.relay, err = carrier.Start(carrier.Config{Target: b.reg.Host(), Bandwidth: cfg.Bandwidth}); err != nil {
		b.close()
		return nil, fmt.Errorf("starting the relay: %w", err)
	}
	log.Printf("image: %d blobs, %.1f MiB; path: %.0f MB/s, no cuts", len(b.blobs), float64(b.bytes)/mib,
		float64(cfg.Bandwidth)/1e6)
	return b, nil
}

func (b *bench) close() {
	if b.relay != nil {
		b.relay.Close()
	}
	if b.reg != nil {
		b.reg.Close()
	}
	os.RemoveAll(b.dir)
}
