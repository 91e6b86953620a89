package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/doctor"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/upstream"
)

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
		session, err := doctor.ProbeImage(ctx, af.Load, t, *platform, client, opts)
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
	var summaries []doctor.ProbeSummary
	for j, t := range targets {
		s, err := doctor.Summarize(t, results[j])
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
		doctor.WriteProbe(stdout, s)
	}
	return nil
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
