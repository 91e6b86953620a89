package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/upstream"
)

// An endpoint that served a blob whose bytes failed verification is not
// asked for it again for a while (1 minute, doubling to 30). Once the
// operator has deleted the blob upstream and pushed it again, forget ends
// that wait, so that the next pull fetches it at once.

// forgetRequest is the body of POST /forget.
type forgetRequest struct {
	Digest string `json:"digest"`
}

// forgetAnswer is POST /forget's answer: the waits it ended.
type forgetAnswer struct {
	Digest  digest.Digest `json:"digest"`
	Cleared []forgotten   `json:"cleared"`
}

type forgotten struct {
	Upstream string `json:"upstream"`
	upstream.CorruptStatus
}

// forgetHandler serves POST /forget: it ends, on every upstream, the wait
// of each endpoint kept from the digest for serving it corrupt, and
// answers what it ended.
func forgetHandler(ups []*upstream.Registry, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); mt != "application/json" {
			http.Error(w, "forget: want Content-Type: application/json", http.StatusUnsupportedMediaType)
			return
		}
		var req forgetRequest
		if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&req); err != nil {
			http.Error(w, "forget: want JSON: {\"digest\": \"sha256:...\"}", http.StatusBadRequest)
			return
		}
		d, err := digest.Parse(req.Digest)
		if err != nil {
			http.Error(w, fmt.Sprintf("forget: %q is not a digest: %v", req.Digest, err), http.StatusBadRequest)
			return
		}
		ans := forgetAnswer{Digest: d, Cleared: []forgotten{}}
		for _, u := range ups {
			for _, c := range u.Forget(d) {
				ans.Cleared = append(ans.Cleared, forgotten{Upstream: u.Name(), CorruptStatus: c})
			}
		}
		log.Info("forgetting a corrupt blob through the admin endpoint", "digest", d, "endpoints", len(ans.Cleared))
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(ans)
	})
}

// forget runs `pullproxy forget DIGEST...`.
func forget(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("forget", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var af config.CommandFlags
	af.Register(fs)
	var admin adminFlags
	admin.register(fs, "forget")
	fs.Usage = func() {
		fmt.Fprint(stderr, "usage: pullproxy forget [--data-dir DIR | --config FILE | --server ADDR] DIGEST...\n\n"+
			"After a blob that failed verification was deleted upstream and pushed again: ask every\n"+
			"endpoint for it again at once, instead of after its wait (1 minute, doubling to 30).\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("forget: want one or more digests (sha256:...)")
	}
	for _, arg := range fs.Args() {
		if _, err := digest.Parse(arg); err != nil {
			return fmt.Errorf("forget: %q is not a digest: %w", arg, err)
		}
	}
	cfg, err := af.Load()
	if err != nil {
		return err
	}
	target, err := admin.target(cfg)
	if err != nil {
		return fmt.Errorf("forget: %w", err)
	}
	for _, arg := range fs.Args() {
		ans, err := forgetCall(ctx, target, arg)
		if err != nil {
			return fmt.Errorf("forget %s: %w", arg, err)
		}
		if len(ans.Cleared) == 0 {
			fmt.Fprintf(stdout, "%s: no endpoint was kept from it: nothing to forget\n", ans.Digest)
		}
		for _, c := range ans.Cleared {
			fmt.Fprintf(stdout, "%s: %s %s is asked for it again (it served it corrupt %d time(s) in a row; next try was %s)\n",
				ans.Digest, c.Upstream, c.Endpoint, c.Failures, c.RetryAt.Local().Format(time.TimeOnly))
		}
	}
	return nil
}

func forgetCall(ctx context.Context, server adminTarget, d string) (forgetAnswer, error) {
	body, err := json.Marshal(forgetRequest{Digest: d})
	if err != nil {
		return forgetAnswer{}, err
	}
	resp, err := adminCall(ctx, server, http.MethodPost, "/forget", "application/json", bytes.NewReader(body))
	if err != nil {
		return forgetAnswer{}, err
	}
	defer resp.Body.Close()
	var ans forgetAnswer
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&ans); err != nil {
		return forgetAnswer{}, fmt.Errorf("the admin endpoint's answer: %w", err)
	}
	return ans, nil
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

// corrupt adds doctor's steps for the blobs an upstream's endpoints served
// corrupt lately: a failure when the image being walked needs the blob.
func (d *doctorRun) corrupt(entries []upstream.CorruptStatus, now time.Time) {
	for _, c := range entries {
		step := "blob " + c.Digest.String() + " from " + c.Endpoint
		detail := fmt.Sprintf("served corrupt %d time(s) in a row (%s); not asked for it again before %s",
			c.Failures, c.LastError, c.RetryAt.Format(time.TimeOnly))
		if !c.RetryAt.After(now) {
			detail = fmt.Sprintf("served corrupt %d time(s) in a row (%s); asked for it again at the next pull", c.Failures, c.LastError)
		}
		if d.imageBlobs[c.Digest] {
			d.fail(step, detail, "served corrupt", upstream.CorruptFix(c.Digest), "upstream")
		} else {
			d.warn(step, detail, "served corrupt", upstream.CorruptFix(c.Digest), "upstream")
		}
	}
}
