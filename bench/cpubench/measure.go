package main

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

const (
	fetchTimeout = 10 * time.Minute // one cold fetch of every blob
	quietPoll    = 100 * time.Millisecond
	quietPolls   = 3                // polls in a row with no CPU time spent
	quietTimeout = 10 * time.Second // give up waiting for quiet after this long
)

// sample is what one cold fetch through a mirror cost it.
type sample struct {
	User     float64 `json:"user_seconds"`
	Sys      float64 `json:"sys_seconds"`
	Total    float64 `json:"total_seconds"`
	Machine  float64 `json:"machine_seconds"`   // the machine's busy CPU time to the bytes on disk, but this process's
	Wall     float64 `json:"wall_seconds"`      // first request to last byte
	Upstream int64   `json:"upstream_bytes"`    // bytes the relay carried from the registry
	Sessions int64   `json:"upstream_sessions"` // connections through the relay
	Reads    int64   `json:"read_calls"`        // the mirror's read system calls (file and socket)
	Switches int64   `json:"context_switches"`  // the mirror's threads' context switches
}

// result is one mirror's figures over the runs.
type result struct {
	Mirror  string           `json:"mirror"`
	Samples []sample         `json:"samples"`
	User    benchrun.Summary `json:"user_seconds"`
	Sys     benchrun.Summary `json:"sys_seconds"`
	Total   benchrun.Summary `json:"total_seconds"`
	Machine benchrun.Summary `json:"machine_seconds"`
	Wall    benchrun.Summary `json:"wall_seconds"`
	Conns   benchrun.Summary `json:"upstream_sessions"`
	Reads   benchrun.Summary `json:"read_calls"`
	Switch  benchrun.Summary `json:"context_switches"`
	Error   string           `json:"error,omitempty"`
}

type starter func(context.Context) (*mirror, error)

// measureAll measures each mirror cfg.Runs times, rotating which goes
// first so that none always runs on a warmer machine.
func (b *bench) measureAll(ctx context.Context) []result {
	type mirrorSpec struct {
		name  string
		start starter
	}
	var mirrors []mirrorSpec
	add := func(name string, start starter) {
		if b.cfg.Only == "" || b.cfg.Only == name {
			mirrors = append(mirrors, mirrorSpec{name, start})
		}
	}
	add("pullproxy", b.startPullproxy(b.proxyBin))
	add("distribution", b.startDistribution)
	if b.cfg.Baseline != "" {
		add("baseline", b.startPullproxy(b.cfg.Baseline))
	}
	results := make([]result, len(mirrors))
	for i, m := range mirrors {
		results[i].Mirror = m.name
	}
	for run := range b.cfg.Runs {
		for k := range mirrors {
			i := (k + run) % len(mirrors)
			m, r := mirrors[i], &results[i]
			if r.Error != "" {
				continue
			}
			s, err := b.coldFetch(ctx, m.start)
			if err != nil {
				r.Error = err.Error()
				log.Printf("%s, run %d: %v", m.name, run+1, err)
				continue
			}
			log.Printf("%s, run %d: user %.2f s, sys %.2f s, total %.2f s CPU; machine %.2f s CPU; %.2f s wall; %d upstream connections; %d reads, %d context switches",
				m.name, run+1, s.User, s.Sys, s.Total, s.Machine, s.Wall, s.Sessions, s.Reads, s.Switches)
			r.Samples = append(r.Samples, s)
		}
	}
	for i := range results {
		r := &results[i]
		if len(r.Samples) == 0 {
			continue
		}
		r.User = summarise(r.Samples, func(s sample) float64 { return s.User })
		r.Sys = summarise(r.Samples, func(s sample) float64 { return s.Sys })
		r.Total = summarise(r.Samples, func(s sample) float64 { return s.Total })
		r.Machine = summarise(r.Samples, func(s sample) float64 { return s.Machine })
		r.Wall = summarise(r.Samples, func(s sample) float64 { return s.Wall })
		r.Conns = summarise(r.Samples, func(s sample) float64 { return float64(s.Sessions) })
		r.Reads = summarise(r.Samples, func(s sample) float64 { return float64(s.Reads) })
		r.Switch = summarise(r.Samples, func(s sample) float64 { return float64(s.Switches) })
	}
	return results
}

