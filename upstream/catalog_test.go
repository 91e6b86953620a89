package upstream

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
)

// TestListRepositories: a catalog page, its next page from the Link
// header, or after a full page without one; a body that is not JSON is
// the upstream's fault.
func TestListRepositories(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		n         int
		body      string
		link      string
		wantRepos []string
		wantLast  string
		wantErr   error
	}{
		{name: "a page and a Link", n: 2, body: `{"repositories":["a","b"]}`, link: `</v2/_catalog?last=b&n=2>; rel="next"`,
			wantRepos: []string{"a", "b"}, wantLast: "b"},
		{name: "a full page without a Link", n: 2, body: `{"repositories":["a","b"]}`, wantRepos: []string{"a", "b"}, wantLast: "b"},
		{name: "the last page", n: 2, body: `{"repositories":["c"]}`, wantRepos: []string{"c"}},
		{name: "not JSON", body: `<html>`, wantErr: ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/v2/_catalog" {
					http.NotFound(w, r)
					return
				}
				if tt.link != "" {
					w.Header().Set("Link", tt.link)
				}
				w.Write([]byte(tt.body))
			}))
			defer srv.Close()
			r, err := New("reg.test", []string{srv.URL})
			if err != nil {
				t.Fatal(err)
			}
			page, err := r.ListRepositories(t.Context(), tt.n, "")
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("error: got %v, want %v", err, tt.wantErr)
			}
			if !slices.Equal(page.Repositories, tt.wantRepos) || page.Next.Get("last") != tt.wantLast {
				t.Errorf("got %v next %q, want %v next %q", page.Repositories, page.Next.Get("last"), tt.wantRepos, tt.wantLast)
			}
		})
	}
}
