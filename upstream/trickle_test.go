package upstream

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// trickler answers a blob's ranges a byte at a time, every interval: never
// silent long enough to stall.
type trickler struct {
	size     int
	interval time.Duration
}

func (s trickler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodHead {
		w.Header().Set("Content-Length", strconv.Itoa(s.size))
		return
	}
	start, end := 0, s.size-1
	if rng, ok := strings.CutPrefix(r.Header.Get("Range"), "bytes="); ok {
		a, b, _ := strings.Cut(rng, "-")
		start, _ = strconv.Atoi(a)
		if b != "" {
			end, _ = strconv.Atoi(b)
		}
	}
	w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end, s.size))
	w.Header().Set("Content-Length", strconv.Itoa(end-start+1))
	w.WriteHeader(http.StatusPartialContent)
	for i := start; i <= end; i++ {
		if _, err := w.Write([]byte{'x'}); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		select {
		case <-time.After(s.interval):
		case <-r.Context().Done():
			return
		}
	}
}

// TestTrickleIsGivenUp: an upstream that sends a byte every 20 ms, never
// silent for the stall timeout, is abandoned for its slowness, chunk after
// chunk, and given up after MaxAttempts of them, instead of holding the
// download and its connections for as long as it trickles.
func TestTrickleIsGivenUp(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(trickler{size: 4 << 20, interval: 20 * time.Millisecond})
	t.Cleanup(srv.Close)
	tr := NewTransport()
	t.Cleanup(tr.CloseIdleConnections)
	r, err := New(testUpstream, []string{srv.URL}, WithTransport(tr), WithLogger(discardLogger),
		WithFetchConfig(FetchConfig{StallTimeout: 100 * time.Millisecond, MaxAttempts: 3, MinGoodput: 64 << 10}))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = r.FetchBlob(t.Context(), "org/app", digest.FromString("never arrives"), newMemBlobWriter(4<<20))
	if !errors.Is(err, errTooSlow) || !strings.Contains(err.Error(), "too slow") {
		t.Fatalf("got %v, want the endpoint given up as too slow", err)
	}
	t.Logf("given up after %v: %v", time.Since(start).Round(time.Millisecond), err)
}
