package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/bench/internal/benchrun"
	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// proxyProcess is a pullproxy serving on loopback with a data dir of its own.
type proxyProcess struct {
	*benchrun.Process
	url     string // "http://" + Addr
	dataDir string
	log     *os.File // its debug log, with -proxy-logs
}

// startProxy starts pullproxy with an empty data dir, mirroring registryHost
// from upstreamURL (https, trusting the registry's test CA).
func startProxy(ctx context.Context, b *bench, upstreamURL string) (*proxyProcess, error) {
	dataDir, err := os.MkdirTemp(b.dir, "data")
	if err != nil {
		return nil, fmt.Errorf("creating pullproxy's data dir: %w", err)
	}
	return startProxyOn(ctx, b, upstreamURL, dataDir)
}

func startProxyOn(ctx context.Context, b *bench, upstreamURL, dataDir string) (*proxyProcess, error) {
	return startProxyWith(ctx, b, []string{upstreamURL}, dataDir, "", nil)
}

// startProxyWith is startProxyOn with the upstream at several endpoints,
// more configuration (YAML appended to the config file) and environment
// (added to pullbench's own).
func startProxyWith(ctx context.Context, b *bench, upstreamURLs []string, dataDir, moreYAML string, env []string) (*proxyProcess, error) {
	config := dataDir + ".yaml"
	var endpoints []string
	for _, u := range upstreamURLs {
		endpoints = append(endpoints, fmt.Sprintf("{url: %q}", u))
	}
	yaml := fmt.Sprintf("upstreams:\n  - name: %s\n    endpoints: [%s]\n    ca_file: %q\n",
		registryHost, strings.Join(endpoints, ", "), b.reg.CAFile())
	if b.cfg.ProxyFetch != "" {
		yaml += "fetch: {" + b.cfg.ProxyFetch + "}\n"
	}
	yaml += moreYAML
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		return nil, fmt.Errorf("writing pullproxy's config: %w", err)
	}
	args := []string{"serve", "--listen", "127.0.0.1:0", "--data-dir", dataDir, "--config", config}
	p := &proxyProcess{dataDir: dataDir}
	var log io.Writer
	if b.proxyLogs != "" {
		args = append(args, "--log-level", "debug")
		var err error
		if p.log, err = os.CreateTemp(b.proxyLogs, "pullproxy-*.log"); err != nil {
			return nil, fmt.Errorf("creating pullproxy's log: %w", err)
		}
		log = p.log
	}
	cmd := exec.Command(b.bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	proc, err := benchrun.Start(ctx, cmd, benchrun.PullproxyAddr, log)
	if err != nil {
		p.closeLog()
		return nil, err
	}
	p.Process, p.url = proc, "http://"+proc.Addr
	return p, nil
}

// stop ends pullproxy and removes its data dir: a full run would
// otherwise leave tens of GiB, and the disk's fullness would end the runs
// after it with 507s (pullproxy keeps 15% of the file system free).
func (p *proxyProcess) stop() {
	p.Stop()
	p.closeLog()
	os.RemoveAll(p.dataDir)
}

func (p *proxyProcess) kill() {
	p.Kill()
	p.closeLog()
}

func (p *proxyProcess) closeLog() {
	if p.log != nil {
		p.log.Close()
	}
}

func (p *proxyProcess) blobURL(d registrytest.Descriptor) string {
	return p.url + "/v2/" + repo + "/blobs/" + d.Digest.String() + "?ns=" + registryHost
}

// getBlob fetches a blob through the proxy and checks its digest.
func getBlob(ctx context.Context, url string, d registrytest.Descriptor) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("GET %s: %w", d.Digest, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", d.Digest, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", d.Digest, resp.Status)
	}
	h := sha256.New()
	n, err := io.Copy(h, resp.Body)
	if err != nil {
		return fmt.Errorf("GET %s: after %d bytes: %w", d.Digest, n, err)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != d.Digest.String() {
		return fmt.Errorf("GET %s: got content hashing to %s", d.Digest, got)
	}
	return nil
}

// proxyAcross starts the carrier (see bench.carrier) and a fresh pullproxy
// behind it.
func (b *bench) proxyAcross(ctx context.Context, mode carrier.Mode, prob float64, rtt time.Duration) (*carrier.Relay, *proxyProcess, error) {
	path, err := b.carrier(mode, prob, rtt)
	if err != nil {
		return nil, nil, err
	}
	p, err := startProxy(ctx, b, "https://"+path.Addr())
	if err != nil {
		path.Close()
		return nil, nil, err
	}
	return path, p, nil
}

