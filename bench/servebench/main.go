// Command servebench measures serving cached blobs to nodes: pullproxy
// against nginx serving the very same files with sendfile, and against
// distribution's registry serving the same blobs from its filesystem storage.
//
//	go run ./bench/servebench -runs 3 -duration 10s -json bench/serve-results.json
//
// It pushes an image with layers of 104 KiB, 2 MiB and 223 MiB (pseudo-random,
// incompressible) to distribution's registry, run in process on loopback
// (internal/registrytest), builds pullproxy from ./cmd/pullproxy and starts it
// twice, each with a data dir of its own and that registry as its upstream:
// once with the default log level (info: one line per request, the point of
// the measurement) and once with --log-level warn. Each blob is pulled once
// through each pullproxy and checked against its digest, which stores it.
// nginx (sendfile on, keep-alive, an access log, worker_processes auto) then
// serves the blob files in the first pullproxy's data dir.
//
// Every server is measured with wrk (2 threads, keep-alive): the 104 KiB and
// 2 MiB blobs with 64 connections, the 223 MiB blob with 4. Requests/s and
// bytes/s are wrk's own figures, parsed from its output. Each measurement is
// made -runs times; the servers take turns within a run (their order rotates
// from run to run) so that machine noise hits them alike, after one short
// unrecorded warm-up of each. The table shows the median and the worst run;
// the JSON holds every run and the commit measured (git rev-parse HEAD and
// whether the work tree had uncommitted changes). Every wrk run is bounded in
// time, and so is the whole benchmark (-timeout).
//
// It needs nginx and wrk on the PATH (Debian: apt-get install nginx wrk) and
// must run from the repository root. pullproxy's log and nginx's access log
// go to files in the work dir, which is removed at the end (-keep keeps it).
package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

const (
	upstreamName = "bench.local" // the upstream pullproxy mirrors; never resolved
	repo         = "node/app"
)

// blobSpec is a blob size and the wrk connections it is measured with.
type blobSpec struct {
	Name        string `json:"name"`
	Bytes       int64  `json:"bytes"`
	Connections int    `json:"connections"`
}

var blobSpecs = []blobSpec{
	{"104 KiB", 104 << 10, 64},
	{"2 MiB", 2 << 20, 64},
	{"223 MiB", 223 << 20, 4},
}

type config struct {
	Runs     int           `json:"runs"`
	Duration time.Duration `json:"duration_ns"`
	Warmup   time.Duration `json:"warmup_ns"`
	Threads  int           `json:"wrk_threads"`
	Blobs    []blobSpec    `json:"blobs"`
}

func main() {
	var cfg config
	jsonOut := flag.String("json", "", "write the results as JSON to this file")
	flag.IntVar(&cfg.Runs, "runs", 3, "runs per measurement; the median and the worst are reported")
	flag.DurationVar(&cfg.Duration, "duration", 10*time.Second, "length of one wrk run")
	flag.DurationVar(&cfg.Warmup, "warmup", 2*time.Second, "length of the unrecorded warm-up of each server and blob (0: none)")
	timeout := flag.Duration("timeout", 0, "bound on the whole benchmark (default: enough for every run, plus 5 minutes)")
	keep := flag.Bool("keep", false, "keep the work dir (logs, data dirs, nginx.conf)")
	only := flag.String("blobs", "", `measure only these blob sizes, comma-separated names ("2 MiB"); default: all`)
	flag.Parse()
	cfg.Threads, cfg.Blobs = 2, blobSpecs
	if *only != "" {
		cfg.Blobs = nil
		for _, b := range blobSpecs {
			if slices.Contains(strings.Split(*only, ","), b.Name) {
				cfg.Blobs = append(cfg.Blobs, b)
			}
		}
		if len(cfg.Blobs) == 0 {
			log.Fatalf("servebench: -blobs %q names none of the blob sizes (%q, %q, %q)", *only,
				blobSpecs[0].Name, blobSpecs[1].Name, blobSpecs[2].Name)
		}
	}
	if cfg.Runs < 1 || cfg.Duration <= 0 {
		log.Fatal("servebench: -runs must be at least 1 and -duration positive")
	}
	if *timeout == 0 {
		per := cfg.Duration + cfg.Warmup + 5*time.Second
		*timeout = time.Duration(len(cfg.Blobs)*len(servers)*(cfg.Runs+1))*per + 5*time.Minute
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if err := run(ctx, cfg, *jsonOut, *keep); err != nil {
		log.Fatal("servebench: ", err)
	}
}

func run(ctx context.Context, cfg config, jsonOut string, keep bool) error {
	for _, tool := range []string{"nginx", "wrk"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found on the PATH: servebench needs nginx and wrk (Debian: apt-get install nginx wrk)", tool)
		}
	}
	prov, err := benchrun.ReadProvenance(ctx, []string{"nginx", "-v"}, []string{"wrk", "-v"})
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "servebench")
	if err != nil {
		return fmt.Errorf("creating the work dir: %w", err)
	}
	if keep {
		log.Printf("work dir: %s", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	env, err := setup(ctx, dir)
	if err != nil {
		return err
	}
	defer env.close()

	rep := report{Provenance: prov, Config: cfg, Results: measureAll(ctx, cfg, env)}
	rep.Ratios = roundRatios(cfg, rep.Results)
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("the benchmark ran out of time (-timeout): %w", err)
	}
	printTable(os.Stdout, rep)
	if jsonOut != "" {
		return benchrun.WriteJSON(jsonOut, rep)
	}
	return nil
}

