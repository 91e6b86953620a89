package main

import (
	"bytes"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

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

// TestForgetHandler: POST /forget (through pullproxy forget) ends, on every
// upstream, each endpoint's wait for the digest, and says which it ended;
// other digests keep theirs; a digest with none is answered so; a request
// that is not JSON, or names no digest, is refused.
func TestForgetHandler(t *testing.T) {
	t.Parallel()
	one := newForgetUpstream(t, "one.test", "https://a.one.test", "https://b.one.test")
	two := newForgetUpstream(t, "two.test", "https://a.two.test")
	bad, other := digest.FromString("pushed again"), digest.FromString("still corrupt")
	cause := errors.New("the bytes received hash to sha256:0000")
	one.ReportCorrupt(bad, one.Endpoints()[1], cause)
	two.ReportCorrupt(bad, two.Endpoints()[0], cause)
	one.ReportCorrupt(other, one.Endpoints()[0], cause)
	srv := httptest.NewServer(forgetHandler([]*upstream.Registry{one, two}, slog.New(slog.DiscardHandler)))
	t.Cleanup(srv.Close)
	// A TCP admin endpoint's client sends the token from its file.
	token := filepath.Join(t.TempDir(), "admin.token")
	if err := os.WriteFile(token, []byte("t0ken"), 0o600); err != nil {
		t.Fatal(err)
	}

	var out, errOut bytes.Buffer
	if err := forget(t.Context(), []string{"--server", srv.URL, "--admin-token-file", token, bad.String()}, &out, &errOut); err != nil {
		t.Fatalf("pullproxy forget: %v\n%s", err, errOut.String())
	}
	for _, want := range []string{"one.test " + one.Endpoints()[1], "two.test " + two.Endpoints()[0]} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("pullproxy forget said %q, want it to name %s", out.String(), want)
		}
	}
	if st := two.Status().Corrupt; len(st) != 0 {
		t.Errorf("two.test after forget: got %+v, want no corrupt blob", st)
	}
	if st := one.Status().Corrupt; len(st) != 1 || st[0].Digest != other {
		t.Errorf("one.test after forget: got %+v, want %s's entry only", st, other)
	}

	out.Reset()
	if err := forget(t.Context(), []string{"--server", srv.URL, "--admin-token-file", token, bad.String()}, &out, &errOut); err != nil ||
		!strings.Contains(out.String(), "nothing to forget") {
		t.Errorf("forgetting again: got %v, %q; want nothing to forget", err, out.String())
	}
	if err := forget(t.Context(), []string{"--server", srv.URL, "--admin-token-file", token, "latest"}, &out, &errOut); err == nil {
		t.Error("forget latest: got no error, want one saying it is not a digest")
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

// TestCorruptShownWithFix: status and doctor show each blob served corrupt,
// its endpoint, when it is asked again, and the fix naming pullproxy
// forget; doctor fails the walk when the image needs the blob.
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

	d := &doctorRun{imageBlobs: map[digest.Digest]bool{needed: true}}
	d.corrupt(entries, now)
	if len(d.steps) != 2 {
		t.Fatalf("doctor steps: got %+v, want 2", d.steps)
	}
	for i, want := range []string{"fail", "warn"} {
		s := d.steps[i]
		if s.Verdict != want || s.Where != "upstream" || !strings.Contains(s.Fix, "pullproxy forget "+entries[i].Digest.String()) {
			t.Errorf("doctor step %d: got %+v, want %s, upstream, the fix naming pullproxy forget", i, s, want)
		}
	}
}
