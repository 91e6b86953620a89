package upstream

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
)

// TestStatus: an endpoint's live state shows the chunks of a fetch across
// cuts, where the sessions were cut, what was received, and, once it is
// left aside, until when and why.
func TestStatus(t *testing.T) {
	t.Parallel()
	blob := randomBlob(3500)
	s := &rangeServer{blob: blob, cutAfter: 1000}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	r := newFetchRegistry(t, FetchConfig{ParallelChunks: 1}, []string{srv.URL})
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), newMemBlobWriter(-1)); err != nil {
		t.Fatal(err)
	}
	st := r.Status()
	if len(st.Endpoints) != 1 {
		t.Fatalf("endpoints: %+v", st.Endpoints)
	}
	e := st.Endpoints[0]
	// A cut point counts what the session carried, its headers too.
	if !e.Up || e.RecentChunks != 4 || e.ReceivedBytes < int64(len(blob)) ||
		len(e.CutPoints) != 3 || e.CutPoints[0] < 1000 || e.CutPoints[2] > 2000 || e.BudgetBytes <= 0 || e.ConnectionsLimit <= 0 {
		t.Errorf("after a fetch cut three times: %+v", e)
	}
	if strings.Contains(e.URL, "@") {
		t.Errorf("the URL shows credentials: %s", e.URL)
	}
	r.endpoints[0].markFailed(r, errors.New("dial tcp: connection refused"))
	e = r.Status().Endpoints[0]
	if e.Up || e.DownUntil.IsZero() || e.Failures != 1 || e.LastError != "dial tcp: connection refused" || e.LastErrAt.IsZero() {
		t.Errorf("after a failure: %+v", e)
	}
}

// TestCompleteWriterRefused: a writer that holds every byte already (a
// download resumed after a crash in its commit) does not make a blob the
// upstream refuses for this repository a fetched one.
func TestCompleteWriterRefused(t *testing.T) {
	t.Parallel()
	blob := randomBlob(1000)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v2/" {
			return
		}
		http.Error(w, `{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown"}]}`, http.StatusNotFound)
	}))
	t.Cleanup(srv.Close)
	r := newTestRegistry(t, srv.URL)
	w := newPrefilled(t, int64(len(blob)), blob, len(blob))
	if _, err := r.FetchBlob(t.Context(), "other/repo", digest.FromBytes(blob), w); !errors.Is(err, ErrNotFound) {
		t.Errorf("a complete writer, the upstream refusing: err %v, want ErrNotFound", err)
	}
}
