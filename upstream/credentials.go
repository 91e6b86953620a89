package upstream

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"strings"
)

// Endpoint identifies an endpoint to a Credentials: the upstream it serves,
// its host and, for regional registries, its region.
type Endpoint struct {
	Upstream string
	Host     string
	Region   string
}

// Credentials supplies the basic credentials an upstream's endpoints take,
// directly (Basic challenges, ECR) or to obtain bearer tokens.
type Credentials interface {
	// Basic returns the username and password for ep; ok is false when
	// there are none (the request goes anonymously).
	Basic(ctx context.Context, ep Endpoint) (user, pass string, ok bool, err error)
}

// Preemptive is implemented by Credentials sent with every request instead
// of after a challenge (ECR: a challenge round trip per request would double
// the requests). Refresh drops what was sent to ep after the registry
// refused it (expired) and reports whether asking again may help.
type Preemptive interface {
	Credentials
	Refresh(ctx context.Context, ep Endpoint) bool
}

// StaticCredentials is one username and password for every endpoint.
type StaticCredentials struct{ Username, Password string }

var _ Credentials = StaticCredentials{}

// Basic implements Credentials.
func (c StaticCredentials) Basic(context.Context, Endpoint) (string, string, bool, error) {
	return c.Username, c.Password, c.Username != "" || c.Password != "", nil
}

// DockerConfig is the credentials of a docker config.json (~/.docker/config.json)
// or of a Kubernetes dockerconfigjson secret mounted as a file, looked up by
// host. Credential helpers are not run.
type DockerConfig struct {
	auths map[string]StaticCredentials // by host, as canonicalHost returns it
}

var _ Credentials = (*DockerConfig)(nil)

// LoadDockerConfig reads a docker config.json or .dockerconfigjson file.
func LoadDockerConfig(path string) (*DockerConfig, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading docker config: %w", err)
	}
	var f struct {
		Auths map[string]struct {
			Auth     string `json:"auth"`
			Username string `json:"username"`
			Password string `json:"password"`
		} `json:"auths"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("docker config %s: %w", path, err)
	}
	c := &DockerConfig{auths: map[string]StaticCredentials{}}
	for key, a := range f.Auths {
		cred := StaticCredentials{Username: a.Username, Password: a.Password}
		if a.Auth != "" {
			raw, err := base64.StdEncoding.DecodeString(a.Auth)
			if err != nil {
				return nil, fmt.Errorf("docker config %s: auth for %s is not base64", path, key)
			}
			user, pass, ok := strings.Cut(string(raw), ":")
			if !ok {
				return nil, fmt.Errorf("docker config %s: auth for %s is not user:password", path, key)
			}
			cred = StaticCredentials{Username: user, Password: pass}
		}
		c.auths[canonicalHost(key)] = cred
	}
	if len(c.auths) == 0 {
		return nil, fmt.Errorf("docker config %s holds no credentials (credential helpers are not supported)", path)
	}
	return c, nil
}

// Basic implements Credentials: the entry for the endpoint's host, else the
// one for the upstream's name (a mirror endpoint of docker.io, say).
func (c *DockerConfig) Basic(_ context.Context, ep Endpoint) (string, string, bool, error) {
	cred, ok := c.auths[canonicalHost(ep.Host)]
	if !ok {
		cred, ok = c.auths[canonicalHost(ep.Upstream)]
	}
	return cred.Username, cred.Password, ok, nil
}

// canonicalHost reduces a config.json key ("https://index.docker.io/v1/",
// "ghcr.io", "registry-1.docker.io") to a host, with Docker Hub's many
// names folded into one.
func canonicalHost(key string) string {
	host := key
	if u, err := url.Parse(key); err == nil && u.Host != "" {
		host = u.Host
	} else {
		host, _, _ = strings.Cut(host, "/")
	}
	return CanonicalName(host)
}