// coldFetch starts a mirror with an empty data dir, fetches every blob
// through it once, and returns the CPU time it spent doing so. With
// -warmup, the mirror first fetches the warm-up image's blobs, unmeasured:
// the measured blobs are still absent from its store, but the process has
// learned its path as a running mirror has.
func (b *bench) coldFetch(ctx context.Context, start starter) (sample, error) {
	m, err := start(ctx)
	if err != nil {
		return sample{}, err
	}
	defer m.stop()
	pid := m.cmd.Process.Pid
	if len(b.warm) > 0 {
		if err := b.fetchImage(ctx, m, b.warmManifests, b.warm); err != nil {
			return sample{}, fmt.Errorf("%s: warming up: %w; its log ends with:\n%s", m.name, err, strings.Join(m.logTail(), "\n"))
		}
		if _, err := waitQuiet(ctx, pid); err != nil {
			return sample{}, err
		}
	}
	if err := benchrun.ResetFreePages(ctx, b.dir); err != nil {
		return sample{}, err
	}
	before, err := benchrun.ReadCPUTime(pid)
	if err != nil {
		return sample{}, err
	}
	activityBefore, err := benchrun.ReadActivity(pid)
	if err != nil {
		return sample{}, err
	}
	// Flush what is dirty now, so that the machine's figure counts only
	// writeback of this fetch's bytes.
	syscall.Sync()
	machineBefore, err := benchrun.ReadMachineCPU()
	if err != nil {
		return sample{}, err
	}
	// The registry and the path run in this process: their work (which
	// depends on how many requests a mirror makes, not on the mirror's
	// own cost) is taken out of the machine's figure.
	selfBefore, err := benchrun.ReadCPUTime(os.Getpid())
	if err != nil {
		return sample{}, err
	}
	relayBefore := b.relay.Stats()
	began := time.Now()
	if err := b.fetchImage(ctx, m, b.manifests, b.blobs); err != nil {
		return sample{}, fmt.Errorf("%s: %w; its log ends with:\n%s", m.name, err, strings.Join(m.logTail(), "\n"))
	}
	wall := time.Since(began)
	after, err := waitQuiet(ctx, pid)
	if err != nil {
		return sample{}, err
	}
	// A mirror that does not sync leaves writing its bytes to disk to the
	// kernel's threads, later: sync makes that happen now, where the
	// machine's figure counts it.
	syscall.Sync()
	machineAfter, err := benchrun.ReadMachineCPU()
	if err != nil {
		return sample{}, err
	}
	selfAfter, err := benchrun.ReadCPUTime(os.Getpid())
	if err != nil {
		return sample{}, err
	}
	relayAfter := b.relay.Stats()
	activity, err := benchrun.ReadActivity(pid)
	if err != nil {
		return sample{}, err
	}
	activity = activity.Sub(activityBefore)
	if err := m.checkStored(b.blobs); err != nil {
		return sample{}, err
	}
	used := after.Sub(before)
	s := sample{
		User:     used.User,
		Sys:      used.Sys,
		Machine:  machineAfter - machineBefore - selfAfter.Sub(selfBefore).Total(),
		Wall:     wall.Seconds(),
		Upstream: relayAfter.BytesEgress - relayBefore.BytesEgress,
		Sessions: relayAfter.Sessions - relayBefore.Sessions,
		Reads:    activity.ReadCalls,
		Switches: activity.Switches,
	}
	s.Total = s.User + s.Sys
	return s, nil
}

// fetchImage fetches an image through m with curl as a client pulling it
// does: its manifests one after another (the tag, then the manifest's
// digest), then its blobs once each, cfg.Parallel at a time. It checks each
// response's status, and each blob's size. (A mirror learns from the
// manifests' requests how far its upstream is before the first blob, as
// in every pull.)
func (b *bench) fetchImage(ctx context.Context, m *mirror, manifests []string, blobs []registrytest.Descriptor) error {
	ctx, cancel := context.WithTimeout(ctx, fetchTimeout)
	defer cancel()
	for _, ref := range manifests {
		if err := curlManifest(ctx, m.manifestURL(ref)); err != nil {
			return err
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(b.cfg.Parallel)
	for _, d := range blobs {
		g.Go(func() error { return curlBlob(gctx, m.blobURL(d), d) })
	}
	return g.Wait()
}

// curl GETs url with extra arguments args, discarding the body, and checks
// that curl's -w output (status, and size where asked) is want.
func curl(ctx context.Context, url, want string, args ...string) error {
	args = append(args, "-sS", "-o", "/dev/null", "--max-time", strconv.Itoa(int(fetchTimeout.Seconds())), url)
	cmd := exec.CommandContext(ctx, "curl", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("curl %s: %w: %s", url, err, bytes.TrimSpace(stderr.Bytes()))
	}
	if string(out) != want {
		return fmt.Errorf("curl %s: got %q, want %q", url, out, want)
	}
	return nil
}

func curlBlob(ctx context.Context, url string, d registrytest.Descriptor) error {
	return curl(ctx, url, fmt.Sprintf("200 %d", d.Size), "-w", "%{http_code} %{size_download}")
}

// manifestAccept is what containerd accepts for a manifest.
const manifestAccept = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, " +
	"application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json"

func curlManifest(ctx context.Context, url string) error {
	return curl(ctx, url, "200", "-w", "%{http_code}", "-H", "Accept: "+manifestAccept)
}

// waitQuiet waits until the process spends no CPU time for quietPolls polls
// in a row (its work after the last response, such as a commit, is done),
// and returns its CPU time then.
func waitQuiet(ctx context.Context, pid int) (benchrun.CPUTime, error) {
	last, err := benchrun.ReadCPUTime(pid)
	if err != nil {
		return benchrun.CPUTime{}, err
	}
	deadline := time.Now().Add(quietTimeout)
	for still := 0; still < quietPolls && time.Now().Before(deadline); {
		select {
		case <-time.After(quietPoll):
		case <-ctx.Done():
			return benchrun.CPUTime{}, ctx.Err()
		}
		t, err := benchrun.ReadCPUTime(pid)
		if err != nil {
			return benchrun.CPUTime{}, err
		}
		if t == last {
			still++
		} else {
			still = 0
		}
		last = t
	}
	return last, nil
}

func summarise(samples []sample, f func(sample) float64) benchrun.Summary {
	runs := make([]float64, len(samples))
	for i, x := range samples {
		runs[i] = f(x)
	}
	return benchrun.Summarise(runs, false)
}
