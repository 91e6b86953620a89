package admin

import (
	"bytes"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/upstream"
)

func newForgetUpstream(t *testing.T, name string, endpoints ...string) *upstream.Registry {
	t.Helper()
	r, err := upstream.New(name, endpoints, upstream.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestForgetHandler: POST /forget ends, on every
// upstream, each endpoint's wait for the digest, and says which it ended;
// other digests keep theirs; a digest with none is answered so; a request
// that is not JSON, or names no digest, is refused.
func TestForgetHandler(t *testing.T) {
	t.Parallel()
	one := newForgetUpstream(t, "one.test", "https://a.one.test", "https://b.one.test")
	two := newForgetUpstream(t, "two.test", "https://a.two.test")
	bad, other := digest.FromString("pushed again"), digest.FromString("still corrupt")
	cause := errors.New("the bytes received hash to sha256:0000")
	one.ReportCorrupt(bad, upstream.FetchReport{Sources: []upstream.SourceShare{{Endpoint: one.Endpoints()[1]}}}, cause)
	two.ReportCorrupt(bad, upstream.FetchReport{Sources: []upstream.SourceShare{{Endpoint: two.Endpoints()[0]}}}, cause)
	one.ReportCorrupt(other, upstream.FetchReport{Sources: []upstream.SourceShare{{Endpoint: one.Endpoints()[0]}}}, cause)
	srv := httptest.NewServer(forgetHandler([]*upstream.Registry{one, two}, slog.New(slog.DiscardHandler)))
	t.Cleanup(srv.Close)
	// A TCP admin endpoint's client sends the token from its file.
	token := filepath.Join(t.TempDir(), "admin.token")
	if err := os.WriteFile(token, []byte("t0ken"), 0o600); err != nil {
		t.Fatal(err)
	}

	target, err := (&Flags{Server: srv.URL, TokenFile: token}).Target(config.File{})
	if err != nil {
		t.Fatal(err)
	}
	ans, err := Forget(t.Context(), target, bad.String())
	if err != nil {
		t.Fatalf("forget: %v", err)
	}
	var cleared []string
	for _, c := range ans.Cleared {
		cleared = append(cleared, c.Upstream+" "+c.Endpoint)
	}
	if want := []string{"one.test " + one.Endpoints()[1], "two.test " + two.Endpoints()[0]}; ans.Digest != bad || !slices.Equal(cleared, want) {
		t.Errorf("forget answered %s %v, want %s %v", ans.Digest, cleared, bad, want)
	}
	if st := two.Status().Corrupt; len(st) != 0 {
		t.Errorf("two.test after forget: got %+v, want no corrupt blob", st)
	}
	if st := one.Status().Corrupt; len(st) != 1 || st[0].Digest != other {
		t.Errorf("one.test after forget: got %+v, want %s's entry only", st, other)
	}

	if ans, err := Forget(t.Context(), target, bad.String()); err != nil || len(ans.Cleared) != 0 {
		t.Errorf("forgetting again: got %+v, %v; want nothing forgotten", ans, err)
	}
	if _, err := Forget(t.Context(), target, "latest"); !errors.Is(err, ErrRefused) {
		t.Errorf("forget latest: got %v, want it refused", err)
	}

	for _, tc := range []struct {
		contentType, body string
		want              int
	}{
		{"text/plain", `{"digest":"` + other.String() + `"}`, http.StatusUnsupportedMediaType},
		{"application/json", `{"digest":"latest"}`, http.StatusBadRequest},
		{"application/json", `not json`, http.StatusBadRequest},
	} {
		resp, err := http.Post(srv.URL, tc.contentType, strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("POST %s %s: got %s, want %d", tc.contentType, tc.body, resp.Status, tc.want)
		}
	}
	if st := one.Status().Corrupt; len(st) != 1 {
		t.Errorf("one.test after refused requests: got %+v, want %s's entry kept", st, other)
	}
}

// TestCorruptShownWithFix: status shows each blob served corrupt, its
// endpoint, when it is asked again, and the fix naming pullproxy forget.
func TestCorruptShownWithFix(t *testing.T) {
	t.Parallel()
	now := time.Now()
	needed, unrelated := digest.FromString("a layer of the image"), digest.FromString("another image's")
	entries := []upstream.CorruptStatus{
		{Digest: needed, Endpoint: "https://a.test", Failures: 2, Since: now.Add(-time.Minute), RetryAt: now.Add(2 * time.Minute), LastError: "hash to sha256:0000"},
		{Digest: unrelated, Endpoint: "https://a.test", Failures: 1, Since: now.Add(-5 * time.Minute), RetryAt: now.Add(-4 * time.Minute)},
	}
	var out bytes.Buffer
	printCorrupt(&out, entries, now)
	for _, want := range []string{needed.String(), "https://a.test", "2 time(s)", "hash to sha256:0000",
		"pullproxy forget " + needed.String(), "at the next pull"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status: got\n%s\nwant it to say %q", out.String(), want)
		}
	}
}
