package proxy

import (
	"cmp"
	"context"
	"errors"
	"net/http"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// holdingUpstream is an upstream that answers HEAD of a blob only: it
// holds d in the repositories of has, and counts the HEADs it is asked.
type holdingUpstream struct {
	Upstream // nil: any other call is a test failure, as a panic
	name     string
	d        digest.Digest
	has      map[string]bool
	heads    atomic.Int64
}

func (u *holdingUpstream) Name() string { return u.name }

func (u *holdingUpstream) HeadBlob(ctx context.Context, repo string, d digest.Digest) (int64, error) {
	u.heads.Add(1)
	if d == u.d && u.has[repo] {
		return 5, nil
	}
	return 0, &upstream.Error{Upstream: u.name, Op: "HEAD " + repo + "/" + d.String(), Status: http.StatusNotFound, Kind: upstream.ErrNotFound}
}

// policyServer is a Server with one blob stored, recorded under test/app of
// registry.test and of offline.test; registry.test holds it in test/copy
// too, and lets only 10.0.0.0/8 pull from it.
func policyServer(t testing.TB) (*Server, *holdingUpstream, digest.Digest) {
	t.Helper()
	ctx := t.Context()
	st, err := storage.Open(ctx, t.TempDir(), storage.WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	content := []byte("a stored layer")
	d := digest.FromBytes(content)
	if err := st.PutBlob(ctx, d, content); err != nil {
		t.Fatal(err)
	}
	for _, up := range []string{upstreamName, "offline.test"} {
		if err := st.AddMembers(ctx, up, "test/app", d); err != nil {
			t.Fatal(err)
		}
	}
	up := &holdingUpstream{name: upstreamName, d: d, has: map[string]bool{"test/app": true, "test/copy": true}}
	s, err := New(WithStore(st), WithUpstream(up), WithUpstream(Offline("offline.test")), WithLogger(testLog(t)),
		WithUpstreamAllowedClients(upstreamName, []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, up, d
}

// TestStoredBlobAllowed: the one policy both servers of a blob follow,
// case by case, in order (a confirmation is remembered for the next).
func TestStoredBlobAllowed(t *testing.T) {
	t.Parallel()
	s, up, stored := policyServer(t)
	missing := digest.FromString("not stored")
	const allowed, denied = "10.1.2.3:5000", "192.0.2.7:41000"
	tests := []struct {
		name     string
		upstream string
		repo     string
		d        digest.Digest
		openErr  error // instead of opening d in the store
		remote   string
		head     bool
		confirm  bool
		want     blobVerdict
		status   int    // of the refusal
		has      string // in the refusal's message
		heads    int64  // upstream HEADs it takes
	}{
		{name: "stored, recorded", repo: "test/app", d: stored, remote: allowed, want: blobServe},
		{name: "stored, recorded, HEAD", repo: "test/app", d: stored, remote: allowed, head: true, want: blobServe},
		{name: "stored, recorded, on the loop", repo: "test/app", d: stored, remote: allowed, want: blobServe},
		{name: "not stored", repo: "test/app", d: missing, remote: allowed, confirm: true, want: blobMissing},
		{name: "not stored, HEAD", repo: "test/app", d: missing, remote: allowed, head: true, confirm: true, want: blobMissing},
		{name: "the store cannot say", repo: "test/app", d: stored, openErr: errors.New("disk on fire"), remote: allowed,
			confirm: true, want: blobRefused, status: http.StatusInternalServerError, has: "disk on fire"},
		{name: "another repository, on the loop", repo: "test/copy", d: stored, remote: allowed, want: blobUnconfirmed},
		{name: "another repository that holds it", repo: "test/copy", d: stored, remote: allowed, confirm: true,
			want: blobServe, heads: 1},
		{name: "that repository again, on the loop", repo: "test/copy", d: stored, remote: allowed, want: blobServe},
		{name: "another repository without it", repo: "test/other", d: stored, remote: allowed, confirm: true,
			want: blobRefused, status: http.StatusNotFound, has: "BLOB_UNKNOWN", heads: 1},
		{name: "that refusal again", repo: "test/other", d: stored, remote: allowed, confirm: true,
			want: blobRefused, status: http.StatusNotFound, has: "BLOB_UNKNOWN"},
		{name: "client denied", repo: "test/app", d: stored, remote: denied, confirm: true,
			want: blobRefused, status: http.StatusForbidden, has: "allow_clients"},
		{name: "client denied, not stored", repo: "test/app", d: missing, remote: denied, confirm: true,
			want: blobRefused, status: http.StatusForbidden, has: "allow_clients"},
		{name: "offline, stored, recorded", upstream: "offline.test", repo: "test/app", d: stored, remote: denied,
			want: blobServe},
		{name: "offline, another repository", upstream: "offline.test", repo: "test/copy", d: stored, remote: denied,
			confirm: true, want: blobRefused, status: http.StatusNotFound, has: "offline"},
		{name: "offline, not stored", upstream: "offline.test", repo: "test/app", d: missing, remote: denied,
			confirm: true, want: blobRefused, status: http.StatusNotFound, has: "offline"},
		{name: "offline, not stored, HEAD", upstream: "offline.test", repo: "test/app", d: missing, remote: denied,
			head: true, confirm: true, want: blobMissing},
	}
	for _, tc := range tests {
		rt, err := s.routeFor(cmp.Or(tc.upstream, upstreamName), tc.repo, kindBlob, tc.d.String())
		if err != nil {
			t.Fatal(err)
		}
		openErr := tc.openErr
		if openErr == nil {
			f, _, err := s.blobs.OpenBlob(t.Context(), tc.d)
			if err == nil {
				f.Close()
			}
			openErr = err
		}
		s.accesses.take()
		heads := up.heads.Load()
		got, err := s.storedBlobAllowed(t.Context(), rt, tc.remote, tc.head, openErr, tc.confirm)
		if got != tc.want {
			t.Errorf("%s: got verdict %d (%v), want %d", tc.name, got, err, tc.want)
		}
		if n := up.heads.Load() - heads; n != tc.heads {
			t.Errorf("%s: got %d upstream HEADs, want %d", tc.name, n, tc.heads)
		}
		_, noted := s.accesses.take()[tc.d]
		if noted != (got == blobServe) {
			t.Errorf("%s: noted as accessed %v, want %v", tc.name, noted, got == blobServe)
		}
		if tc.want != blobRefused {
			if err != nil {
				t.Errorf("%s: got error %v, want none", tc.name, err)
			}
			continue
		}
		oe := toOCI(err, kindBlob)
		if oe.status != tc.status || !strings.Contains(oe.code+" "+oe.message, tc.has) {
			t.Errorf("%s: got %d %s %q, want %d and %q", tc.name, oe.status, oe.code, oe.message, tc.status, tc.has)
		}
	}
}

// BenchmarkStoredBlobAllowed measures the policy's answer for the common
// case, a stored blob recorded under the repository asked, on the blob
// loop: it is to take no allocation.
func BenchmarkStoredBlobAllowed(b *testing.B) {
	s, _, d := policyServer(b)
	rt, err := s.routeFor(upstreamName, "test/app", kindBlob, d.String())
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if v, _ := s.storedBlobAllowed(ctx, rt, "10.1.2.3:5000", false, nil, false); v != blobServe {
			b.Fatalf("got verdict %d, want blobServe", v)
		}
	}
}
