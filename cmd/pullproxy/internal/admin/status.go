package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/proxy/imagesync"
	"github.com/pullproxy/pullproxy/upstream"
)

// PrintStatus prints the live state of the upstreams of the server whose
// admin endpoint is t, and of its shared bucket: as text, or as the JSON
// GET /debug/upstreams answers.
func PrintStatus(ctx context.Context, t Target, stdout io.Writer, asJSON bool) error {
	resp, err := Call(ctx, t, http.MethodGet, "/debug/upstreams", "", nil)
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	if asJSON {
		_, err := stdout.Write(body)
		return err
	}
	var st []upstream.Status
	if err := json.Unmarshal(body, &st); err != nil {
		return errors.New("status: the admin endpoint's answer is not the upstreams' state")
	}
	for _, u := range st {
		fmt.Fprintf(stdout, "%s\n", u.Name)
		var received int64
		for _, e := range u.Endpoints {
			received += e.ReceivedBytes
		}
		for _, e := range u.Endpoints {
			state := "up"
			if !e.Up {
				state = fmt.Sprintf("left aside until %s (%d failures in a row)", e.DownUntil.Format(time.TimeOnly), e.Failures)
			}
			if e.FailoverOnly {
				state += ", failover only"
			}
			share := ""
			if len(u.Endpoints) > 1 && received > 0 {
				share = fmt.Sprintf(" (%d%% of the upstream's)", e.ReceivedBytes*100/received)
			}
			fmt.Fprintf(stdout, "  %s %s: %s\n", e.URL, e.Region, state)
			fmt.Fprintf(stdout, "    chunks lately: %d, %d%% cut; connection budget %s; connections %d of %d; goodput %s/s; received %s%s\n",
				e.RecentChunks, e.CutPercent, progress.Bytes(e.BudgetBytes), e.ConnectionsInFlight, e.ConnectionsLimit,
				progress.Bytes(int64(e.GoodputBytesPerSecond)), progress.Bytes(e.ReceivedBytes), share)
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
	printBucket(ctx, t, stdout)
	printSync(ctx, t, stdout, time.Now())
	return nil
}

// printSync prints each sync rule's state, when the server has rules.
func printSync(ctx context.Context, server Target, stdout io.Writer, now time.Time) {
	resp, err := Call(ctx, server, http.MethodGet, "/debug/sync", "", nil)
	if err != nil {
		return // an older server: no such section
	}
	defer resp.Body.Close()
	var rules []imagesync.RuleStatus
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&rules); err != nil || len(rules) == 0 {
		return
	}
	fmt.Fprintln(stdout, "sync")
	for _, r := range rules {
		fmt.Fprintf(stdout, "  %s every %s: %d tags cached in %d repositories; fetched %s since start\n",
			r.Rule, r.Interval, r.TagsCached, r.Repositories, progress.Bytes(r.FetchedBytes))
		last := "no round yet"
		if !r.LastRound.IsZero() {
			last = fmt.Sprintf("last round ended %s (%s ago), took %s", r.LastRound.Format(time.TimeOnly),
				now.Sub(r.LastRound).Round(time.Second), r.LastDuration.Round(time.Millisecond))
			if r.LastBy != "" {
				last += ", on " + r.LastBy
			}
		}
		next := "next round at " + r.NextRound.Format(time.TimeOnly)
		if r.Running {
			next = "a round is running"
		}
		fmt.Fprintf(stdout, "    %s; %s\n", last, next)
		if r.LastError != "" {
			fmt.Fprintf(stdout, "    failed %d time(s) in a row: %s\n", r.Failures, r.LastError)
		}
	}
}

// printBucket prints the shared bucket's section of status, when
// the server shares one (a server without /debug/bucket shares none).
func printBucket(ctx context.Context, server Target, stdout io.Writer) {
	resp, err := Call(ctx, server, http.MethodGet, "/debug/bucket", "", nil)
	if err != nil {
		return // an older server: no such section
	}
	defer resp.Body.Close()
	var st BucketStatus
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

// printCorrupt writes, for pullproxy status, the blobs an upstream's
// endpoints served corrupt lately, and the fix.
func printCorrupt(w io.Writer, entries []upstream.CorruptStatus, now time.Time) {
	for _, c := range entries {
		next := "at the next pull"
		if c.RetryAt.After(now) {
			next = fmt.Sprintf("at %s (in %s)", c.RetryAt.Format(time.TimeOnly), c.RetryAt.Sub(now).Round(time.Second))
		}
		fmt.Fprintf(w, "  corrupt blob %s from %s: %d time(s) in a row since %s; asked again %s\n",
			c.Digest, c.Endpoint, c.Failures, c.Since.Format(time.TimeOnly), next)
		if c.LastError != "" {
			fmt.Fprintf(w, "    found: %s\n", c.LastError)
		}
		fmt.Fprintf(w, "    fix: %s\n", upstream.CorruptFix(c.Digest))
	}
}
