// Package doctor diagnoses pulls: it walks the pull of an image against
// its upstream step by step (DNS, TCP, TLS, the challenge, credentials,
// the manifest, the platform, the blobs, the path's live cuts, the disk,
// the shared bucket) and says of each failure what kind it is, where to
// fix it and how; and it probes a path with plain sessions, to tell
// whether and where it cuts them.
package doctor

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/admin"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/upstream"
)

// Step is one step of a pull doctor walked, and its verdict.
type Step struct {
	Step    string `json:"step"`
	Verdict string `json:"verdict"` // ok, warn, fail, skip
	Detail  string `json:"detail,omitempty"`
	Class   string `json:"class,omitempty"` // what kind of failure
	Fix     string `json:"fix,omitempty"`
	// Where the fix is: "here" (configuration, credentials, network,
	// disk), or "upstream" (the registry, its replicas, the path to it).
	Where string `json:"where,omitempty"`
}

// Exit codes of doctor: what to fix, and where.
const (
	FixHere     = 1
	FixUpstream = 2
	CannotRun   = 3
)

// Options says how to diagnose.
type Options struct {
	Platform  string        // os/arch[/variant] a node pulls
	Server    *admin.Target // a running server's admin endpoint, for the path's live state; nil: none
	ServerErr error         // why the admin endpoint named cannot be called
}

// manifestTypes are what doctor asks for, as containerd does.
var manifestTypes = []string{ocispec.MediaTypeImageIndex, ocispec.MediaTypeImageManifest,
	"application/vnd.docker.distribution.manifest.list.v2+json", "application/vnd.docker.distribution.manifest.v2+json"}

// Diagnose walks the pull of ref against its configured upstream, step by
// step, then checks the shared bucket when replicas share one; it returns
// every step with its verdict.
func Diagnose(ctx context.Context, cfg config.File, ref string, opts Options) []Step {
	d := &doctorRun{cfg: cfg, platform: opts.Platform, server: opts.Server, serverErr: opts.ServerErr}
	d.run(ctx, ref)
	d.bucket(ctx)
	return d.steps
}

// WriteText writes steps as doctor prints them: a verdict and a step a
// line, and under each failure or warning its class, where to fix it, and
// the fix.
func WriteText(w io.Writer, steps []Step) {
	for _, s := range steps {
		line := fmt.Sprintf("%-4s %s", s.Verdict, s.Step)
		if s.Detail != "" {
			line += ": " + s.Detail
		}
		fmt.Fprintln(w, line)
		if s.Class != "" {
			fmt.Fprintf(w, "       %s (%s): %s\n", s.Class, whereWords(s.Where), s.Fix)
		}
	}
}

// ExitCode is doctor's exit status for steps: 0 when nothing failed,
// FixHere when something here failed, else FixUpstream.
func ExitCode(steps []Step) int {
	code := 0
	for _, s := range steps {
		switch {
		case s.Verdict == "fail" && s.Where == "here":
			code = FixHere
		case s.Verdict == "fail" && code == 0:
			code = FixUpstream
		}
	}
	return code
}

func whereWords(where string) string {
	if where == "upstream" {
		return "an upstream problem"
	}
	return "fix it here"
}

// doctorRun is one doctor's walk.
type doctorRun struct {
	cfg       config.File
	platform  string
	server    *admin.Target // a running server's admin endpoint; nil: none
	serverErr error         // why the admin endpoint named cannot be called
	steps     []Step
	metrics   *prometheus.Registry
	// imageBlobs are the config and layers of the image walked.
	imageBlobs map[digest.Digest]bool
	// space reads a file system's free and total bytes; nil: fsutil.Space.
	space func(path string) (free, total int64, err error)
}

func (d *doctorRun) ok(step, detail string) {
	d.steps = append(d.steps, Step{Step: step, Verdict: "ok", Detail: detail})
}

func (d *doctorRun) fail(step, detail, class, fix, where string) {
	d.steps = append(d.steps, Step{Step: step, Verdict: "fail", Detail: detail, Class: class, Fix: fix, Where: where})
}

func (d *doctorRun) warn(step, detail, class, fix, where string) {
	d.steps = append(d.steps, Step{Step: step, Verdict: "warn", Detail: detail, Class: class, Fix: fix, Where: where})
}

func (d *doctorRun) skip(step, detail string) {
	d.steps = append(d.steps, Step{Step: step, Verdict: "skip", Detail: detail})
}

