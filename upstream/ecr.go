package upstream

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/ecr"
	"golang.org/x/sync/singleflight"
)

// ecrHost matches ECR registry hosts, FIPS and the China and isolated
// partitions included, capturing the region. The pattern is the one of
// amazon-ecr-credential-helper.
var ecrHost = regexp.MustCompile(`^(\d{12})\.dkr[\.\-]ecr(\-fips)?\.([a-zA-Z0-9][a-zA-Z0-9-_]*)\.(amazonaws\.com(\.cn)?|on\.(aws|amazonwebservices\.com\.cn)|sc2s\.sgov\.gov|c2s\.ic\.gov|cloud\.adc-e\.uk|csp\.hci\.ic\.gov)$`)

// ECRRegion returns the region in an ECR registry host, or "".
func ECRRegion(host string) string {
	host, _, _ = strings.Cut(host, ":")
	if m := ecrHost.FindStringSubmatch(host); m != nil {
		return m[3]
	}
	return ""
}

// ECRCredentials are ECR authorization tokens from GetAuthorizationToken,
// one per region (a token is good only for its region's registry), fetched
// on first use with the AWS SDK's default credential chain (environment,
// shared config, IRSA web identity, container, IMDS) and replaced well
// before they expire. Concurrent requests for one region share one fetch.
type ECRCredentials struct {
	apiEndpoint string
	loadConfig  func(ctx context.Context, region string) (aws.Config, error)
	log         *slog.Logger
	metrics     *Metrics // nil: not counted
	now         func() time.Time

	mu      sync.Mutex
	tokens  map[string]ecrToken  // by region
	renewed map[string]time.Time // by region: last renewal forced by a refusal
	fetches singleflight.Group
}

var _ Preemptive = (*ECRCredentials)(nil)

type ecrToken struct {
	user, pass string
	refreshAt  time.Time // replace from here on, in the background
	expires    time.Time // no use from here on
}

// minRenewInterval bounds renewals on refusals: a 403 for lack of
// permission looks like one for an expired token, and must not turn every
// request into a GetAuthorizationToken call.
const minRenewInterval = time.Minute

// ECROption configures ECRCredentials.
type ECROption func(*ECRCredentials)

// WithECRAPIEndpoint points the ECR API client at another endpoint (a VPC
// endpoint, or a stand-in in tests). Default: the SDK's regional endpoint.
func WithECRAPIEndpoint(url string) ECROption {
	return func(c *ECRCredentials) { c.apiEndpoint = url }
}

// WithAWSConfig replaces the SDK's default configuration loading, e.g. to
// use static credentials. Default: config.LoadDefaultConfig with the region.
func WithAWSConfig(load func(ctx context.Context, region string) (aws.Config, error)) ECROption {
	return func(c *ECRCredentials) { c.loadConfig = load }
}

// WithECRMetrics counts token renewals in m.
func WithECRMetrics(m *Metrics) ECROption {
	return func(c *ECRCredentials) { c.metrics = m }
}

// WithECRLogger sets the logger. Default: slog.Default().
func WithECRLogger(l *slog.Logger) ECROption {
	return func(c *ECRCredentials) { c.log = l }
}

