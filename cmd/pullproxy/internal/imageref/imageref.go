// Package imageref reads image references the way pullproxy's store names
// images: the upstream's canonical name, the repository as the upstream
// spells it, and a tag or digest.
package imageref

import (
	"fmt"

	"github.com/distribution/reference"

	"github.com/pullproxy/pullproxy/upstream"
)

// Ref is an image, as the store names it.
type Ref struct {
	Upstream string // canonical: docker.io, ghcr.io, registry.internal:5000
	Repo     string // library/alpine
	Ref      string // a tag, or a digest
}

// Parse reads a full reference, the upstream's name first
// ("docker.io/library/alpine:3.20", "ghcr.io/org/app@sha256:…"); Docker
// Hub's short names ("alpine:3.20") mean docker.io, and no tag means
// latest.
func Parse(s string) (Ref, error) {
	named, err := reference.ParseNormalizedNamed(s)
	if err != nil {
		return Ref{}, fmt.Errorf("pin %q: %w", s, err)
	}
	up := upstream.CanonicalName(reference.Domain(named))
	p := Ref{Upstream: up, Repo: upstream.NormalizeRepository(up, reference.Path(named))}
	switch r := named.(type) {
	case reference.Canonical:
		p.Ref = r.Digest().String()
	case reference.Tagged:
		p.Ref = r.Tag()
	default:
		p.Ref = "latest"
	}
	return p, nil
}
