package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
)

// Probing measures a network path the way the incident's harness did:
// plain sessions, each on a connection of its own, each reading a large
// blob, recording how many bytes each carried before it died (or that it
// finished) and how it died.

// SessionResult is what one probe session saw.
type SessionResult struct {
	Target  string        `json:"target"`
	Bytes   int64         `json:"bytes"`   // body bytes received
	Outcome string        `json:"outcome"` // complete, or how it died: reset, eof, stall, error
	Error   string        `json:"error,omitempty"`
	Took    time.Duration `json:"took_ns"`
}

// Cut reports whether the path killed the session after it carried bytes:
// evidence of a byte-count cut. A session that failed before its first
// byte says nothing of where the path cuts.
func (s SessionResult) Cut() bool {
	return s.Outcome != "complete" && s.Outcome != "error" && s.Bytes > 0
}

// ProbeOptions tunes ProbeSession.
type ProbeOptions struct {
	// Bytes bounds what a session reads (a Range request); 0: the whole
	// target. Larger than the cut points being looked for.
	Bytes int64
	// StallTimeout is how long a session may receive nothing before it is
	// counted as stalled. Default 10 s.
	StallTimeout time.Duration
	// Header is sent with each request (Authorization, for one).
	Header http.Header
}

// ProbeSession reads target once on a new connection of client's (which
// must not reuse connections) and reports what happened.
func ProbeSession(ctx context.Context, client *http.Client, target string, opts ProbeOptions) SessionResult {
	res := SessionResult{Target: target}
	w := startWatch(ctx, opts)
	defer w.stop()
	ctx = w.ctx

	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		res.Outcome, res.Error = "error", err.Error()
		res.Took = time.Since(w.start)
		return res
	}
	for k, v := range opts.Header {
		req.Header[k] = v
	}
	if opts.Bytes > 0 {
		req.Header.Set("Range", fmt.Sprintf("bytes=0-%d", opts.Bytes-1))
	}
	resp, err := client.Do(req)
	return readProbe(res, resp, err, w)
}

// ProbeBlob is ProbeSession for blob d of repo on the upstream's first
// endpoint, with its credentials (a token fetched as for a pull), each
// session on a connection of client's own.
func (r *Registry) ProbeBlob(ctx context.Context, client *http.Client, repo string, d digest.Digest, opts ProbeOptions) SessionResult {
	ep := r.endpoints[0]
	res := SessionResult{Target: ep.url.Redacted() + "/v2/" + repo + "/blobs/" + d.String()}
	w := startWatch(ctx, opts)
	defer w.stop()
	ctx = w.ctx
	q := request{method: http.MethodGet, repo: repo, path: "blobs/" + d.String(), header: http.Header{}, client: client}
	if opts.Bytes > 0 {
		q.header.Set("Range", fmt.Sprintf("bytes=0-%d", opts.Bytes-1))
	}
	resp, err := r.send(ctx, ep, q)
	return readProbe(res, resp, err, w)
}

// watch times a probe session and cancels it once it has received
// nothing for the stall timeout.
type watch struct {
	ctx     context.Context
	cancel  context.CancelFunc
	start   time.Time
	stall   time.Duration
	stalled atomic.Bool
	timer   *time.Timer
}

func startWatch(ctx context.Context, opts ProbeOptions) *watch {
	w := &watch{start: time.Now(), stall: opts.StallTimeout}
	if w.stall <= 0 {
		w.stall = 10 * time.Second
	}
	w.ctx, w.cancel = context.WithCancel(ctx)
	w.timer = time.AfterFunc(w.stall, func() { w.stalled.Store(true); w.cancel() })
	return w
}

func (w *watch) stop() {
	w.timer.Stop()
	w.cancel()
}

// readProbe reads a probe session's answer to its end, or its death.
func readProbe(res SessionResult, resp *http.Response, err error, w *watch) (result SessionResult) {
	defer func() { result.Took = time.Since(w.start) }()
	if err != nil {
		res.Outcome, res.Error = probeOutcome(err, w.stalled.Load()), err.Error()
		return res
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusPartialContent {
		res.Outcome, res.Error = "error", resp.Status
		return res
	}
	buf := make([]byte, 64<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			res.Bytes += int64(n)
			w.timer.Reset(w.stall)
		}
		if errors.Is(err, io.EOF) {
			if resp.ContentLength >= 0 && res.Bytes < resp.ContentLength {
				res.Outcome = "eof"
			} else {
				res.Outcome = "complete"
			}
			return res
		}
		if err != nil {
			res.Outcome, res.Error = probeOutcome(err, w.stalled.Load()), err.Error()
			return res
		}
	}
}

// probeOutcome names how a session died.
func probeOutcome(err error, stalled bool) string {
	if stalled {
		return "stall"
	}
	switch kind := cutKind(err); kind {
	case "reset", "eof", "stall":
		return kind
	}
	return "error"
}

// BudgetForCutPoints is the connection budget the fetcher settles on for
// a path that cut sessions after they carried points bytes (in any
// order), given cfg: a margin below its estimate of the cut-off (the
// third smallest point, as a few outliers are ignored), not below the
// configured floor. Without enough cuts it is the ceiling: the budget
// grows while sessions complete.
func BudgetForCutPoints(points []int64, cfg FetchConfig) (int64, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return 0, err
	}
	if len(points) <= cutOutliers {
		return cfg.MaxConnectionBudget, nil
	}
	sorted := slices.Sorted(slices.Values(points))
	edge := sorted[min(len(sorted), cutOutliers+1)-1]
	return min(max(edge*cutMarginNum/cutMarginDen, cfg.MinConnectionBudget), cfg.MaxConnectionBudget), nil
}
