package proxy

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pullproxy/pullproxy/storage"
)

type tagList struct {
	Name string   `json:"name"`
	Tags []string `json:"tags"`
}

func (e *env) tags(path string) (*http.Response, tagList) {
	e.t.Helper()
	resp, body := e.get(http.MethodGet, path, nil)
	var l tagList
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(body, &l); err != nil {
			e.t.Fatalf("%s: %q is no tag list: %v", path, body, err)
		}
	}
	return resp, l
}

// TestTagList: GET /v2/<name>/tags/list answers the upstream's tags, page
// by page with n, last and Link, from the store while fresh, and from the
// store when the upstream fails.
func TestTagList(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithTagTTL(time.Hour))
	for _, tag := range []string{"v1", "v2", "v3"} {
		e.push("test/app", tag, 100, 1)
	}
	ns := "?ns=" + upstreamName
	resp, l := e.tags("/v2/test/app/tags/list" + ns)
	if resp.StatusCode != http.StatusOK || l.Name != "test/app" || strings.Join(l.Tags, ",") != "v1,v2,v3" {
		t.Fatalf("whole list: %d %+v", resp.StatusCode, l)
	}
	resp, l = e.tags("/v2/test/app/tags/list" + ns + "&n=2")
	link := resp.Header.Get("Link")
	if strings.Join(l.Tags, ",") != "v1,v2" || !strings.HasSuffix(link, `; rel="next"`) || !strings.Contains(link, "ns="+upstreamName) {
		t.Fatalf("first page: %+v, Link %q", l, link)
	}
	next := strings.TrimSuffix(strings.TrimPrefix(link, "<"), `>; rel="next"`)
	resp, l = e.tags(next)
	if strings.Join(l.Tags, ",") != "v3" || resp.Header.Get("Link") != "" {
		t.Fatalf("next page %s: %+v, Link %q", next, l, resp.Header.Get("Link"))
	}

	asked := e.counter.count("GET list")
	e.tags("/v2/test/app/tags/list" + ns)
	if got := e.counter.count("GET list"); got != asked {
		t.Errorf("a fresh list asked the upstream again: %d requests, want %d", got, asked)
	}
	e.counter.down.Store(true)
	e.stop()
	e.start(e.upstream.URL, WithTagTTL(0)) // every list due for revalidation
	if resp, l := e.tags("/v2/test/app/tags/list" + ns); resp.StatusCode != http.StatusOK || len(l.Tags) != 3 {
		t.Errorf("upstream down: %d %+v, want the cached list", resp.StatusCode, l)
	}
	e.counter.down.Store(false)
	if resp, body := e.get(http.MethodGet, "/v2/test/nope/tags/list"+ns, nil); resp.StatusCode != http.StatusNotFound ||
		!strings.Contains(string(body), "NAME_UNKNOWN") {
		t.Errorf("unknown repository: %d %s, want 404 NAME_UNKNOWN", resp.StatusCode, body)
	}
	if resp, _ := e.get(http.MethodGet, "/v2/test/app/tags/list"+ns+"&n=many", nil); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("n=many: %d, want 400", resp.StatusCode)
	}
}

// TestCatalog: /v2/_catalog lists the repositories the store holds, as
// <upstream>/<repo>, page by page.
func TestCatalog(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ns := "?ns=" + upstreamName
	for _, repo := range []string{"test/other", "test/app"} {
		e.push(repo, "v1", 100, 1)
		if resp, _ := e.get(http.MethodGet, "/v2/"+repo+"/manifests/v1"+ns, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d", repo, resp.StatusCode)
		}
	}
	type catalog struct{ Repositories []string }
	get := func(path string) (*http.Response, catalog) {
		resp, body := e.get(http.MethodGet, path, nil)
		var c catalog
		if err := json.Unmarshal(body, &c); err != nil {
			t.Fatalf("%s: %q: %v", path, body, err)
		}
		return resp, c
	}
	want := []string{upstreamName + "/test/app", upstreamName + "/test/other"}
	if _, c := get("/v2/_catalog"); strings.Join(c.Repositories, " ") != strings.Join(want, " ") {
		t.Errorf("catalog: %v, want %v", c.Repositories, want)
	}
	resp, c := get("/v2/_catalog?n=1")
	link := resp.Header.Get("Link")
	if strings.Join(c.Repositories, " ") != want[0] || link == "" {
		t.Fatalf("first page: %v, Link %q", c.Repositories, link)
	}
	resp, c = get(strings.TrimSuffix(strings.TrimPrefix(link, "<"), `>; rel="next"`))
	if strings.Join(c.Repositories, " ") != want[1] || resp.Header.Get("Link") != "" {
		t.Errorf("second page: %v, Link %q", c.Repositories, resp.Header.Get("Link"))
	}
}

func TestPageOf(t *testing.T) {
	t.Parallel()
	whole := storage.TagListRecord{Tags: []string{"1.0", "1.1", "2.0", "latest"}}
	for _, tt := range []struct {
		n          int
		last, want string
		next       string
	}{
		{0, "", "1.0,1.1,2.0,latest", ""},
		{2, "", "1.0,1.1", "last=1.1&n=2"},
		{2, "1.1", "2.0,latest", ""},
		{3, "1.05", "1.1,2.0,latest", ""}, // a last not in the list: what sorts after it
		{1, "latest", "", ""},
	} {
		got := pageOf(whole, tt.n, tt.last)
		if strings.Join(got.Tags, ",") != tt.want || got.Next != tt.next {
			t.Errorf("pageOf(n=%d, last=%q) = %v next %q; want %s next %q", tt.n, tt.last, got.Tags, got.Next, tt.want, tt.next)
		}
	}
}

// unpagedTags answers every tag list with the whole list, unsorted, as
// distribution 2.8 does whatever n and last ask.
type unpagedTags struct{ tags []string }

func (u unpagedTags) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(tagList{Name: "test/app", Tags: u.tags})
}

// TestTagListOfAnUpstreamIgnoringLast: the page after last is cut by
// pullproxy, in lexical order, when the upstream sends the whole list.
func TestTagListOfAnUpstreamIgnoringLast(t *testing.T) {
	t.Parallel()
	e := newEnvRegistry(t, unpagedTags{tags: []string{"v1", "latest", "sha256-ab", "multi"}})
	for _, tc := range []struct {
		query string
		want  []string
		link  bool
	}{
		{"", []string{"v1", "latest", "sha256-ab", "multi"}, false}, // as the upstream sent it
		{"&last=multi", []string{"sha256-ab", "v1"}, false},
		{"&last=latest&n=2", []string{"multi", "sha256-ab"}, true},
	} {
		resp, l := e.tags("/v2/test/app/tags/list?ns=" + upstreamName + tc.query)
		if resp.StatusCode != http.StatusOK || strings.Join(l.Tags, ",") != strings.Join(tc.want, ",") ||
			(resp.Header.Get("Link") != "") != tc.link {
			t.Errorf("%q: %s %v, Link %q; want %v", tc.query, resp.Status, l.Tags, resp.Header.Get("Link"), tc.want)
		}
	}
}
