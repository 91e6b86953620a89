package mirror

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/proxy"
)

// SeedRequest is what seed asks of a running server's admin endpoint.
type SeedRequest struct {
	Refs      []string `json:"refs"`
	Platforms []string `json:"platforms,omitempty"`
	Referrers bool     `json:"referrers,omitempty"`
}

// Seed seeds each image of req into the store, reporting progress to out:
// a line redrawn in place on a terminal, else a line now and then.
func (m *Mirror) Seed(ctx context.Context, req SeedRequest, out io.Writer, terminal bool) error {
	srv := m.Server
	failed := 0
	for _, ref := range req.Refs {
		img, err := imageref.Parse(ref)
		if err != nil {
			fmt.Fprintf(out, "error %s: %v\n", ref, err)
			failed++
			continue
		}
		seeded := &proxy.SeedProgress{}
		start := time.Now()
		report := progress.Start(out, terminal, "seeding "+ref, func() (int64, int64, string) {
			return seeded.BytesDone.Load(), seeded.BytesTotal.Load(),
				fmt.Sprintf("blobs %d/%d", seeded.BlobsDone.Load(), seeded.BlobsTotal.Load())
		})
		d, err := srv.Seed(ctx, img.Upstream, img.Repo, img.Ref, proxy.SeedOptions{
			Platforms: req.Platforms, Referrers: req.Referrers, Progress: seeded})
		report.End()
		if err != nil {
			fmt.Fprintf(out, "error %s: %v\n", ref, err)
			failed++
			continue
		}
		fmt.Fprintf(out, "seeded %s %s: %d blobs, %s in %s\n", ref, d, seeded.BlobsDone.Load(),
			progress.Bytes(seeded.BytesTotal.Load()), time.Since(start).Round(time.Millisecond))
	}
	if failed > 0 {
		return fmt.Errorf("seed: %d of %d images failed", failed, len(req.Refs))
	}
	return nil
}
