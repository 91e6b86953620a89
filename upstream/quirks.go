package upstream

import "strings"

// Upstream quirks: where real registries depart from the distribution spec,
// or from each other, and how pullproxy copes. The names below handle the
// naming quirks; the others are handled where the protocol is, and listed
// here so that one place says what pullproxy works around and why.
//
//	quirk                                        why it matters                  handled in
//	-------------------------------------------  ------------------------------  --------------------------
//	docker.io is a name, not a host: its API is  requests to docker.io fail      Defaults
//	  registry-1.docker.io                         https://docs.docker.com/docker-hub/usage/
//	Docker Hub is also asked for as              each would be a separate cache  CanonicalName
//	  index.docker.io or registry-1.docker.io
//	Docker Hub's official images are "alpine"    its API knows only the long     NormalizeRepository
//	  to clients, "library/alpine" to the API      form
//	ECR answers an expired token with 403, not   a 401-only refresh never        Registry.send (Preemptive)
//	  401, and wants Basic credentials up front     renews it; a challenge per request doubles round trips
//	  https://docs.aws.amazon.com/AmazonECR/latest/userguide/common-errors-docker.html
//	ECR tokens are per registry host (region)    one region's token is refused   ECRCredentials, ECRRegion
//	                                               by another ("no basic auth credentials")
//	blob GETs redirect to object storage (ECR:   S3 rejects a request with a     blobFetch.open, getLocation
//	  presigned S3, ~1 h; Docker Hub: a CDN;       second auth mechanism (400); resolving the redirect
//	  GHCR: short-lived URLs)                      for every chunk costs a round trip: the Location is
//	                                               reused without Authorization until it is refused, then
//	                                               resolved again through the registry
//	some registries ignore Range (200, whole     bytes would be written at the   blobFetch.fetchChunk
//	  blob) or send Content-Range "bytes a-b/*"    wrong offsets                   (noRange: one stream)
//	an upload stored twice (Nexus): the blob is  containerd fails the pull;      blobFetch.checkSize
//	  an exact multiple of the declared size       the declared bytes still verify
//	HEAD of a manifest without                   the digest is unknown           proxy: lookupTag (GET)
//	  Docker-Content-Digest, or manifests served
//	  as application/json or text/plain
//	429 with Retry-After (Docker Hub: 100        asking again adds to the count  rateLimit
//	  anonymous pulls per 6 h per IP)              https://docs.docker.com/docker-hub/usage/pulls/
//	a tag pushed before a replication rule is    a replica answers 404 for it    Registry.do (the message)
//	  not on the replica (ECR does not backfill)

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

// Redirects of blob chunks are not followed by net/http (see the table and
// newChunkClient). Metadata requests (manifests, HEADs) do follow them, and
// net/http drops Authorization when the target is not the same host or a
// subdomain of it: https://pkg.go.dev/net/http#Client