// env is what is measured: the URL of each blob at each server.
type env struct {
	reg     *registrytest.Registry
	proxies []*proxyProcess
	nginx   *nginxProcess
	urls    map[string][]string     // server name → URL of each blob, in blobSpecs' order
	pids    map[string]func() []int // server name → its processes, whose CPU time is measured
}

func (e *env) close() {
	if e.nginx != nil {
		e.nginx.stop()
	}
	for _, p := range e.proxies {
		p.stop()
	}
	if e.reg != nil {
		e.reg.Close()
	}
}

// setup builds and starts everything, and checks that every server serves
// every blob with the right content.
func setup(ctx context.Context, dir string) (*env, error) {
	bin := filepath.Join(dir, "pullproxy")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/pullproxy").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("building pullproxy (run from the repository root): %w\n%s", err, out)
	}
	e := &env{urls: map[string][]string{}, pids: map[string]func() []int{}}
	// distribution runs in this process: its CPU time is this process's,
	// with servebench's own (idle while wrk runs) included.
	e.pids[serverDistribution] = func() []int { return []int{os.Getpid()} }
	var err error
	if e.reg, err = registrytest.Start(ctx, filepath.Join(dir, "registry")); err != nil {
		return nil, fmt.Errorf("starting the registry: %w", err)
	}
	sizes := make([]int64, len(blobSpecs))
	for i, b := range blobSpecs {
		sizes[i] = b.Bytes
	}
	pushed, err := e.reg.Push(ctx, registrytest.Image{Repo: repo, Tag: "v1", LayerSizes: sizes, Seed: 1})
	if err != nil {
		e.close()
		return nil, fmt.Errorf("pushing the blobs: %w", err)
	}
	blobs := pushed.Layers
	for _, b := range blobs {
		e.urls[serverDistribution] = append(e.urls[serverDistribution], e.reg.URL()+"/v2/"+repo+"/blobs/"+b.Digest.String())
	}
	for _, level := range []string{"", "warn"} {
		p, err := startProxy(ctx, bin, filepath.Join(dir, "pullproxy-"+cmp.Or(level, "default")), e.reg.URL(), level)
		if err != nil {
			e.close()
			return nil, err
		}
		e.proxies = append(e.proxies, p)
		name := serverProxy
		if level != "" {
			name = serverProxyWarn
		}
		e.pids[name] = func() []int { return []int{p.cmd.Process.Pid} }
		for _, b := range blobs {
			e.urls[name] = append(e.urls[name], p.blobURL(b.Digest))
		}
	}
	// Pulling each blob once through pullproxy stores it.
	for _, p := range e.proxies {
		for _, b := range blobs {
			if err := checkBlob(ctx, p.blobURL(b.Digest), b); err != nil {
				e.close()
				return nil, fmt.Errorf("warming pullproxy: %w", err)
			}
		}
	}
	if e.nginx, err = startNginx(ctx, filepath.Join(dir, "nginx"), filepath.Join(e.proxies[0].dataDir, "blobs")); err != nil {
		e.close()
		return nil, err
	}
	nginxPid := e.nginx.cmd.Process.Pid
	e.pids[serverNginx] = func() []int { return append([]int{nginxPid}, benchrun.Children(nginxPid)...) }
	for _, b := range blobs {
		e.urls[serverNginx] = append(e.urls[serverNginx], e.nginx.url+"/"+string(b.Digest.Algorithm())+"/"+b.Digest.Encoded()[:2]+"/"+b.Digest.Encoded())
	}
	for _, s := range servers {
		for i, b := range blobs {
			if err := checkBlob(ctx, e.urls[s][i], b); err != nil {
				e.close()
				return nil, fmt.Errorf("%s: %w", s, err)
			}
		}
	}
	return e, nil
}
