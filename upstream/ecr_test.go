package upstream

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pullproxy/pullproxy/internal/ecrtest"
)

func TestECRRegion(t *testing.T) {
	t.Parallel()
	for host, want := range map[string]string{
		"123456789012.dkr.ecr.us-east-2.amazonaws.com":          "us-east-2",
		"123456789012.dkr.ecr.us-east-2.amazonaws.com:443":      "us-east-2",
		"123456789012.dkr.ecr-fips.us-gov-west-1.amazonaws.com": "us-gov-west-1",
		"123456789012.dkr.ecr.cn-north-1.amazonaws.com.cn":      "cn-north-1",
		"123456789012.dkr-ecr.eu-west-1.on.aws":                 "eu-west-1",
		"123456789012.dkr.ecr.us-iso-east-1.c2s.ic.gov":         "us-iso-east-1",
		"public.ecr.aws":                                         "",
		"12345.dkr.ecr.us-east-1.amazonaws.com":                  "",
		"123456789012.dkr.ecr.us-east-1.amazonaws.com.evil.test": "",
		"registry-1.docker.io":                                   "",
	} {
		if got := ECRRegion(host); got != want {
			t.Errorf("ECRRegion(%q): got %q, want %q", host, got, want)
		}
	}
}

// ecrEnv is two regional ECR registries replicating one image, an ECR API
// stand-in, and an upstream with both as endpoints.
type ecrEnv struct {
	api     *ecrtest.API
	regs    map[string]*ecrtest.Registry
	srvs    map[string]*httptest.Server
	creds   *ECRCredentials
	metrics *Metrics
	logs    *bytes.Buffer
	digests []digest.Digest // the image's layers
}