func (d *doctorRun) run(ctx context.Context, ref string) {
	img, err := imageref.Parse(ref)
	if err != nil {
		d.fail("reference", err.Error(), "wrong reference", "write it as registry/repository:tag, e.g. docker.io/library/alpine:3.20", "here")
		return
	}
	up := d.cfg.Upstream(img.Upstream)
	if up == nil {
		d.fail("upstream "+img.Upstream, "not configured", "configuration",
			"add "+img.Upstream+" to upstreams (or --upstream "+img.Upstream+"=https://...)", "here")
		return
	}
	if d.cfg.Offline || up.Offline {
		d.skip("upstream "+img.Upstream, "offline: pullproxy serves it from the store only")
		return
	}
	d.ok("upstream "+img.Upstream, fmt.Sprintf("%d endpoint(s)", len(up.Endpoints)))
	log := slog.New(slog.DiscardHandler)
	d.metrics = prometheus.NewRegistry()
	m, err := upstream.NewMetrics(d.metrics)
	if err != nil {
		d.fail("set-up", err.Error(), "internal", "report it", "here")
		return
	}
	tlsCfg, err := up.TLSConfig(log)
	if err != nil {
		d.fail("tls configuration", err.Error(), "configuration", "fix ca_file", "here")
		return
	}
	reachable := 0
	for _, e := range up.Endpoints {
		if d.network(ctx, e.URL, tlsCfg) {
			reachable++
		}
	}
	if reachable == 0 {
		return
	}
	fetch := d.cfg.Fetch.Options()
	fetch.MaxAttempts = 2 // a diagnosis, not a pull: say quickly
	reg, err := mirror.NewRegistry(*up, nil, log, m, upstream.NewTransport(), fetch)
	if err != nil {
		d.fail("credentials", err.Error(), "configuration", "fix the upstream's auth", "here")
		return
	}
	desc, body, err := reg.GetManifest(ctx, img.Repo, img.Ref, manifestTypes)
	if err != nil {
		d.upstreamError(ctx, "manifest "+img.Ref, err, *up, reg, img)
		return
	}
	d.ok("credentials and token", authSummary(*up))
	d.ok("manifest "+img.Ref, fmt.Sprintf("%s %s, %d bytes", desc.MediaType, desc.Digest, desc.Size))
	d.replicas(ctx, *up, m, fetch, img)
	manifest := body
	if isIndex(body) {
		child, ok := d.pickPlatform(body)
		if !ok {
			return
		}
		_, manifest, err = reg.GetManifest(ctx, img.Repo, child.String(), manifestTypes)
		if err != nil {
			d.upstreamError(ctx, "manifest for "+d.platform, err, *up, reg, img)
			return
		}
		d.ok("manifest for "+d.platform, child.String())
	}
	d.blobs(ctx, reg, img, manifest)
	d.path(ctx, img.Upstream)
	d.disk()
}

// network checks one endpoint: DNS, TCP (or the proxy), TLS, /v2/.
func (d *doctorRun) network(ctx context.Context, endpoint string, tlsCfg *tls.Config) bool {
	u, err := url.Parse(endpoint)
	if err != nil {
		d.fail("endpoint "+endpoint, err.Error(), "configuration", "fix the endpoint's URL", "here")
		return false
	}
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	req, _ := http.NewRequest(http.MethodGet, endpoint, nil)
	if proxyURL, err := http.ProxyFromEnvironment(req); err == nil && proxyURL != nil {
		conn, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", proxyURL.Host)
		if err != nil {
			d.fail("proxy "+proxyURL.Host, err.Error(), "proxy", "HTTPS_PROXY/HTTP_PROXY name a proxy this host cannot reach: fix it, or NO_PROXY the registry", "here")
			return false
		}
		conn.Close()
		d.ok("proxy "+proxyURL.Redacted(), "reachable; it resolves and connects to "+host)
	} else {
		addrs, err := net.DefaultResolver.LookupHost(ctx, host)
		if err != nil {
			d.fail("dns "+host, err.Error(), "DNS", "the name does not resolve from here: check /etc/resolv.conf, the DNS server, or the endpoint's spelling", "here")
			return false
		}
		d.ok("dns "+host, strings.Join(addrs, ", "))
		start := time.Now()
		conn, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", net.JoinHostPort(host, port))
		if err != nil {
			d.fail("tcp "+net.JoinHostPort(host, port), err.Error(), "network",
				"nothing answers there from this host: a firewall, a security group, a route, or the registry is down", "here")
			return false
		}
		d.ok("tcp "+net.JoinHostPort(host, port), "connected in "+time.Since(start).Round(time.Millisecond).String())
		if u.Scheme == "https" {
			cfg := &tls.Config{ServerName: host}
			if tlsCfg != nil {
				cfg = tlsCfg.Clone()
				cfg.ServerName = host
			}
			tc := tls.Client(conn, cfg)
			tc.SetDeadline(time.Now().Add(10 * time.Second))
			if err := tc.HandshakeContext(ctx); err != nil {
				conn.Close()
				d.fail("tls "+host, err.Error(), "TLS", tlsFix(err), "here")
				return false
			}
			st := tc.ConnectionState()
			d.ok("tls "+host, fmt.Sprintf("%s, certificate for %s, until %s", tls.VersionName(st.Version),
				strings.Join(st.PeerCertificates[0].DNSNames, " "), st.PeerCertificates[0].NotAfter.Format(time.DateOnly)))
		}
		conn.Close()
	}
	client := &http.Client{Timeout: 15 * time.Second, Transport: &http.Transport{Proxy: http.ProxyFromEnvironment, TLSClientConfig: tlsCfg}}
	resp, err := client.Get(strings.TrimSuffix(endpoint, "/") + "/v2/")
	if err != nil {
		d.fail("/v2/ on "+host, err.Error(), "network", "the registry does not answer HTTP there: is it a registry, and the scheme (http/https) right?", "here")
		return false
	}
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		d.ok("/v2/ on "+host, "200: no authentication asked")
	case http.StatusUnauthorized:
		d.ok("/v2/ on "+host, "401 with challenge "+challengeSummary(resp.Header.Get("WWW-Authenticate")))
	default:
		d.fail("/v2/ on "+host, resp.Status, "not a registry", "the endpoint answers, but not the registry API: check its URL (a path prefix?)", "here")
		return false
	}
	return true
}

