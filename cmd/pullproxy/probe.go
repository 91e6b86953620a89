package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/upstream"
)

// probeSummary is what probe reports of one target.
type probeSummary struct {
	Target   string                   `json:"target"`
	Sessions int                      `json:"sessions"`
	Cut      int                      `json:"cut"`
	CutRate  float64                  `json:"cut_rate"`
	Outcomes map[string]int           `json:"outcomes"` // complete, reset, eof, stall, error
	CutMin   int64                    `json:"cut_min_bytes,omitempty"`
	CutMed   int64                    `json:"cut_median_bytes,omitempty"`
	CutMax   int64                    `json:"cut_max_bytes,omitempty"`
	Hist     []histogramBin           `json:"cut_histogram,omitempty"`
	Rate     float64                  `json:"bytes_per_second"` // all bytes over all session time
	Budget   int64                    `json:"connection_budget_bytes"`
	Results  []upstream.SessionResult `json:"results"`
}

type histogramBin struct {
	From, To int64
	Count    int
}

// probe runs `pullproxy probe`: plain sessions against a URL serving a
// large blob, to tell whether and where the path cuts sessions.
func probe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("probe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sessions := fs.Int("sessions", 50, "sessions per target")
	bytesFlag := fs.String("bytes", "16MiB", "bytes each session reads at most (a Range request), beyond the cuts looked for; 0: the whole blob")
	compare := fs.String("compare", "", "a second URL, probed in turn with the first, so that the time of day favours neither")
	asJSON := fs.Bool("json", false, "print JSON")
	stall := fs.Duration("stall", 10*time.Second, "a session receiving nothing this long is counted as stalled")
	insecure := fs.Bool("insecure", false, "accept any TLS certificate (a lab only)")
	var headers headerFlags
	fs.Var(&headers, "header", "NAME: VALUE sent with each request (repeatable), e.g. an Authorization")
	var af config.CommandFlags
	af.Register(fs)
	platform := fs.String("platform", "linux/"+hostArch(), "for a REF: the platform whose largest layer is read")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: pullproxy probe URL|REF [--sessions N] [--bytes SIZE] [--compare URL2|REF2] [--json]\n\n"+
			"Measures a path as the incident's harness did: N sessions, each on a connection of its own,\n"+
			"each reading a large blob (a URL serving bytes, or the largest layer of an image REF of a\n"+
			"configured upstream, read with its credentials); reports how many were\n"+
			"cut and after how many bytes, how they died, the throughput, and the connection budget\n"+
			"pullproxy would settle on for the path.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 || *sessions <= 0 {
		fs.Usage()
		return errors.New("probe: want one URL and --sessions above 0")
	}
	targets := []string{fs.Arg(0)}
	if *compare != "" {
		targets = append(targets, *compare)
	}
	// A target is a URL, read as it is, or an image reference, whose
	// largest layer is read from its upstream's first endpoint.
	sessionsOf := make([]func(context.Context) upstream.SessionResult, len(targets))
	n, err := config.ParseByteSize(*bytesFlag)
	if err != nil || n < 0 {
		return fmt.Errorf("probe: --bytes %q: want a size", *bytesFlag)
	}
	opts := upstream.ProbeOptions{Bytes: n, StallTimeout: *stall, Header: http.Header(headers)}
	// A connection per session, never reused: the unit the carrier kills.
	client := &http.Client{Transport: &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
		TLSClientConfig:     &tls.Config{InsecureSkipVerify: *insecure},
		DisableKeepAlives:   true,
		DisableCompression:  true,
		TLSHandshakeTimeout: 10 * time.Second,
	}}
	for j, t := range targets {
		if u, err := url.Parse(t); err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "" {
			sessionsOf[j] = func(ctx context.Context) upstream.SessionResult { return upstream.ProbeSession(ctx, client, t, opts) }
			continue
		}
		session, err := probeImage(ctx, af, t, *platform, client, opts)
		if err != nil {
			return err
		}
		sessionsOf[j] = session
	}
	results := make([][]upstream.SessionResult, len(targets))
	for i := range *sessions {
		for j, t := range targets { // interleaved
			if err := ctx.Err(); err != nil {
				return err
			}
			r := sessionsOf[j](ctx)
			results[j] = append(results[j], r)
			if !*asJSON && progress.IsTerminal(stderr) {
				fmt.Fprintf(stderr, "\r\033[Ksession %d/%d of %s: %s after %s", i+1, *sessions, t, r.Outcome, progress.Bytes(r.Bytes))
			}
		}
	}
	if !*asJSON && progress.IsTerminal(stderr) {
		fmt.Fprint(stderr, "\r\033[K")
	}
	var summaries []probeSummary
	for j, t := range targets {
		s, err := summarize(t, results[j])
		if err != nil {
			return err
		}
		summaries = append(summaries, s)
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(summaries)
	}
	for _, s := range summaries {
		printSummary(stdout, s)
	}
	return nil
}

// summarize turns a target's sessions into its report.
func summarize(target string, results []upstream.SessionResult) (probeSummary, error) {
	s := probeSummary{Target: target, Sessions: len(results), Outcomes: map[string]int{}, Results: results}
	var points []int64
	var bytes int64
	var took time.Duration
	for _, r := range results {
		s.Outcomes[r.Outcome]++
		bytes += r.Bytes
		took += r.Took
		if r.Cut() {
			points = append(points, r.Bytes)
		}
	}
	s.Cut = len(points)
	s.CutRate = float64(s.Cut) / float64(max(s.Sessions, 1))
	s.Rate = float64(bytes) / max(took.Seconds(), 1e-9)
	if len(points) > 0 {
		slices.Sort(points)
		s.CutMin, s.CutMed, s.CutMax = points[0], points[len(points)/2], points[len(points)-1]
		s.Hist = histogram(points, 8)
	}
	budget, err := upstream.BudgetForCutPoints(points, upstream.FetchConfig{})
	if err != nil {
		return s, err
	}
	s.Budget = budget
	return s, nil
}