func newECREnv(t *testing.T, lifetime time.Duration) *ecrEnv {
	t.Helper()
	api := ecrtest.NewAPI(lifetime)
	apiSrv := httptest.NewServer(api)
	t.Cleanup(apiSrv.Close)
	e := &ecrEnv{api: api, regs: map[string]*ecrtest.Registry{}, srvs: map[string]*httptest.Server{}, logs: &bytes.Buffer{}}
	img, err := random.Image(200_000, 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, region := range []string{"us-east-2", "us-east-1"} {
		backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
		plain := httptest.NewServer(backend) // to push through, without ECR's auth
		t.Cleanup(plain.Close)
		ref, _ := name.ParseReference(host(plain)+"/team/app:v1", name.Insecure)
		if err := remote.Write(ref, img); err != nil {
			t.Fatal(err)
		}
		g := ecrtest.NewRegistry(region, api, backend)
		e.regs[region], e.srvs[region] = g, httptest.NewServer(g)
		t.Cleanup(e.srvs[region].Close)
	}
	layers, _ := img.Layers()
	for _, l := range layers {
		d, _ := l.Digest()
		e.digests = append(e.digests, digest.Digest(d.String()))
	}
	logger := slog.New(slog.NewTextHandler(&syncWriter{w: e.logs}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	e.metrics = m
	e.creds = NewECRCredentials(WithECRAPIEndpoint(apiSrv.URL), WithECRLogger(logger), WithECRMetrics(m),
		WithAWSConfig(func(_ context.Context, region string) (aws.Config, error) {
			return aws.Config{Region: region, Credentials: credentials.NewStaticCredentialsProvider("AKIDTEST", "secret-aws-key", "")}, nil
		}))
	return e
}

// upstream returns an upstream over the given regions' endpoints, in order.
func (e *ecrEnv) upstream(t *testing.T, regions ...string) *Registry {
	t.Helper()
	var urls []string
	opts := []Option{WithCredentials(e.creds), WithLogger(slog.New(slog.NewTextHandler(&syncWriter{w: e.logs}, &slog.HandlerOptions{Level: slog.LevelDebug}))),
		WithFetchConfig(FetchConfig{MaxAttempts: 2})}
	for _, region := range regions {
		urls = append(urls, e.srvs[region].URL)
		opts = append(opts, WithEndpointRegion(e.srvs[region].URL, region))
	}
	r, err := New("123456789012.dkr.ecr.us-east-2.amazonaws.com", urls, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// pull fetches the image's manifest and every layer through r.
func (e *ecrEnv) pull(t *testing.T, r *Registry) error {
	t.Helper()
	if _, _, err := r.GetManifest(t.Context(), "team/app", "v1", nil); err != nil {
		return err
	}
	for _, d := range e.digests {
		if _, err := r.FetchBlob(t.Context(), "team/app", d, newMemBlobWriter(-1)); err != nil {
			return err
		}
	}
	return nil
}

// noSecrets fails if any token or key issued appears in the logs or in err.
func (e *ecrEnv) noSecrets(t *testing.T, errs ...error) {
	t.Helper()
	text := e.logs.String()
	for _, err := range errs {
		if err != nil {
			text += err.Error()
		}
	}
	for _, secret := range []string{ecrtest.TokenPrefix, "secret-aws-key", base64.StdEncoding.EncodeToString([]byte("AWS:secret"))[:8]} {
		if strings.Contains(text, secret) {
			t.Errorf("a credential (%q…) appears in the logs or errors", secret)
		}
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

// TestECRTokenExpiry: pulls keep working when the registry starts refusing
// the token (expired early, or the clock is off): the token is renewed once,
// the request retried.
func TestECRTokenExpiry(t *testing.T) {
	t.Parallel()
	e := newECREnv(t, time.Hour)
	r := e.upstream(t, "us-east-2")
	if err := e.pull(t, r); err != nil {
		t.Fatalf("first pull: %v", err)
	}
	e.regs["us-east-2"].Expire()
	if err := e.pull(t, r); err != nil {
		t.Fatalf("pull after the token expired: %v", err)
	}
	if got := len(e.api.Tokens("us-east-2")); got != 2 {
		t.Errorf("tokens issued: got %d, want 2 (one renewal)", got)
	}
	if got := testutil.ToFloat64(e.metrics.ecrRenewals.WithLabelValues("us-east-2", "ok")); got != 2 {
		t.Errorf("pullproxy_ecr_token_renewals_total{region=us-east-2,result=ok}: %v, want 2", got)
	}
	e.noSecrets(t)
}

// TestECRTokenRenewedAhead: a token is replaced before it expires, in the
// background, so no request ever meets an expired one.
func TestECRTokenRenewedAhead(t *testing.T) {
	t.Parallel()
	e := newECREnv(t, 2*time.Minute)
	var mu sync.Mutex
	now := time.Now()
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	e.creds.now = clock
	e.api.SetClock(clock)
	r := e.upstream(t, "us-east-2")
	if err := e.pull(t, r); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	now = now.Add(90 * time.Second) // past half of the 2-minute life, before its end
	mu.Unlock()
	if err := e.pull(t, r); err != nil { // still served with the old token, meanwhile renewed
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := e.api.WaitTokens(ctx, "us-east-2", 2); err != nil {
		t.Fatal(err)
	}
	if refusals := e.regs["us-east-2"].Refusals(); refusals != 0 {
		t.Errorf("requests refused: got %d, want 0 (renewed ahead of expiry)", refusals)
	}
}

// TestECRFailoverToReplicaRegion: with the first region's endpoint dead, the
// pull goes through the replica in the second region, with that region's
// token.
func TestECRFailoverToReplicaRegion(t *testing.T) {
	t.Parallel()
	e := newECREnv(t, time.Hour)
	e.srvs["us-east-2"].Close()
	r := e.upstream(t, "us-east-2", "us-east-1")
	if err := e.pull(t, r); err != nil {
		t.Fatalf("pull with us-east-2 down: %v", err)
	}
	if got := len(e.api.Tokens("us-east-1")); got != 1 {
		t.Errorf("us-east-1 tokens: got %d, want 1", got)
	}
	e.noSecrets(t)
}

// TestECRNoCredentials: an ECR registry reached without credentials says
// what is missing, naming the region, as ECR's own message does.
func TestECRNoCredentials(t *testing.T) {
	t.Parallel()
	e := newECREnv(t, time.Hour)
	r, err := New("ecr", []string{e.srvs["us-east-1"].URL}, WithEndpointRegion(e.srvs["us-east-1"].URL, "us-east-1"),
		WithLogger(discardLogger))
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = r.GetManifest(t.Context(), "team/app", "v1", nil)
	checkKind(t, err, ErrUnauthorized)
	if !strings.Contains(fmt.Sprint(err), "no basic auth credentials for us-east-1") {
		t.Errorf("got %v, want it to say: no basic auth credentials for us-east-1", err)
	}
}