func challengeSummary(h string) string {
	if h == "" {
		return "(none)"
	}
	scheme, params, _ := strings.Cut(h, " ")
	for p := range strings.SplitSeq(params, ",") {
		if k, v, ok := strings.Cut(strings.TrimSpace(p), "="); ok && k == "realm" {
			return scheme + " realm " + strings.Trim(v, `"`)
		}
	}
	return scheme
}

func tlsFix(err error) string {
	var unknown x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	switch {
	case errors.As(err, &unknown):
		return "the registry's certificate is signed by a CA this host does not trust: give it in the upstream's ca_file"
	case errors.As(err, &hostname):
		return "the certificate is not for this name: use the name it was issued for in the endpoint's URL"
	case errors.As(err, &invalid):
		return "the certificate is expired or not yet valid (check this host's clock too)"
	}
	return "the TLS handshake failed: an HTTPS endpoint that speaks plain HTTP, or a middlebox"
}

func authSummary(up config.Upstream) string {
	if up.Auth.Type == "" || up.Auth.Type == "anonymous" {
		return "anonymous pulls are allowed"
	}
	return up.Auth.Type + " credentials accepted"
}

// upstreamError classifies a failed manifest request.
func (d *doctorRun) upstreamError(ctx context.Context, step string, err error, up config.Upstream, reg *upstream.Registry, img imageref.Ref) {
	var ue *upstream.Error
	errors.As(err, &ue)
	withCreds := up.Auth.Type != "" && up.Auth.Type != "anonymous"
	switch {
	case errors.Is(err, upstream.ErrUnauthorized) && withCreds:
		d.fail(step, err.Error(), "credentials refused", "the configured "+up.Auth.Type+" credentials were refused: check them (and, for a token, its expiry)", "here")
	case errors.Is(err, upstream.ErrUnauthorized):
		d.fail(step, err.Error(), "no credentials", "the registry wants credentials and none are configured (containerd says \"no basic auth credentials\"): add auth: to the upstream", "here")
	case errors.Is(err, upstream.ErrDenied) && up.Auth.Type == "ecr":
		d.fail(step, err.Error(), "ECR token refused", "ECR answers 403 to an expired token, one of another region, or one whose role may not pull this repository: check the region of the endpoint and the IAM policy (ecr:BatchGetImage, ecr:GetDownloadUrlForLayer)", "here")
	case errors.Is(err, upstream.ErrDenied):
		d.fail(step, err.Error(), "denied", "the credentials may not pull this repository: grant them pull, or use others", "here")
	case errors.Is(err, upstream.ErrTooManyRequests):
		detail := err.Error()
		if left, ok := gaugeValue(d.metrics, "pullproxy_upstream_ratelimit_remaining", img.Upstream); ok {
			detail += fmt.Sprintf(" (ratelimit-remaining: %.0f)", left)
		}
		if ue != nil && ue.RetryAfter > 0 {
			detail += ", retry after " + ue.RetryAfter.String()
		}
		d.fail(step, detail, "rate limit", "the registry's pull allowance is spent: authenticate (Docker Hub raises it for accounts), wait, or pull through one mirror for the site", "upstream")
	case errors.Is(err, upstream.ErrNotFound):
		detail := err.Error()
		if page, lerr := reg.ListTags(ctx, img.Repo, 0, ""); lerr == nil && len(page.Tags) > 0 {
			tags := page.Tags
			if len(tags) > 15 {
				tags = append(slices.Clone(tags[:15]), "…")
			}
			detail += "; the tags that exist: " + strings.Join(tags, " ")
		}
		d.fail(step, detail, "manifest unknown", "the repository or tag does not exist there: check the reference's spelling, and which tags exist", "here")
	case errors.Is(err, upstream.ErrUnavailable):
		d.fail(step, err.Error(), "upstream unavailable", "the registry fails (5xx) or the path to it drops the requests", "upstream")
	default:
		d.fail(step, err.Error(), "invalid answer", "the registry's answer is not what the API says: a proxy in the way, or a registry bug", "upstream")
	}
}