// NewECRCredentials returns ECR credentials.
func NewECRCredentials(opts ...ECROption) *ECRCredentials {
	c := &ECRCredentials{
		loadConfig: func(ctx context.Context, region string) (aws.Config, error) {
			return config.LoadDefaultConfig(ctx, config.WithRegion(region))
		},
		log:     slog.Default(),
		now:     time.Now,
		tokens:  map[string]ecrToken{},
		renewed: map[string]time.Time{},
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

// Basic implements Credentials: "AWS" and the region's token.
func (c *ECRCredentials) Basic(ctx context.Context, ep Endpoint) (string, string, bool, error) {
	region := ep.Region
	if region == "" {
		region = ECRRegion(ep.Host)
	}
	if region == "" {
		return "", "", false, fmt.Errorf("no region for ECR endpoint %s: name it in the endpoint's region", ep.Host)
	}
	now := c.now()
	c.mu.Lock()
	tok, ok := c.tokens[region]
	c.mu.Unlock()
	switch {
	case ok && now.Before(tok.refreshAt):
	case ok && now.Before(tok.expires):
		// Still good: use it, and replace it meanwhile.
		go func() {
			if _, err := c.fetch(context.WithoutCancel(ctx), region); err != nil {
				c.log.Warn("renewing an ECR token ahead of expiry failed: the current one is used until it expires",
					"region", region, "expires", tok.expires.Format(time.RFC3339), "err", err)
			}
		}()
	default:
		var err error
		if tok, err = c.fetch(ctx, region); err != nil {
			return "", "", false, err
		}
	}
	return tok.user, tok.pass, true, nil
}

// Refresh implements Preemptive: the registry refused the region's token
// (ECR answers an expired token with 403), so drop it; at most once a
// minute per region.
func (c *ECRCredentials) Refresh(ctx context.Context, ep Endpoint) bool {
	region := ep.Region
	if region == "" {
		region = ECRRegion(ep.Host)
	}
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if now.Sub(c.renewed[region]) < minRenewInterval {
		return false
	}
	c.renewed[region] = now
	delete(c.tokens, region)
	return true
}

// fetch gets a new token for region, once for all concurrent callers.
func (c *ECRCredentials) fetch(ctx context.Context, region string) (ecrToken, error) {
	ch := c.fetches.DoChan(region, func() (any, error) {
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		tok, err := c.getToken(fctx, region)
		c.metrics.ecrRenewal(region, err)
		if err != nil {
			return ecrToken{}, err
		}
		c.mu.Lock()
		c.tokens[region] = tok
		c.mu.Unlock()
		c.log.Info("ECR token obtained", "region", region, "expires", tok.expires.Format(time.RFC3339))
		return tok, nil
	})
	select {
	case res := <-ch:
		if res.Err != nil {
			return ecrToken{}, res.Err
		}
		return res.Val.(ecrToken), nil
	case <-ctx.Done():
		return ecrToken{}, ctx.Err()
	}
}

func (c *ECRCredentials) getToken(ctx context.Context, region string) (ecrToken, error) {
	cfg, err := c.loadConfig(ctx, region)
	if err != nil {
		return ecrToken{}, fmt.Errorf("ECR %s: loading AWS configuration: %w", region, err)
	}
	client := ecr.NewFromConfig(cfg, func(o *ecr.Options) {
		o.Region = region
		if c.apiEndpoint != "" {
			o.BaseEndpoint = aws.String(c.apiEndpoint)
		}
	})
	out, err := client.GetAuthorizationToken(ctx, &ecr.GetAuthorizationTokenInput{})
	if err != nil {
		return ecrToken{}, fmt.Errorf("ECR %s: GetAuthorizationToken: %w", region, err)
	}
	if len(out.AuthorizationData) == 0 || out.AuthorizationData[0].AuthorizationToken == nil {
		return ecrToken{}, fmt.Errorf("ECR %s: GetAuthorizationToken returned no token", region)
	}
	data := out.AuthorizationData[0]
	raw, err := base64.StdEncoding.DecodeString(aws.ToString(data.AuthorizationToken))
	if err != nil {
		return ecrToken{}, fmt.Errorf("ECR %s: token is not base64", region)
	}
	user, pass, ok := strings.Cut(string(raw), ":")
	if !ok {
		return ecrToken{}, errors.New("ECR " + region + ": token is not user:password")
	}
	now := c.now()
	expires := now.Add(12 * time.Hour)
	if data.ExpiresAt != nil {
		expires = *data.ExpiresAt
	}
	// Replace it well ahead: an hour early for the usual 12 h, half way
	// through for short lifetimes.
	life := max(expires.Sub(now), 0)
	return ecrToken{user: user, pass: pass, expires: expires, refreshAt: now.Add(life - min(time.Hour, life/2))}, nil
}
