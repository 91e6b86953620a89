package config

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/pullproxy/pullproxy/upstream"
)

// Upstream is a registry pullproxy mirrors.
type Upstream struct {
	Name      string     `yaml:"name"`
	Endpoints []Endpoint `yaml:"endpoints"`
	Auth      Auth       `yaml:"auth"`
	// CAFile is a PEM bundle of CAs trusted for this upstream, besides the
	// system's (a private registry's own CA).
	CAFile string `yaml:"ca_file"`
	// InsecureSkipVerify accepts any certificate from this upstream: for a
	// lab only; logged as a warning at every start.
	InsecureSkipVerify bool `yaml:"insecure_skip_verify"`
	// TokenRealmHosts are hosts besides the endpoints' that a token realm
	// may be on and still be sent the credentials.
	TokenRealmHosts []string `yaml:"token_realm_hosts"`
	// RedirectAllow are hosts, addresses and networks that redirects may
	// go to although they are loopback, link-local or private.
	RedirectAllow []string `yaml:"redirect_allow"`
	// AllowClients are the addresses and networks that may pull from this
	// upstream through pullproxy; empty: any the listener lets in.
	AllowClients []string `yaml:"allow_clients"`
	// Offline: this upstream is never contacted; what the store holds
	// for it is served (an air-gapped site's imports).
	Offline bool `yaml:"offline"`
}

// TLSConfig returns the upstream's TLS settings, or nil for the defaults.
func (u Upstream) TLSConfig(log *slog.Logger) (*tls.Config, error) {
	if u.CAFile == "" && !u.InsecureSkipVerify {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if u.CAFile != "" {
		pem, err := os.ReadFile(u.CAFile)
		if err != nil {
			return nil, fmt.Errorf("upstream %s: reading ca_file: %w", u.Name, err)
		}
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("upstream %s: ca_file %s holds no PEM certificate", u.Name, u.CAFile)
		}
		cfg.RootCAs = pool
	}
	if u.InsecureSkipVerify {
		cfg.InsecureSkipVerify = true
		log.Warn("TLS certificates of this upstream are NOT verified: anyone on the path can serve or alter its content",
			"upstream", u.Name, "setting", "insecure_skip_verify", "fix", "give the registry's CA in ca_file instead")
	}
	return cfg, nil
}

// Endpoint is one URL an upstream is reached at.
type Endpoint struct {
	URL    string `yaml:"url"`
	Region string `yaml:"region"` // overrides the region read from the host (ECR)
	// FailoverOnly keeps the endpoint out of fetching blobs alongside the
	// others: it is tried only once they all failed (one that costs money
	// per byte, or whose content may lag).
	FailoverOnly bool `yaml:"failover_only"`
}

// Auth is how an upstream authenticates. See the README for examples.
type Auth struct {
	Type         string `yaml:"type"`          // anonymous (default) | basic | dockerconfig | ecr
	Username     string `yaml:"username"`      // basic
	Password     string `yaml:"password"`      // basic
	PasswordFile string `yaml:"password_file"` // basic: read the password from this file
	Config       string `yaml:"config"`        // dockerconfig: config.json or .dockerconfigjson; default $DOCKER_CONFIG/config.json or ~/.docker/config.json
	APIEndpoint  string `yaml:"api_endpoint"`  // ecr: the ECR API endpoint (VPC endpoint); default the region's
}

// Credentials builds the upstream's credentials; nil means anonymous.
func (a Auth) Credentials(upstreamName string, log *slog.Logger, m *upstream.Metrics) (upstream.Credentials, error) {
	switch a.Type {
	case "", "anonymous":
		return nil, nil
	case "basic":
		pass := a.Password
		if a.PasswordFile != "" {
			b, err := os.ReadFile(a.PasswordFile)
			if err != nil {
				return nil, fmt.Errorf("upstream %s: reading password_file: %w", upstreamName, err)
			}
			pass = strings.TrimRight(string(b), "\r\n")
		}
		if a.Username == "" || pass == "" {
			return nil, fmt.Errorf("upstream %s: basic auth needs username and password (or password_file)", upstreamName)
		}
		return upstream.StaticCredentials{Username: a.Username, Password: pass}, nil
	case "dockerconfig":
		path := a.Config
		if path == "" {
			dir := os.Getenv("DOCKER_CONFIG")
			if dir == "" {
				home, err := os.UserHomeDir()
				if err != nil {
					return nil, fmt.Errorf("upstream %s: no docker config given and no home directory: %w", upstreamName, err)
				}
				dir = filepath.Join(home, ".docker")
			}
			path = filepath.Join(dir, "config.json")
		}
		c, err := upstream.LoadDockerConfig(path)
		if err != nil {
			return nil, fmt.Errorf("upstream %s: %w", upstreamName, err)
		}
		return c, nil
	case "ecr":
		opts := []upstream.ECROption{upstream.WithECRLogger(log), upstream.WithECRMetrics(m)}
		if a.APIEndpoint != "" {
			opts = append(opts, upstream.WithECRAPIEndpoint(a.APIEndpoint))
		}
		return upstream.NewECRCredentials(opts...), nil
	}
	return nil, fmt.Errorf("upstream %s: auth type %q: want anonymous, basic, dockerconfig or ecr", upstreamName, a.Type)
}

// parseUpstreamFlag parses --upstream NAME=URL[,URL...].
func parseUpstreamFlag(v string) (Upstream, error) {
	name, urls, ok := strings.Cut(v, "=")
	if !ok || name == "" || urls == "" {
		return Upstream{}, fmt.Errorf("--upstream %q: want NAME=URL[,URL...], e.g. docker.io=https://registry-1.docker.io", v)
	}
	u := Upstream{Name: name}
	for _, url := range strings.Split(urls, ",") {
		u.Endpoints = append(u.Endpoints, Endpoint{URL: strings.TrimSpace(url)})
	}
	return u, nil
}

// MergeUpstreams applies --upstream flags over the file's upstreams: a flag
// replaces the endpoints of the upstream of the same name, or adds one.
func MergeUpstreams(file, flags []Upstream) []Upstream {
	out := append([]Upstream(nil), file...)
	for _, f := range flags {
		replaced := false
		for i := range out {
			if upstream.CanonicalName(out[i].Name) == upstream.CanonicalName(f.Name) {
				out[i].Endpoints, replaced = f.Endpoints, true
			}
		}
		if !replaced {
			out = append(out, f)
		}
	}
	return out
}

// WithDefaultUpstreams fills in the public registries when none are configured.
func WithDefaultUpstreams(ups []Upstream) []Upstream {
	if len(ups) > 0 {
		return ups
	}
	for _, d := range upstream.Defaults() {
		ups = append(ups, Upstream{Name: d.Name, Endpoints: []Endpoint{{URL: d.URL}}})
	}
	return ups
}
