package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/internal/containerdtest"
)

// fetch is one `ctr content fetch` as pullbench saw it.
type fetch struct {
	// took runs from ctr's first connection to the registry or mirror (seen
	// by the tap in front of it) to ctr's exit, when the image's content is
	// committed in containerd's store.
	took    time.Duration
	first   time.Time // ctr's first connection
	end     time.Time // ctr's exit
	failure string    // ctr's error if it exited non-zero, else ""
}

// around returns how long the pull ran before the carrier carried the
// registry's first byte, and after the end of the last body it carried, in
// seconds.
func (f fetch) around(st carrier.Stats) (head, tail float64) {
	if st.FirstDown.IsZero() || st.LastData.IsZero() {
		return 0, 0
	}
	return st.FirstDown.Sub(f.first).Seconds(), f.end.Sub(st.LastData).Seconds()
}

// hostsFunc writes the hosts.toml that sends registryHost's requests to
// addr (host:port) and returns the hosts directory.
type hostsFunc func(d *containerdtest.Daemon, addr string) (string, error)

// directHosts sends containerd to the registry itself, over TLS, trusting
// the registry's test CA.
func (b *bench) directHosts(d *containerdtest.Daemon, addr string) (string, error) {
	return d.WriteDirectHostsDir(registryHost, "https://"+addr, b.reg.CAFile())
}

// mirrorHosts sends containerd to pullproxy, on loopback in plain http as a
// mirror on the node's LAN would be.
func mirrorHosts(d *containerdtest.Daemon, addr string) (string, error) {
	return d.WriteHostsDir(registryHost, "http://"+addr)
}

// pull makes a new containerd fetch the image from target (host:port), with
// the configuration hosts writes, through a tap that times the pull. An
// error means the pull could not be made; a pull that failed is a fetch with
// a failure.
func (b *bench) pull(ctx context.Context, target string, hosts hostsFunc) (fetch, error) {
	d, remove, err := b.newContainerd(ctx)
	if err != nil {
		return fetch{}, err
	}
	defer remove()
	return b.pullOn(ctx, d, target, hosts)
}

// pullOn is pull with a containerd already started (and still empty).
func (b *bench) pullOn(ctx context.Context, d *containerdtest.Daemon, target string, hosts hostsFunc) (fetch, error) {
	return b.pullRefOn(ctx, d, target, hosts, b.ref)
}

// pullRefOn is pullOn of ref rather than the image.
func (b *bench) pullRefOn(ctx context.Context, d *containerdtest.Daemon, target string, hosts hostsFunc, ref string) (fetch, error) {
	t, err := startTap(target)
	if err != nil {
		return fetch{}, err
	}
	defer t.close()
	hostsDir, err := hosts(d, t.addr())
	if err != nil {
		return fetch{}, err
	}
	// --debug turns ctr's progress display off: with it, ctr exits only at
	// the display's next 100 ms tick after the fetch has ended.
	out, err := d.Ctr(ctx, "--debug", "content", "fetch", "--hosts-dir", hostsDir, ref)
	end := time.Now()
	var f fetch
	if err != nil {
		f.failure = ctrMessage(out, err)
	}
	first, ok := t.firstConn()
	if !ok {
		return fetch{}, fmt.Errorf("ctr made no request (ctr's error: %q)", f.failure)
	}
	f.took, f.first, f.end = end.Sub(first), first, end
	return f, nil
}

// newContainerd starts a containerd with a new, empty dir; remove stops it
// and removes the dir.
func (b *bench) newContainerd(ctx context.Context) (d *containerdtest.Daemon, remove func(), err error) {
	dir, err := os.MkdirTemp(b.dir, "containerd")
	if err != nil {
		return nil, nil, fmt.Errorf("creating containerd's dir: %w", err)
	}
	if d, err = containerdtest.Start(ctx, dir); err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	return d, func() {
		d.Stop()
		os.RemoveAll(dir)
	}, nil
}

// ctrMessage is the error ctr printed last ("ctr: ..."), or err's first line
// if it printed none.
func ctrMessage(out []byte, err error) string {
	lines := bytes.Split(bytes.TrimSpace(out), []byte("\n"))
	for i := len(lines) - 1; i >= 0; i-- {
		if msg, ok := bytes.CutPrefix(lines[i], []byte("ctr: ")); ok {
			return string(msg)
		}
	}
	first, _, _ := strings.Cut(err.Error(), "\n")
	return first
}

// direct is containerd pulling from the registry across the carrier, with
// sessions cut with probability prob, at round-trip time rtt.
func (b *bench) direct(ctx context.Context, prob float64, rtt time.Duration) (sample, error) {
	path, err := b.carrier(carrier.Reset, prob, rtt)
	if err != nil {
		return sample{}, err
	}
	defer path.Close()
	return b.pullAcross(ctx, path, path.Addr(), b.directHosts, "direct pull")
}

// pullAcross is a pull of the whole image from target with hosts, whose
// bytes cross path, as a sample: the pull's time and the path's counts,
// read once it is closed (bytes still in flight count). A failed pull is
// an error that says what failed (what).
func (b *bench) pullAcross(ctx context.Context, path *carrier.Relay, target string, hosts hostsFunc, what string) (sample, error) {
	f, err := b.pull(ctx, target, hosts)
	if err != nil {
		return sample{}, err
	}
	if f.failure != "" {
		return sample{}, fmt.Errorf("%s failed after %.2fs: %s", what, f.took.Seconds(), f.failure)
	}
	path.Close()
	st := path.Stats()
	head, tail := f.around(st)
	return sample{seconds: f.took.Seconds(), upstream: ratio(st.BytesEgress, b.bytes), peakConns: float64(st.PeakOpen),
		sessions: float64(st.Sessions), cut: float64(st.Cut), head: head, tail: tail, unused: st.Unused.Seconds()}, nil
}

