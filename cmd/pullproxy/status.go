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

	"github.com/pullproxy/pullproxy/upstream"
)

// status runs `pullproxy status`: a running server's live state of its
// upstreams, from its admin endpoint.
func status(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var af archiveFlags
	af.register(fs)
	var admin adminFlags
	admin.register(fs, "read the state")
	asJSON := fs.Bool("json", false, "print JSON, as /debug/upstreams answers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := af.config()
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
				e.RecentChunks, e.CutPercent, humanBytes(e.BudgetBytes), e.ConnectionsInFlight, e.ConnectionsLimit,
				humanBytes(int64(e.GoodputBytesPerSecond)), humanBytes(e.ReceivedBytes))
			if len(e.CutPoints) > 0 {
				fmt.Fprintf(stdout, "    cut points (10 min): %d, from %s to %s\n", len(e.CutPoints),
					humanBytes(e.CutPoints[0]), humanBytes(e.CutPoints[len(e.CutPoints)-1]))
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
	return nil
}
