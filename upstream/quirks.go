package upstream

import "strings"

// Upstream quirks, in one place. Each entry says why it exists.

// DockerHub is the name containerd and Docker use for Docker Hub.
const DockerHub = "docker.io"

// Default is an upstream served when none are configured.
type Default struct{ Name, URL string }

// Defaults returns the upstreams served when none are configured: the public
// registries a cluster commonly pulls from, by the name images use for them,
// and the URL their API answers on.
func Defaults() []Default {
	return []Default{
		// docker.io is a name, not a host: its API lives at registry-1.docker.io.
		// https://docs.docker.com/docker-hub/usage/
		{DockerHub, "https://registry-1.docker.io"},
		{"ghcr.io", "https://ghcr.io"},
		{"quay.io", "https://quay.io"},
		{"registry.k8s.io", "https://registry.k8s.io"},
		{"public.ecr.aws", "https://public.ecr.aws"},
		{"gcr.io", "https://gcr.io"},
		{"mcr.microsoft.com", "https://mcr.microsoft.com"},
	}
}

// CanonicalName maps the other names a registry is known by to the one
// upstreams are configured under: Docker Hub is asked for as docker.io,
// index.docker.io (Docker's legacy name) or registry-1.docker.io (its API
// host) depending on the client.
func CanonicalName(host string) string {
	switch strings.ToLower(host) {
	case "index.docker.io", "registry-1.docker.io":
		return DockerHub
	}
	return strings.ToLower(host)
}

// NormalizeRepository adds Docker Hub's implicit "library/" to official
// images ("alpine" is "library/alpine"): Docker Hub's API knows only the long
// form, while Docker's registry-mirrors and path-prefix mirrors may send the
// short one.
func NormalizeRepository(upstream, repo string) string {
	if upstream == DockerHub && !strings.Contains(repo, "/") {
		return "library/" + repo
	}
	return repo
}

// Redirects: blob GETs are redirected to object storage (ECR → presigned S3,
// Docker Hub → its CDN). net/http follows them and drops the Authorization
// header unless the new host is the same name or a subdomain of it, which
// covers S3 (it rejects a request carrying a second auth mechanism with 400)
// and the CDNs; we rely on that rather than re-implementing redirects.
// https://pkg.go.dev/net/http#Client