// attempt is one direct pull across the carrier with resets.
type attempt struct {
	Seconds       float64 `json:"seconds"`        // ctr's first connection to its exit
	UpstreamBytes int64   `json:"upstream_bytes"` // what the carrier carried from the registry
	Outcome       string  `json:"outcome"`        // "pulled", or the error ctr exited with
}

const pulled = "pulled"

// series is the direct pull across the carrier, attempted until it succeeds
// or MaxAttempts have failed.
type series struct {
	MaxAttempts int       `json:"max_attempts"`
	Finished    bool      `json:"finished"`
	Attempts    []attempt `json:"attempts"`
}

// verdict says how the series ended, e.g. "did not finish in 12 attempts".
func (s *series) verdict() string {
	if s.Finished {
		return fmt.Sprintf("pulled on attempt %d of %d", len(s.Attempts), s.MaxAttempts)
	}
	return fmt.Sprintf("did not finish in %d attempts", len(s.Attempts))
}

// directAttempts is what the incident's nodes lived through: a reset fails
// the whole pull, and the pull is made again from the start, by a new
// containerd, up to cfg.DirectAttempts times. The attempts follow each other
// at once; the backoff kubelet would wait between them is not part of it.
func (b *bench) directAttempts(ctx context.Context, rtt time.Duration) result {
	r := result{Name: "containerd direct, carrier resets", RTTms: rtt.Milliseconds(), Direct: &series{MaxAttempts: b.cfg.DirectAttempts}}
	for i := range b.cfg.DirectAttempts {
		rctx, cancel := context.WithTimeout(ctx, runTimeout)
		a, err := b.directAttempt(rctx, rtt)
		cancel()
		if err != nil {
			r.Error = fmt.Sprintf("attempt %d: %v", i+1, err)
			return r
		}
		r.Direct.Attempts = append(r.Direct.Attempts, a)
		if a.Outcome == pulled {
			r.Direct.Finished = true
			break
		}
	}
	return r
}

func (b *bench) directAttempt(ctx context.Context, rtt time.Duration) (attempt, error) {
	path, err := b.carrier(carrier.Reset, b.cfg.CutProb, rtt)
	if err != nil {
		return attempt{}, err
	}
	defer path.Close()
	f, err := b.pull(ctx, path.Addr(), b.directHosts)
	if err != nil {
		return attempt{}, err
	}
	a := attempt{Seconds: f.took.Seconds(), UpstreamBytes: path.Stats().BytesEgress, Outcome: pulled}
	if f.failure != "" {
		a.Outcome = f.failure
	}
	return a, nil
}

// viaProxy is containerd pulling through a fresh pullproxy across the
// carrier, with sessions cut with probability prob at round-trip time rtt;
// warm measures a second containerd pulling what the first did.
func (b *bench) viaProxy(ctx context.Context, mode carrier.Mode, prob float64, rtt time.Duration, warm bool) (sample, error) {
	path, p, err := b.proxyAcross(ctx, mode, prob, rtt)
	if err != nil {
		return sample{}, err
	}
	defer path.Close()
	defer p.stop()
	if !warm {
		s, err := b.pullAcross(ctx, path, p.Addr, mirrorHosts, "cold pull through pullproxy")
		s.rssMiB = p.PeakRSSMiB()
		return s, err
	}
	f, err := b.pull(ctx, p.Addr, mirrorHosts)
	if err != nil {
		return sample{}, err
	}
	if f.failure != "" {
		return sample{}, fmt.Errorf("cold pull through pullproxy failed after %.2fs: %s", f.took.Seconds(), f.failure)
	}
	before := path.Stats().BytesEgress
	if f, err = b.pull(ctx, p.Addr, mirrorHosts); err != nil {
		return sample{}, err
	}
	if f.failure != "" {
		return sample{}, fmt.Errorf("warm pull through pullproxy failed after %.2fs: %s", f.took.Seconds(), f.failure)
	}
	return sample{seconds: f.took.Seconds(), upstream: ratio(path.Stats().BytesEgress-before, b.bytes)}, nil
}

// carrier starts the simulated path to the registry: cuts in mode with
// probability prob, the bandwidth cap, and at round-trip time rtt the
// set-up round trips and slow start of a wide-area path.
func (b *bench) carrier(mode carrier.Mode, prob float64, rtt time.Duration) (*carrier.Relay, error) {
	r, err := carrier.Start(carrier.Config{Target: b.reg.Host(), CutProb: prob, CutMin: b.cfg.CutMin,
		CutMax: b.cfg.CutMax, Mode: mode, Bandwidth: b.cfg.Bandwidth, Seed: uint64(time.Now().UnixNano()),
		RTT: rtt, SetupRTTs: b.cfg.SetupRTTs, SlowStart: true})
	if err != nil {
		return nil, fmt.Errorf("starting the carrier: %w", err)
	}
	return r, nil
}

func ratio(a, b int64) float64 { return float64(a) / float64(b) }
