package upstream

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/opencontainers/go-digest"
)

func TestNextQuery(t *testing.T) {
	t.Parallel()
	const path = "/v2/a/referrers/sha256:ab"
	for _, tt := range []struct{ link, want string }{
		{`</v2/a/referrers/sha256:ab?next_token=xyz&n=2>; rel="next"`, "next_token=xyz&n=2"},
		{`<https://r.example.com/v2/a/referrers/sha256:ab?p=2>; rel=next`, "p=2"},
		{`</v2/b/referrers/sha256:ab?p=2>; rel="next"`, ""}, // another path: not followed
		{`</v2/a/referrers/sha256:ab?p=2>; rel="prev"`, ""},
		{"", ""},
	} {
		if got := nextQuery(tt.link, path); got != tt.want {
			t.Errorf("nextQuery(%q) = %q, want %q", tt.link, got, tt.want)
		}
	}
}

// TestReferrers: pages are followed and merged, descriptors kept as the
// upstream wrote them; an upstream without the API is ErrNotFound.
func TestReferrers(t *testing.T) {
	t.Parallel()
	subject := digest.FromString("subject")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v2/":
			return
		case "/v2/paged/referrers/" + subject.String():
			page := r.URL.Query().Get("page")
			if page == "" {
				w.Header().Set("Link", fmt.Sprintf(`</v2/paged/referrers/%s?page=2>; rel="next"`, subject))
			}
			w.Header().Set("Content-Type", "application/vnd.oci.image.index.v1+json")
			fmt.Fprintf(w, `{"schemaVersion":2,"manifests":[{"digest":"%s","size":1,"artifactType":"t%s","x-extra":true}]}`,
				digest.FromString("ref"+page), page)
		case "/v2/broken/referrers/" + subject.String():
			fmt.Fprint(w, `<html>`)
		default:
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, `{"errors":[{"code":"UNSUPPORTED","message":"no referrers"}]}`)
		}
	}))
	t.Cleanup(srv.Close)
	r := newTestRegistry(t, srv.URL)

	got, err := r.Referrers(t.Context(), "paged", subject)
	if err != nil || len(got) != 2 {
		t.Fatalf("paged: %d descriptors, err %v; want 2", len(got), err)
	}
	var second map[string]any
	if err := json.Unmarshal(got[1], &second); err != nil || second["artifactType"] != "t2" || second["x-extra"] != true {
		t.Errorf("second page's descriptor: %s", got[1])
	}
	if _, err := r.Referrers(t.Context(), "other", subject); !errors.Is(err, ErrNotFound) {
		t.Errorf("no referrers API: err %v, want ErrNotFound", err)
	}
	if _, err := r.Referrers(t.Context(), "broken", subject); !errors.Is(err, ErrInvalid) {
		t.Errorf("not an index: err %v, want ErrInvalid", err)
	}
}
