// Package nodeconfig writes what a node's container runtime needs to pull
// through the mirror: containerd's hosts.toml per registry, and CRI-O's
// (and podman's) registries.conf.
package nodeconfig

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"

	"github.com/distribution/reference"

	"github.com/pullproxy/pullproxy/upstream"
)

// Registry is a registry a node pulls through the mirror.
type Registry struct {
	Name   string // host[:port], canonical: containerd's directory, CRI-O's prefix
	scheme string // how the registry itself is reached: "https" or "http"
}

// registryHostPattern is a registry host, optionally with a port, as an
// image reference spells it.
var registryHostPattern = regexp.MustCompile(`^(?:` + reference.DomainRegexp.String() + `)$`)

// ParseRegistry reads a --registry value: NAME, http://NAME or https://NAME,
// NAME being a host, optionally with a port. The scheme says how the node
// reaches the registry itself, when it falls back to it.
func ParseRegistry(v string) (Registry, error) {
	r := Registry{Name: v, scheme: "https"}
	if strings.Contains(v, "://") {
		u, err := url.Parse(v)
		switch {
		case err != nil:
			return r, fmt.Errorf("not a URL: %w", err)
		case u.Scheme != "http" && u.Scheme != "https":
			return r, fmt.Errorf("scheme %s: want http:// or https://", u.Scheme)
		case u.User != nil:
			return r, errors.New("has credentials: they belong in the node's own auth config")
		case strings.Trim(u.Path, "/") != "" || u.RawPath != "":
			return r, errors.New("has a path: want a registry host, e.g. http://registry.internal:5000")
		case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
			return r, errors.New("has a query or fragment: want a registry host, e.g. http://registry.internal:5000")
		}
		r.Name, r.scheme = u.Host, u.Scheme
	}
	if !registryHostPattern.MatchString(r.Name) {
		return r, errors.New("want a registry host, optionally with :PORT and http:// or https://, e.g. docker.io or http://registry.internal:5000")
	}
	r.Name = upstream.CanonicalName(r.Name)
	if r.Name == upstream.DockerHub && r.scheme == "http" {
		return r, errors.New("docker.io is served over https only")
	}
	return r, nil
}

// host is where a node reaches the registry itself: Docker Hub's API is
// not at docker.io.
func (r Registry) host() string {
	if r.Name == upstream.DockerHub {
		return "registry-1.docker.io"
	}
	return r.Name
}

// server is the URL a node reaches the registry itself at.
func (r Registry) server() string { return r.scheme + "://" + r.host() }

// mirrorPrefix is the registry's name as the first path component of its
// mirror location: HOST_PORT for HOST:PORT, as a repository path cannot
// hold a colon (podman refuses the reference). pullproxy routes either form.
func (r Registry) mirrorPrefix() string {
	if i := strings.LastIndexByte(r.Name, ':'); i >= 0 {
		return r.Name[:i] + "_" + r.Name[i+1:]
	}
	return r.Name
}

// HostsTOML is containerd's hosts.toml for registry: the mirror first,
// then the registry itself. containerd always appends the registry as its
// last host; without fallback it is given only the push capability, so
// that no pull or resolve goes to it.
func HostsTOML(mirror *url.URL, registry Registry, noFallback bool) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s through pullproxy; written by pullproxy node-config.\n", registry.Name)
	fmt.Fprintf(&b, "# containerd adds ?ns=%s to each request to the mirror, so pullproxy knows the upstream.\n", registry.Name)
	fmt.Fprintf(&b, "server = %q\n", registry.server())
	if noFallback {
		b.WriteString("# No fallback: the registry itself is never asked for a pull.\ncapabilities = [\"push\"]\n")
	}
	fmt.Fprintf(&b, "\n[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n", mirror.String())
	return b.String()
}

// CRIORegistries is a registries.conf drop-in: each registry's mirror is
// the mirror with the registry's name (HOST_PORT for a port) as the first
// path component, as pullproxy routes requests that carry no ns.
// insecure lets CRI-O and podman speak plain HTTP to a location.
func CRIORegistries(mirror *url.URL, registries []Registry, noFallback bool) string {
	var b strings.Builder
	b.WriteString("# CRI-O and podman through pullproxy; written by pullproxy node-config.\n")
	b.WriteString("# The mirror's path names the registry; a port is written _PORT, as a path cannot hold a colon.\n")
	mirrorInsecure := mirror.Scheme == "http"
	for _, r := range registries {
		through := mirror.Host + "/" + r.mirrorPrefix()
		if noFallback {
			// CRI-O pulls from location once every mirror failed: there,
			// location is the mirror too.
			fmt.Fprintf(&b, "\n[[registry]]\nprefix = %q\nlocation = %q\ninsecure = %v\n", r.Name, through, mirrorInsecure)
			continue
		}
		fmt.Fprintf(&b, "\n[[registry]]\nprefix = %q\nlocation = %q\ninsecure = %v\n", r.Name, r.host(), r.scheme == "http")
		fmt.Fprintf(&b, "\n[[registry.mirror]]\nlocation = %q\ninsecure = %v\n", through, mirrorInsecure)
	}
	return b.String()
}
