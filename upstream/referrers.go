package upstream

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// maxReferrerPages bounds the pages of one subject's referrers followed.
// A signed, attested image has a handful of referrers: one page.
const maxReferrerPages = 32

// Referrers returns the descriptors of the manifests in repo that name
// subject as theirs, from the upstream's referrers API, every page of the
// answer merged, each descriptor as the upstream wrote it. An upstream
// without the API answers 404 (ErrNotFound), as the distribution spec
// has it: clients then look up the subject's tag-schema tag.
func (r *Registry) Referrers(ctx context.Context, repo string, subject digest.Digest) ([]json.RawMessage, error) {
	manifests := []json.RawMessage{}
	q := request{method: http.MethodGet, repo: repo, path: "referrers/" + subject.String(),
		header: http.Header{"Accept": {ocispec.MediaTypeImageIndex}}}
	for range maxReferrerPages {
		page, next, err := r.referrersPage(ctx, q)
		if err != nil {
			return nil, err
		}
		manifests = append(manifests, page...)
		if next == "" || next == q.query {
			return manifests, nil
		}
		q.query = next
	}
	return nil, &Error{Upstream: r.name, Op: q.op(), Status: http.StatusOK, Kind: ErrInvalid,
		Message: fmt.Sprintf("the referrers of %s run over %d pages", subject, maxReferrerPages)}
}

func (r *Registry) referrersPage(ctx context.Context, q request) ([]json.RawMessage, string, error) {
	resp, err := r.do(ctx, q)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	var index struct {
		SchemaVersion int               `json:"schemaVersion"`
		Manifests     []json.RawMessage `json:"manifests"`
	}
	err = json.NewDecoder(io.LimitReader(resp.Body, MaxManifestSize)).Decode(&index)
	if err == nil && index.SchemaVersion != 2 {
		err = fmt.Errorf("schemaVersion %d, not 2", index.SchemaVersion)
	}
	if err != nil {
		return nil, "", &Error{Upstream: r.name, Endpoint: responseHost(resp), Op: q.op(), Status: resp.StatusCode,
			Kind: ErrInvalid, Message: "the referrers answer is not an image index: " + err.Error()}
	}
	return index.Manifests, nextQuery(resp.Header.Get("Link"), "/v2/"+q.repo+"/"+q.path), nil
}

// nextQuery returns the encoded query of a Link header's rel="next"
// target, when that target is path (with or without a scheme and host):
// pagination of the referrers API carries whatever state the registry
// chooses in it.
func nextQuery(link, path string) string {
	for part := range strings.SplitSeq(link, ",") {
		target, params, ok := strings.Cut(part, ";")
		if !ok || !strings.Contains(strings.NewReplacer(" ", "", `"`, "").Replace(params), "rel=next") {
			continue
		}
		u, err := url.Parse(strings.Trim(strings.TrimSpace(target), "<>"))
		if err != nil || u.Path != path {
			continue
		}
		return u.RawQuery
	}
	return ""
}