// replicas checks that every endpoint of a multi-endpoint upstream has
// the tag: a replica that lacks it fails a failover.
func (d *doctorRun) replicas(ctx context.Context, up config.Upstream, m *upstream.Metrics, fetch upstream.FetchConfig, img imageref.Ref) {
	if len(up.Endpoints) < 2 {
		return
	}
	log := slog.New(slog.DiscardHandler)
	for _, e := range up.Endpoints {
		r, err := mirror.NewRegistry(up, []string{e.URL}, log, m, upstream.NewTransport(), fetch)
		if err != nil {
			continue
		}
		if _, err := r.HeadManifest(ctx, img.Repo, img.Ref, manifestTypes); errors.Is(err, upstream.ErrNotFound) {
			d.fail("replica "+e.URL, img.Repo+":"+img.Ref+" is missing there", "tag missing on a replica",
				"replication does not backfill: push the tag again, or copy it to this replica (crane copy), or a failover to it fails", "upstream")
		} else if err != nil {
			d.warn("replica "+e.URL, err.Error(), "replica unreachable", "a failover to it would fail", "upstream")
		} else {
			d.ok("replica "+e.URL, "has "+img.Ref)
		}
	}
}

func isIndex(body []byte) bool {
	var m struct {
		Manifests json.RawMessage `json:"manifests"`
	}
	return json.Unmarshal(body, &m) == nil && len(m.Manifests) > 0
}

// pickPlatform finds d.platform in an index, or says which exist.
func (d *doctorRun) pickPlatform(body []byte) (digest.Digest, bool) {
	var idx ocispec.Index
	if err := json.Unmarshal(body, &idx); err != nil {
		d.fail("platform "+d.platform, err.Error(), "invalid answer", "the index is not JSON", "upstream")
		return "", false
	}
	var have []string
	for _, m := range idx.Manifests {
		if m.Platform == nil {
			continue
		}
		p := m.Platform.OS + "/" + m.Platform.Architecture
		if m.Platform.Variant != "" {
			p += "/" + m.Platform.Variant
		}
		have = append(have, p)
		if p == d.platform || strings.HasPrefix(p, d.platform+"/") {
			d.ok("platform "+d.platform, m.Digest.String())
			return m.Digest, true
		}
	}
	d.fail("platform "+d.platform, "no matching manifest for "+d.platform+"; the image has: "+strings.Join(have, ", "),
		"missing platform", "the image is not built for this platform: pull another tag, or build and push it for "+d.platform, "upstream")
	return "", false
}

// blobs checks the config and every layer by HEAD: there, and the size
// the manifest declares.
func (d *doctorRun) blobs(ctx context.Context, reg *upstream.Registry, img imageref.Ref, manifest []byte) {
	var m ocispec.Manifest
	if err := json.Unmarshal(manifest, &m); err != nil {
		d.fail("manifest", err.Error(), "invalid answer", "the manifest is not JSON", "upstream")
		return
	}
	blobs := append([]ocispec.Descriptor{m.Config}, m.Layers...)
	bad := 0
	var total int64
	d.imageBlobs = map[digest.Digest]bool{}
	for i, b := range blobs {
		d.imageBlobs[b.Digest] = true
		name := "config"
		if i > 0 {
			name = fmt.Sprintf("layer %d", i)
		}
		size, err := reg.HeadBlob(ctx, img.Repo, b.Digest)
		switch {
		case errors.Is(err, upstream.ErrNotFound):
			d.fail(name+" "+b.Digest.String(), "missing upstream", "blob unknown", "the manifest names a blob the registry lacks: re-push the image", "upstream")
			bad++
		case err != nil:
			d.fail(name+" "+b.Digest.String(), err.Error(), "blob unreachable", "the registry refuses or fails the blob", "upstream")
			bad++
		case size >= 0 && size != b.Size:
			d.fail(name+" "+b.Digest.String(), upstream.SizeMismatchMessage(b.Digest, size, b.Size), "size mismatch",
				"delete the blob and push the image again", "upstream")
			bad++
		default:
			total += b.Size
		}
	}
	if bad == 0 {
		d.ok("config and layers", fmt.Sprintf("%d blobs, %s, every one there at the size the manifest declares", len(blobs), progress.Bytes(total)))
	}
}
