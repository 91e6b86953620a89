package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/upstream"
)

// bucketStatus is what GET /debug/bucket answers: whether replicas share
// a bucket, and its health as this replica sees it.
type bucketStatus struct {
	Shared bool `json:"shared"`
	bucket.Health
}

// serveBucketHealth answers GET /debug/bucket for m.
func serveBucketHealth(m *mirror.Mirror) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		st := bucketStatus{}
		if m.Bucket != nil {
			st = bucketStatus{Shared: true, Health: m.Bucket.Health()}
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(st)
	}
}

// printBucketStatus prints the shared bucket's section of status, when
// the server shares one (a server without /debug/bucket shares none).
func printBucketStatus(ctx context.Context, server adminTarget, stdout io.Writer) {
	resp, err := adminCall(ctx, server, http.MethodGet, "/debug/bucket", "", nil)
	if err != nil {
		return // an older server: no such section
	}
	defer resp.Body.Close()
	var st bucketStatus
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&st); err != nil || !st.Shared {
		return
	}
	state := "answering"
	if st.Degraded {
		state = fmt.Sprintf("degraded since %s (serving from the local store and the upstream); next probe at %s",
			st.Since.Format(time.TimeOnly), st.NextProbe.Format(time.TimeOnly))
	}
	fmt.Fprintf(stdout, "shared bucket: %s\n", state)
	fmt.Fprintf(stdout, "  degraded %d times; background writes queued %d, dropped %d\n", st.Transitions, st.QueuedWrites, st.DroppedWrites)
	if st.LastError != "" {
		fmt.Fprintf(stdout, "  last error at %s: %s\n", st.LastErrorAt.Format(time.TimeOnly), st.LastError)
	}
}

// status runs `pullproxy status`: a running server's live state of its
// upstreams, from its admin endpoint.
func status(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var af config.CommandFlags
	af.Register(fs)
	var admin adminFlags
	admin.register(fs, "read the state")
	asJSON := fs.Bool("json", false, "print JSON, as /debug/upstreams answers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := af.Load()
	if err != nil {
		return err
	}
	target, err := admin.target(cfg)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	resp, err := adminCall(ctx, target, http.MethodGet, "/debug/upstreams", "", nil)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	if *asJSON {
		_, err := stdout.Write(body)
		return err
	}
	var st []upstream.Status
	if err := json.Unmarshal(body, &st); err != nil {
		return errors.New("status: the admin endpoint's answer is not the upstreams' state")
	}
	for _, u := range st {
		fmt.Fprintf(stdout, "%s\n", u.Name)
		for _, e := range u.Endpoints {
			state := "up"
			if !e.Up {
				state = fmt.Sprintf("left aside until %s (%d failures in a row)", e.DownUntil.Format(time.TimeOnly), e.Failures)
			}
			fmt.Fprintf(stdout, "  %s %s: %s\n", e.URL, e.Region, state)
			fmt.Fprintf(stdout, "    chunks lately: %d, %d%% cut; connection budget %s; connections %d of %d; goodput %s/s; received %s\n",
				e.RecentChunks, e.CutPercent, progress.Bytes(e.BudgetBytes), e.ConnectionsInFlight, e.ConnectionsLimit,
				progress.Bytes(int64(e.GoodputBytesPerSecond)), progress.Bytes(e.ReceivedBytes))
			if len(e.CutPoints) > 0 {
				fmt.Fprintf(stdout, "    cut points (10 min): %d, from %s to %s\n", len(e.CutPoints),
					progress.Bytes(e.CutPoints[0]), progress.Bytes(e.CutPoints[len(e.CutPoints)-1]))
			}
			if e.LastError != "" {
				fmt.Fprintf(stdout, "    last error at %s: %s\n", e.LastErrAt.Format(time.TimeOnly), e.LastError)
			}
		}
		for _, tok := range u.Tokens {
			fmt.Fprintf(stdout, "  ECR token for %s expires %s\n", tok.Region, tok.Expires.Format(time.RFC3339))
		}
		printCorrupt(stdout, u.Corrupt, time.Now())
	}
	printBucketStatus(ctx, target, stdout)
	return nil
}
