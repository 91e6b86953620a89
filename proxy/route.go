package proxy

import (
	"fmt"
	"net/http"
	"regexp"
	"strings"

	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/upstream"
)

// Kinds of registry API request a route can carry.
const (
	kindManifest  = "manifests"
	kindBlob      = "blobs"
	kindTags      = "tags" // the tag list: /v2/<name>/tags/list
	kindReferrers = "referrers"
)

// route is a registry API request resolved to the upstream that serves it.
type route struct {
	up   Upstream
	repo string // repository name at the upstream, normalized
	kind string // kindManifest, kindBlob, kindTags or kindReferrers
	ref  string // tag or digest; the subject's digest for kindReferrers
}

// tagPattern is the distribution spec's tag grammar.
var tagPattern = regexp.MustCompile(`^[\w][\w.-]{0,127}$`)

// parsePath splits "/v2/<name>/<kind>/<ref>" into its parts. The name may
// itself contain "manifests" or "blobs" as a component, so the kind is read
// from the end.
func parsePath(path string) (name, kind, ref string, ok bool) {
	rest, ok := strings.CutPrefix(path, "/v2/")
	if !ok {
		return "", "", "", false
	}
	i := strings.LastIndexByte(rest, '/')
	if i <= 0 {
		return "", "", "", false
	}
	ref = rest[i+1:]
	j := strings.LastIndexByte(rest[:i], '/')
	if j <= 0 {
		return "", "", "", false
	}
	name, kind = rest[:j], rest[j+1:i]
	switch {
	case kind == kindTags && ref == "list":
	case (kind != kindManifest && kind != kindBlob && kind != kindReferrers) || ref == "":
		return "", "", "", false
	}
	return name, kind, ref, true
}

// resolve picks the upstream for a request, in this order: containerd's ns
// query parameter; a first path component naming a configured upstream
// (CRI-O's mirror location "mirror:5000/docker.io", or
// "mirror:5000/registry.internal_5000" for registry.internal:5000, see
// prefixUpstream); the default upstream (Docker's registry-mirrors). A
// request naming no configured upstream is refused: pullproxy is not an
// open proxy.
// ns is the request's ns query parameter.
func (s *Server) resolve(method, urlPath, ns string) (route, error) {
	name, kind, ref, ok := parsePath(urlPath)
	if !ok {
		return route{}, errUnsupported(fmt.Sprintf("%s %s is not part of the registry API pullproxy serves", method, urlPath))
	}
	var up Upstream
	if ns != "" {
		up = s.upstreams[upstream.CanonicalName(ns)]
		if up == nil {
			return route{}, &ociError{status: http.StatusNotFound, code: "NAME_UNKNOWN",
				message: fmt.Sprintf("pullproxy does not mirror %s: no upstream of that name is configured", ns)}
		}
	} else if named, rest := s.prefixUpstream(name); named != nil {
		up, name = named, rest
	} else if s.defaultUpstream != nil {
		up = s.defaultUpstream
	} else {
		return route{}, &ociError{status: http.StatusNotFound, code: "NAME_UNKNOWN",
			message: fmt.Sprintf("%s names no configured upstream and no default upstream is set", name)}
	}
	return routeTo(up, name, kind, ref)
}

// routeTo is the route to ref (of kind) in repository name of up, once
// checked: the name normalized and valid, ref a valid tag or digest.
func routeTo(up Upstream, name, kind, ref string) (route, error) {
	name = upstream.NormalizeRepository(up.Name(), name)
	if !plainName(name) {
		if _, err := reference.WithName(name); err != nil {
			return route{}, &ociError{status: http.StatusBadRequest, code: "NAME_INVALID",
				message: fmt.Sprintf("invalid repository name %q: %v", name, err)}
		}
	}
	switch {
	case kind == kindTags:
	case kind == kindBlob || kind == kindReferrers || strings.Contains(ref, ":"):
		if isSHA256(ref) {
			break
		}
		if _, err := digest.Parse(ref); err != nil {
			return route{}, &ociError{status: http.StatusBadRequest, code: "DIGEST_INVALID",
				message: fmt.Sprintf("invalid digest %q: %v", ref, err)}
		}
	case !tagPattern.MatchString(ref):
		return route{}, &ociError{status: http.StatusBadRequest, code: "MANIFEST_INVALID",
			message: fmt.Sprintf("invalid tag %q", ref)}
	}
	return route{up: up, repo: name, kind: kind, ref: ref}, nil
}

// prefixUpstream returns the configured upstream that name's first path
// component names, and the rest of name; nil if it names none. A registry
// with a port is named HOST_PORT there (the last "_" followed only by
// digits stands for ":"): a colon is not valid in a repository path, and
// podman refuses a mirror location with one, while an underscore is not
// valid in a host name, so the two forms cannot meet. It runs on every
// request without ns: the HOST_PORT form costs an allocation only when the
// component ends in "_" and digits.
func (s *Server) prefixUpstream(name string) (Upstream, string) {
	first, rest, found := strings.Cut(name, "/")
	if !found {
		return nil, ""
	}
	if up := s.upstreams[upstream.CanonicalName(first)]; up != nil {
		return up, rest
	}
	i := strings.LastIndexByte(first, '_')
	if i <= 0 || i == len(first)-1 {
		return nil, ""
	}
	for j := i + 1; j < len(first); j++ {
		if first[j] < '0' || first[j] > '9' {
			return nil, ""
		}
	}
	if up := s.upstreams[upstream.CanonicalName(first[:i]+":"+first[i+1:])]; up != nil {
		return up, rest
	}
	return nil, ""
}

// isSHA256 reports whether ref is a sha256 digest in canonical form, which
// is what digest.Parse accepts for sha256, without its regular expressions.
func isSHA256(ref string) bool {
	hex, ok := strings.CutPrefix(ref, "sha256:")
	if !ok || len(hex) != 64 {
		return false
	}
	for i := range len(hex) {
		if c := hex[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// plainName reports whether name is a repository name that
// reference.WithName accepts because it is made of path components alone
// (lowercase alphanumerics joined by ".", "_", "__" or dashes, no domain or
// port), checked without its regular expressions, as on every request. Any
// other name is left to reference.WithName.
func plainName(name string) bool {
	if name == "" || len(name) > reference.RepositoryNameTotalLengthMax {
		return false
	}
	for comp := range strings.SplitSeq(name, "/") {
		if !pathComponent(comp) {
			return false
		}
	}
	return true
}

// pathComponent reports whether c matches the distribution grammar's
// path-component: alphanumeric (separator alphanumeric)*.
func pathComponent(c string) bool {
	for i := 0; i < len(c); {
		if isAlnum(c[i]) {
			i++
			continue
		}
		j := i
		for j < len(c) && !isAlnum(c[j]) {
			j++
		}
		if i == 0 || j == len(c) || !separator(c[i:j]) {
			return false
		}
		i = j
	}
	return c != ""
}

// separator reports whether s, a run between alphanumerics, is one of the
// grammar's separators: ".", "_", "__" or one or more "-".
func separator(s string) bool {
	switch s {
	case ".", "_", "__":
		return true
	}
	return strings.Trim(s, "-") == ""
}

func isAlnum(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }
