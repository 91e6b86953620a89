package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// serveTags answers GET /v2/<name>/tags/list, with the distribution spec's
// n and last, and a Link header to the next page. A page is asked of the
// upstream, with its credentials, and kept per upstream, repository and
// query; like a tag, it is served from the store while younger than the
// tag TTL, and served stale (and counted) when the upstream cannot answer.
func (s *Server) serveTags(w http.ResponseWriter, r *http.Request, rt route) {
	q := r.URL.Query()
	n := 0
	if v := q.Get("n"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 0 {
			s.writeError(w, r, &ociError{status: http.StatusBadRequest, code: "PAGINATION_NUMBER_INVALID",
				message: fmt.Sprintf("n=%q: want a number of tags", v)})
			return
		}
	}
	last := q.Get("last")
	page, source, err := s.tagPage(r.Context(), rt, n, last)
	if err != nil {
		s.fail(w, r, rt, err)
		return
	}
	setSource(w, source)
	// The name as the client asked for it (docker.io's "alpine", not
	// "library/alpine"), its ns kept in the next page's link.
	name := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/v2/"), "/tags/list")
	body, _ := json.Marshal(struct {
		Name string   `json:"name"`
		Tags []string `json:"tags"`
	}{name, page.Tags})
	h := w.Header()
	if page.Next != "" {
		next, _ := url.ParseQuery(page.Next)
		if ns := q.Get("ns"); ns != "" {
			next.Set("ns", ns)
		}
		h.Set("Link", fmt.Sprintf(`</v2/%s/tags/list?%s>; rel="next"`, name, next.Encode()))
	}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		w.Write(body)
	}
}

// tagPage returns a page of rt's tag list, from the store while fresh,
// else from the upstream (one request however many clients ask).
func (s *Server) tagPage(ctx context.Context, rt route, n int, last string) (storage.TagListRecord, string, error) {
	name := rt.up.Name()
	query := url.Values{}
	if n > 0 {
		query.Set("n", strconv.Itoa(n))
	}
	if last != "" {
		query.Set("last", last)
	}
	key := query.Encode()
	rec, err := s.tags.TagList(ctx, name, rt.repo, key)
	cached := err == nil
	if err != nil && !errors.Is(err, storage.ErrNotFound) {
		s.log.Warn("reading the tag list cache", "err", err)
	}
	if cached && (time.Since(rec.CheckedAt) < s.tagTTL || isOffline(rt.up)) {
		return rec, sourceCache, nil
	}
	if !cached && key != "" && isOffline(rt.up) {
		// Offline, a page never asked for is cut from the whole list, if
		// that is known (an import records it).
		if whole, err := s.tags.TagList(ctx, name, rt.repo, ""); err == nil {
			return pageOf(whole, n, last), sourceCache, nil
		}
	}
	v, err, _ := s.shared(ctx, "tags "+name+"/"+rt.repo+"?"+key, func(ctx context.Context) (any, error) {
		page, err := rt.up.ListTags(ctx, rt.repo, n, last)
		if err != nil {
			return nil, err
		}
		rec := storage.TagListRecord{Tags: page.Tags, Next: page.Next.Encode(), CheckedAt: time.Now()}
		if last != "" && slices.Contains(rec.Tags, last) {
			// The upstream ignored last: a page after last never holds
			// last itself. Distribution 2.8 ignores n and last, and sends
			// its tags unsorted: cut the page as asked, in lexical order.
			rec = pageOf(storage.TagListRecord{Tags: slices.Sorted(slices.Values(rec.Tags)), CheckedAt: rec.CheckedAt}, n, last)
		}
		if err := s.tags.PutTagList(ctx, name, rt.repo, key, rec); err != nil {
			s.log.Warn("caching a tag list", "upstream", name, "repo", rt.repo, "err", err)
		}
		return rec, nil
	})
	if err == nil {
		return v.(storage.TagListRecord), sourceUpstream, nil
	}
	if cached && !errors.Is(err, upstream.ErrNotFound) && ctx.Err() == nil {
		s.metrics.stale.WithLabelValues(name, "tag_list").Inc()
		s.log.Warn("upstream failed to list tags: serving the cached list", "upstream", name, "repo", rt.repo,
			"age", time.Since(rec.CheckedAt).Round(time.Second), "err", err)
		return rec, sourceCache, nil
	}
	return storage.TagListRecord{}, "", err
}

// pageOf cuts the page n (0: all) after last out of a whole tag list,
// in the order the list gives.
func pageOf(whole storage.TagListRecord, n int, last string) storage.TagListRecord {
	tags := whole.Tags
	if last != "" {
		if i := slices.Index(tags, last); i >= 0 {
			tags = tags[i+1:]
		} else {
			tags = slices.DeleteFunc(slices.Clone(tags), func(t string) bool { return t <= last })
		}
	}
	page := storage.TagListRecord{Tags: tags, CheckedAt: whole.CheckedAt}
	if n > 0 && len(tags) > n {
		page.Tags = tags[:n]
		page.Next = url.Values{"n": {strconv.Itoa(n)}, "last": {tags[n-1]}}.Encode()
	}
	return page
}

// maxCatalogPage bounds a catalog page when the client gives no n.
const maxCatalogPage = 1000

// serveCatalog answers GET /v2/_catalog: the repositories the store knows,
// as "<upstream>/<repo>" (what an air-gapped site holds), n at a time
// after last, with a Link to the next page. Repositories of upstreams the
// client may not pull from are left out.
func (s *Server) serveCatalog(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	n := maxCatalogPage
	if v := q.Get("n"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 0 {
			s.writeError(w, r, &ociError{status: http.StatusBadRequest, code: "PAGINATION_NUMBER_INVALID",
				message: fmt.Sprintf("n=%q: want a number of repositories", v)})
			return
		}
	}
	all, err := s.tags.Repositories(r.Context())
	if err != nil {
		s.writeError(w, r, toOCI(err, "catalog"))
		return
	}
	last := q.Get("last")
	repos := make([]string, 0, min(n, len(all)))
	more := false
	for _, repo := range all {
		if repo <= last || !s.catalogVisible(repo, r.RemoteAddr) {
			continue
		}
		if len(repos) == n {
			more = true
			break
		}
		repos = append(repos, repo)
	}
	if more && len(repos) > 0 {
		next := url.Values{"n": {strconv.Itoa(n)}, "last": {repos[len(repos)-1]}}
		w.Header().Set("Link", `</v2/_catalog?`+next.Encode()+`>; rel="next"`)
	}
	body, _ := json.Marshal(struct {
		Repositories []string `json:"repositories"`
	}{repos})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		w.Write(body)
	}
}

// catalogVisible reports whether a client at remote may see repo
// ("<upstream>/<repo>") in the catalog: whether it may pull from its
// upstream.
func (s *Server) catalogVisible(repo, remote string) bool {
	if len(s.upstreamClients) == 0 {
		return true
	}
	name, _, _ := strings.Cut(repo, "/")
	l, ok := s.upstreamClients[upstream.CanonicalName(name)]
	return !ok || l.allows(remote)
}