// coalesce: many clients ask for one cold layer at once, across the
// carrier, which resets sessions with probability prob.
func (b *bench) coalesce(ctx context.Context, prob float64) (sample, error) {
	path, p, err := b.proxyAcross(ctx, carrier.Reset, prob, 0)
	if err != nil {
		return sample{}, err
	}
	defer path.Close()
	defer p.stop()
	layer := b.pushed.Layers[0]
	start := time.Now()
	g, gctx := errgroup.WithContext(ctx)
	for range b.cfg.Clients {
		g.Go(func() error { return getBlob(gctx, p.blobURL(layer), layer) })
	}
	if err := g.Wait(); err != nil {
		return sample{}, err
	}
	took := time.Since(start).Seconds()
	path.Close() // its counts final: bytes still in flight are counted
	return sample{seconds: took, upstream: ratio(path.Stats().BytesEgress, layer.Size), rssMiB: p.PeakRSSMiB()}, nil
}

// killed: pullproxy is killed with SIGKILL when a client has read half of a
// cold layer, restarted on the same data dir, and asked again.
func (b *bench) killed(ctx context.Context) (sample, error) {
	path, p, err := b.proxyAcross(ctx, carrier.Reset, b.cfg.CutProb, 0)
	if err != nil {
		return sample{}, err
	}
	defer path.Close()
	layer := b.pushed.Layers[0]
	start := time.Now()
	resp, err := http.Get(p.blobURL(layer))
	if err != nil {
		p.kill()
		return sample{}, fmt.Errorf("GET %s: %w", layer.Digest, err)
	}
	_, err = io.CopyN(io.Discard, resp.Body, layer.Size/2)
	p.kill()
	resp.Body.Close()
	if err != nil {
		return sample{}, fmt.Errorf("reading the first half: %w", err)
	}
	p, err = startProxyOn(ctx, b, "https://"+path.Addr(), p.dataDir)
	if err != nil {
		return sample{}, fmt.Errorf("restarting pullproxy: %w", err)
	}
	defer p.stop()
	if err := getBlob(ctx, p.blobURL(layer), layer); err != nil {
		return sample{}, fmt.Errorf("after the restart: %w", err)
	}
	took := time.Since(start).Seconds()
	path.Close() // its counts final: bytes still in flight are counted
	return sample{seconds: took, upstream: ratio(path.Stats().BytesEgress, layer.Size)}, nil
}

// memory: many clients pull the whole cold image at once (each blob, three
// at a time per client, as containerd does) while pullproxy's peak resident
// memory is watched.
func (b *bench) memory(ctx context.Context) (sample, error) {
	path, p, err := b.proxyAcross(ctx, carrier.Reset, b.cfg.CutProb, 0)
	if err != nil {
		return sample{}, err
	}
	defer path.Close()
	defer p.stop()
	blobs := append([]registrytest.Descriptor{b.pushed.Config}, b.pushed.Layers...)
	start := time.Now()
	g, gctx := errgroup.WithContext(ctx)
	for range b.cfg.Clients {
		g.Go(func() error {
			cg, cctx := errgroup.WithContext(gctx)
			cg.SetLimit(3)
			for _, d := range blobs {
				cg.Go(func() error { return getBlob(cctx, p.blobURL(d), d) })
			}
			return cg.Wait()
		})
	}
	if err := g.Wait(); err != nil {
		return sample{}, err
	}
	took := time.Since(start).Seconds()
	path.Close() // its counts final: bytes still in flight are counted
	return sample{seconds: took, upstream: ratio(path.Stats().BytesEgress, b.bytes), rssMiB: p.PeakRSSMiB()}, nil
}

// counters sums, per metric name and label set given as name{label="v"},
// the samples of pullproxy's /metrics over all their other labels: what
// pullproxy itself says it did.
func (p *proxyProcess) counters(ctx context.Context, wanted ...string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.url+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("reading pullproxy's metrics: %w", err)
	}
	defer resp.Body.Close()
	sums := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		sample, value, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			continue
		}
		for _, w := range wanted {
			name, label, _ := strings.Cut(w, "{")
			label = strings.TrimSuffix(label, "}")
			if strings.HasPrefix(sample, name+"{") && strings.Contains(sample, label) {
				sums[w] += v
			}
		}
	}
	return sums, sc.Err()
}
