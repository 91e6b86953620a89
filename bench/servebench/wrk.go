package main

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
)

// wrkRun is what one wrk run reported.
type wrkRun struct {
	RequestsPerSec float64 `json:"requests_per_second"`
	BytesPerSec    float64 `json:"bytes_per_second"` // wrk's Transfer/sec, its units being powers of 1024
	Requests       int64   `json:"requests"`
	SocketErrors   int64   `json:"socket_errors,omitempty"` // connect + read + write + timeout
	Non2xx         int64   `json:"non_2xx_3xx,omitempty"`
	// ServerCPUMicros is the server's CPU time (user + system, all its
	// processes) during the run, per request completed, in µs: measured
	// from /proc, less sensitive to a busy machine than requests/s.
	ServerCPUMicros float64 `json:"server_cpu_us_per_request"`
	// MachineCPUMicros is the whole machine's busy time (/proc/stat, all
	// CPUs) per request: the server, wrk and the kernel's work for both. A
	// server cheaper in its own time can still cost the machine more, and
	// on a machine that wrk and the server share, requests/s follows this.
	MachineCPUMicros float64 `json:"machine_cpu_us_per_request"`
	// MachineBusy is the share of the machine's CPU time that was busy over
	// the run: below 1, the server and wrk left processors idle, waiting on
	// each other.
	MachineBusy float64 `json:"machine_busy"`
}

