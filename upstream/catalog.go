package upstream

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
)

// RepositoryPage is a page of the repositories an upstream's catalog lists.
type RepositoryPage struct {
	Repositories []string
	// Next is the query (n and last) of the next page, as the upstream's
	// Link header gives it; empty on the last page.
	Next url.Values
}

// ListRepositories returns a page of the upstream's catalog (GET
// /v2/_catalog): n repositories (0: as many as the upstream gives) after
// last (empty: from the start). Registries that keep their catalog to
// themselves (Docker Hub, GHCR) refuse it, or list only what the
// credentials may see.
func (r *Registry) ListRepositories(ctx context.Context, n int, last string) (RepositoryPage, error) {
	query := url.Values{}
	if n > 0 {
		query.Set("n", strconv.Itoa(n))
	}
	if last != "" {
		query.Set("last", last)
	}
	q := request{method: http.MethodGet, path: "_catalog", query: query.Encode()}
	resp, err := r.do(ctx, q)
	if err != nil {
		return RepositoryPage{}, err
	}
	defer resp.Body.Close()
	var body struct {
		Repositories []string `json:"repositories"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, MaxManifestSize)).Decode(&body); err != nil {
		return RepositoryPage{}, &Error{Upstream: r.name, Endpoint: responseHost(resp), Op: q.op(), Status: resp.StatusCode,
			Kind: ErrInvalid, Message: "the catalog is not JSON: " + err.Error()}
	}
	page := RepositoryPage{Repositories: body.Repositories, Next: nextPage(resp.Header.Get("Link"))}
	if page.Next == nil && n > 0 && len(page.Repositories) == n {
		// A full page without a Link: there may be more (see ListTags).
		page.Next = url.Values{"n": {strconv.Itoa(n)}, "last": {page.Repositories[n-1]}}
	}
	return page, nil
}
