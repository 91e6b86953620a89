package doctor

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
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

// ProbeSummary is what probe reports of one target.
type ProbeSummary struct {
	Target   string                   `json:"target"`
	Sessions int                      `json:"sessions"`
	Cut      int                      `json:"cut"`
	CutRate  float64                  `json:"cut_rate"`
	Outcomes map[string]int           `json:"outcomes"` // complete, reset, eof, stall, error
	CutMin   int64                    `json:"cut_min_bytes,omitempty"`
	CutMed   int64                    `json:"cut_median_bytes,omitempty"`
	CutMax   int64                    `json:"cut_max_bytes,omitempty"`
	Hist     []HistogramBin           `json:"cut_histogram,omitempty"`
	Rate     float64                  `json:"bytes_per_second"` // all bytes over all session time
	Budget   int64                    `json:"connection_budget_bytes"`
	Results  []upstream.SessionResult `json:"results"`
}

// HistogramBin counts the cuts between From and To bytes.
type HistogramBin struct {
	From, To int64
	Count    int
}

// Summarize turns a target's sessions into its report.
func Summarize(target string, results []upstream.SessionResult) (ProbeSummary, error) {
	s := ProbeSummary{Target: target, Sessions: len(results), Outcomes: map[string]int{}, Results: results}
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
func histogram(sorted []int64, bins int) []HistogramBin {
	lo, hi := sorted[0], sorted[len(sorted)-1]
	width := max((hi-lo+int64(bins)-1)/int64(bins), 1)
	out := make([]HistogramBin, 0, bins)
	for i := range bins {
		from := lo + int64(i)*width
		if from > hi {
			break
		}
		out = append(out, HistogramBin{From: from, To: min(from+width-1, hi)})
	}
	for _, p := range sorted {
		out[min(int((p-lo)/width), len(out)-1)].Count++
	}
	return out
}

// WriteProbe writes what probe found of a target, as text.
func WriteProbe(w io.Writer, s ProbeSummary) {
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

// ProbeImage resolves an image reference to its largest layer (for
// platform) on its configured upstream, and returns a session reading it
// from the upstream's first endpoint with the upstream's credentials.
func ProbeImage(ctx context.Context, loadConfig func() (config.File, error), ref, platform string, client *http.Client, opts upstream.ProbeOptions) (func(context.Context) upstream.SessionResult, error) {
	img, err := imageref.Parse(ref)
	if err != nil {
		return nil, fmt.Errorf("probe: %q is neither an http(s) URL nor an image reference: %w", ref, err)
	}
	cfg, err := loadConfig()
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
	_, body, err := reg.GetManifest(ctx, img.Repo, img.Ref, manifestTypes)
	if err != nil {
		return nil, fmt.Errorf("probe: %s: %w (pullproxy doctor says why)", ref, err)
	}
	if isIndex(body) {
		var idx ocispec.Index
		json.Unmarshal(body, &idx)
		found := false
		for _, c := range idx.Manifests {
			if c.Platform != nil && c.Platform.OS+"/"+c.Platform.Architecture == platform {
				if _, body, err = reg.GetManifest(ctx, img.Repo, c.Digest.String(), manifestTypes); err != nil {
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