var (
	reqRE      = regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`)
	transferRE = regexp.MustCompile(`Transfer/sec:\s+([0-9.]+)([KMGT]?)B`)
	countRE    = regexp.MustCompile(`(\d+) requests in `)
	socketRE   = regexp.MustCompile(`Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)`)
	non2xxRE   = regexp.MustCompile(`Non-2xx or 3xx responses: (\d+)`)

	// unit is what wrk's suffixes multiply by: it prints bytes in powers of 1024.
	unit = map[string]float64{"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
)

// runWrk runs wrk against url for d (whole seconds: wrk takes no less),
// bounded by d plus a minute.
func runWrk(ctx context.Context, url string, threads, conns int, d time.Duration) (wrkRun, error) {
	d = max(d.Round(time.Second), time.Second)
	ctx, cancel := context.WithTimeout(ctx, d+time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "wrk", "-t", strconv.Itoa(threads), "-c", strconv.Itoa(conns),
		"-d", fmt.Sprintf("%ds", int(d.Seconds())), "--timeout", "30s", url)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if ctx.Err() != nil {
		return wrkRun{}, fmt.Errorf("wrk %s: did not finish within %v", url, d+time.Minute)
	}
	if err != nil {
		return wrkRun{}, fmt.Errorf("wrk %s: %w: %s%s", url, err, out, stderr.Bytes())
	}
	return parseWrk(string(out))
}

// parseWrk reads wrk's summary.
func parseWrk(out string) (wrkRun, error) {
	var r wrkRun
	m := reqRE.FindStringSubmatch(out)
	t := transferRE.FindStringSubmatch(out)
	c := countRE.FindStringSubmatch(out)
	if m == nil || t == nil || c == nil {
		return r, fmt.Errorf("wrk's output has no Requests/sec, Transfer/sec or request count:\n%s", out)
	}
	r.RequestsPerSec, _ = strconv.ParseFloat(m[1], 64)
	r.BytesPerSec, _ = strconv.ParseFloat(t[1], 64)
	r.BytesPerSec *= unit[t[2]]
	r.Requests, _ = strconv.ParseInt(c[1], 10, 64)
	if s := socketRE.FindStringSubmatch(out); s != nil {
		for _, v := range s[1:] {
			n, _ := strconv.ParseInt(v, 10, 64)
			r.SocketErrors += n
		}
	}
	if s := non2xxRE.FindStringSubmatch(out); s != nil {
		r.Non2xx, _ = strconv.ParseInt(s[1], 10, 64)
	}
	if r.Non2xx > 0 || r.Requests == 0 {
		return r, fmt.Errorf("wrk: %d requests, %d answered other than 2xx or 3xx:\n%s", r.Requests, r.Non2xx, out)
	}
	return r, nil
}

// summarize is the median and the worst (lowest) of a figure over the runs.
func summarize(v []float64) benchrun.Summary { return benchrun.Summarise(v, true) }

// result is one server serving one blob, over the runs.
type result struct {
	Server         string           `json:"server"`
	Blob           string           `json:"blob"`
	Connections    int              `json:"connections"`
	URL            string           `json:"url"`
	Runs           []wrkRun         `json:"runs"`
	RequestsPerSec benchrun.Summary `json:"requests_per_second"`
	BytesPerSec    benchrun.Summary `json:"bytes_per_second"`
	CPUMicros      benchrun.Summary `json:"server_cpu_us_per_request"`
	MachineMicros  benchrun.Summary `json:"machine_cpu_us_per_request"`
	MachineBusy    benchrun.Summary `json:"machine_busy"`
	Error          string           `json:"error,omitempty"`
}

// measureAll warms every server up on every blob, then makes the runs: in
// each, every blob is served by every server in turn, starting with a
// different server each run.
func measureAll(ctx context.Context, cfg config, e *env) []result {
	results := make([]result, 0, len(cfg.Blobs)*len(servers))
	idx := map[[2]int]int{}
	for bi, b := range cfg.Blobs {
		for si, s := range servers {
			idx[[2]int{bi, si}] = len(results)
			at := slices.IndexFunc(blobSpecs, func(x blobSpec) bool { return x.Name == b.Name }) // e.urls' order
			results = append(results, result{Server: s, Blob: b.Name, Connections: b.Connections, URL: e.urls[s][at]})
		}
	}
	if cfg.Warmup > 0 {
		for bi, b := range cfg.Blobs {
			for si := range servers {
				r := &results[idx[[2]int{bi, si}]]
				if _, err := runWrk(ctx, r.URL, cfg.Threads, b.Connections, cfg.Warmup); err != nil {
					r.Error = "warm-up: " + err.Error()
				}
			}
		}
	}
	for run := range cfg.Runs {
		for bi, b := range cfg.Blobs {
			for k := range servers {
				si := (k + run) % len(servers)
				r := &results[idx[[2]int{bi, si}]]
				if r.Error != "" || ctx.Err() != nil {
					continue
				}
				pids := e.pids[r.Server]()
				before, err := benchrun.ReadCPUTime(pids...)
				if err != nil {
					r.Error = err.Error()
					continue
				}
				machineBefore, err := benchrun.ReadMachineCPU()
				if err != nil {
					r.Error = err.Error()
					continue
				}
				start := time.Now()
				w, err := runWrk(ctx, r.URL, cfg.Threads, b.Connections, cfg.Duration)
				if err != nil {
					r.Error = err.Error()
					continue
				}
				machineAfter, err := benchrun.ReadMachineCPU()
				if err != nil {
					r.Error = err.Error()
					continue
				}
				wall := time.Since(start)
				after, err := benchrun.ReadCPUTime(pids...)
				if err != nil {
					r.Error = err.Error()
					continue
				}
				if w.Requests > 0 {
					w.ServerCPUMicros = after.Sub(before).Total() / float64(w.Requests) * 1e6
					w.MachineCPUMicros = (machineAfter - machineBefore) / float64(w.Requests) * 1e6
				}
				w.MachineBusy = (machineAfter - machineBefore) / (wall.Seconds() * float64(runtime.NumCPU()))
				log.Printf("run %d/%d, %s, %s: %.0f req/s, %.1f MiB/s, %.1f CPU-µs/request (machine %.1f, %.0f%% busy)",
					run+1, cfg.Runs, b.Name, r.Server, w.RequestsPerSec, w.BytesPerSec/(1<<20), w.ServerCPUMicros,
					w.MachineCPUMicros, 100*w.MachineBusy)
				r.Runs = append(r.Runs, w)
			}
		}
	}
	for i := range results {
		r := &results[i]
		var rps, bps, cpu, machine, busy []float64
		for _, w := range r.Runs {
			rps, bps, cpu = append(rps, w.RequestsPerSec), append(bps, w.BytesPerSec), append(cpu, w.ServerCPUMicros)
			machine, busy = append(machine, w.MachineCPUMicros), append(busy, w.MachineBusy)
		}
		r.RequestsPerSec, r.BytesPerSec = summarize(rps), summarize(bps)
		r.CPUMicros, r.MachineMicros = benchrun.Summarise(cpu, false), benchrun.Summarise(machine, false)
		r.MachineBusy = benchrun.Summarise(busy, true)
	}
	return results
}