// histogram counts sorted points in bins evenly spread over their range.
func histogram(sorted []int64, bins int) []histogramBin {
	lo, hi := sorted[0], sorted[len(sorted)-1]
	width := max((hi-lo+int64(bins)-1)/int64(bins), 1)
	out := make([]histogramBin, 0, bins)
	for i := range bins {
		from := lo + int64(i)*width
		if from > hi {
			break
		}
		out = append(out, histogramBin{From: from, To: min(from+width-1, hi)})
	}
	for _, p := range sorted {
		out[min(int((p-lo)/width), len(out)-1)].Count++
	}
	return out
}

func printSummary(w io.Writer, s probeSummary) {
	fmt.Fprintf(w, "%s: %d sessions\n", s.Target, s.Sessions)
	var kinds []string
	for _, k := range slices.Sorted(maps.Keys(s.Outcomes)) {
		kinds = append(kinds, fmt.Sprintf("%s %d", k, s.Outcomes[k]))
	}
	fmt.Fprintf(w, "  cut after carrying bytes: %d of %d (%.1f%%); outcomes: %s\n", s.Cut, s.Sessions, 100*s.CutRate, strings.Join(kinds, ", "))
	if s.Cut > 0 {
		fmt.Fprintf(w, "  cut points: min %s, median %s, max %s (%d, %d, %d bytes)\n",
			progress.Bytes(s.CutMin), progress.Bytes(s.CutMed), progress.Bytes(s.CutMax), s.CutMin, s.CutMed, s.CutMax)
		most := 0
		for _, b := range s.Hist {
			most = max(most, b.Count)
		}
		for _, b := range s.Hist {
			fmt.Fprintf(w, "    %10s – %-10s %-30s %d\n", progress.Bytes(b.From), progress.Bytes(b.To), strings.Repeat("#", b.Count*30/max(most, 1)), b.Count)
		}
	}
	fmt.Fprintf(w, "  throughput: %s/s over the sessions' time\n", progress.Bytes(int64(s.Rate)))
	if s.Cut > 0 {
		fmt.Fprintf(w, "  connection budget pullproxy would settle on: %s (below the cuts, with a margin)\n", progress.Bytes(s.Budget))
	} else {
		fmt.Fprintf(w, "  no session was cut: pullproxy's connection budget grows to its ceiling, %s\n", progress.Bytes(s.Budget))
	}
}

// headerFlags collects repeated --header flags.
type headerFlags http.Header

func (h *headerFlags) String() string { return "" }
func (h *headerFlags) Set(v string) error {
	name, value, ok := strings.Cut(v, ":")
	if !ok || strings.TrimSpace(name) == "" {
		return fmt.Errorf("header %q: want NAME: VALUE", v)
	}
	if *h == nil {
		*h = headerFlags{}
	}
	http.Header(*h).Add(strings.TrimSpace(name), strings.TrimSpace(value))
	return nil
}

// probeImage resolves an image reference to its largest layer (for
// platform) on its configured upstream, and returns a session reading it
// from the upstream's first endpoint with the upstream's credentials.
func probeImage(ctx context.Context, af config.CommandFlags, ref, platform string, client *http.Client, opts upstream.ProbeOptions) (func(context.Context) upstream.SessionResult, error) {
	img, err := imageref.Parse(ref)
	if err != nil {
		return nil, fmt.Errorf("probe: %q is neither an http(s) URL nor an image reference: %w", ref, err)
	}
	cfg, err := af.Load()
	if err != nil {
		return nil, err
	}
	up := cfg.Upstream(img.Upstream)
	if up == nil || len(up.Endpoints) == 0 {
		return nil, fmt.Errorf("probe: %s is not a configured upstream (--config, --upstream)", img.Upstream)
	}
	m, err := upstream.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		return nil, err
	}
	reg, err := mirror.NewRegistry(*up, []string{up.Endpoints[0].URL}, slog.New(slog.DiscardHandler), m, upstream.NewTransport(), cfg.Fetch.Options())
	if err != nil {
		return nil, err
	}
	_, body, err := reg.GetManifest(ctx, img.Repo, img.Ref, doctorManifestTypes)
	if err != nil {
		return nil, fmt.Errorf("probe: %s: %w (pullproxy doctor says why)", ref, err)
	}
	if isIndex(body) {
		var idx ocispec.Index
		json.Unmarshal(body, &idx)
		found := false
		for _, c := range idx.Manifests {
			if c.Platform != nil && c.Platform.OS+"/"+c.Platform.Architecture == platform {
				if _, body, err = reg.GetManifest(ctx, img.Repo, c.Digest.String(), doctorManifestTypes); err != nil {
					return nil, fmt.Errorf("probe: %s for %s: %w", ref, platform, err)
				}
				found = true
				break
			}
		}
		if !found {
			return nil, fmt.Errorf("probe: %s has no image for %s", ref, platform)
		}
	}
	var man ocispec.Manifest
	if err := json.Unmarshal(body, &man); err != nil || len(man.Layers) == 0 {
		return nil, fmt.Errorf("probe: %s: no layer to read", ref)
	}
	largest := slices.MaxFunc(man.Layers, func(a, b ocispec.Descriptor) int { return cmp.Compare(a.Size, b.Size) })
	return func(ctx context.Context) upstream.SessionResult {
		return reg.ProbeBlob(ctx, client, img.Repo, largest.Digest, opts)
	}, nil
}
