package upstream

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// TestFetchBlobOverTLS: chunks over TLS, from a server trusted through
// WithTLSConfig's roots alone: HTTP/1.1, one request per connection,
// sessions resumed after the first handshake, and connections opened ahead
// of need taken by the next chunk.
func TestFetchBlobOverTLS(t *testing.T) {
	t.Parallel()
	const (
		size   = 1 << 20
		budget = 64 << 10
	)
	blob := randomBlob(size)
	s := &rangeServer{blob: blob}
	var mu sync.Mutex
	requests := map[net.Conn]int{}
	resumed, handshakes := 0, 0
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Proto != "HTTP/1.1" {
			t.Errorf("protocol: got %v, want HTTP/1.1", r.Proto)
		}
		s.ServeHTTP(w, r)
	}))
	srv.EnableHTTP2 = true
	srv.Config.ConnState = func(c net.Conn, st http.ConnState) {
		mu.Lock()
		defer mu.Unlock()
		if st == http.StateActive {
			if requests[c]++; requests[c] == 1 {
				handshakes++
				if c.(*tls.Conn).ConnectionState().DidResume {
					resumed++
				}
			}
		}
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)

	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	cfg := fixedBudget(budget, 1)
	r := newFetchRegistry(t, cfg, []string{srv.URL}, WithTLSConfig(&tls.Config{RootCAs: pool}))
	w := newMemBlobWriter(-1)
	if _, err := r.FetchBlob(t.Context(), "org/app", digest.FromBytes(blob), w); err != nil {
		t.Fatalf("got %v, want no error", err)
	}
	checkBlob(t, w, blob)

	mu.Lock()
	defer mu.Unlock()
	for _, n := range requests {
		if n > 1 {
			t.Errorf("a connection carried %d requests, want 1", n)
		}
	}
	if chunks := size / budget; resumed < chunks/2 {
		t.Errorf("resumed TLS sessions: got %d of %d connections, want at least %d", resumed, handshakes, chunks/2)
	}
	if got := r.dialer.warmTaken.Load(); got == 0 {
		t.Errorf("chunks sent on a connection opened ahead: got none, want some")
	}
}

// TestSetupTimesKeepsTheLeast: the path's length is the least set-up time
// seen lately; longer ones (a busy path, a burst) leave it, and it is
// forgotten after setupMemory.
func TestSetupTimesKeepsTheLeast(t *testing.T) {
	t.Parallel()
	start := time.Now()
	var s setupTimes
	steps := []struct {
		after, took, want time.Duration
	}{
		{0, 5 * time.Millisecond, 5 * time.Millisecond},
		{time.Second, 40 * time.Millisecond, 5 * time.Millisecond},
		{2 * time.Second, 3 * time.Millisecond, 3 * time.Millisecond},
		{setupMemory, 30 * time.Millisecond, 3 * time.Millisecond},
		{setupMemory + 3*time.Second, 30 * time.Millisecond, 30 * time.Millisecond},
	}
	for _, st := range steps {
		s.add(st.took, start.Add(st.after))
		if s.least != st.want {
			t.Errorf("a set-up of %v at %v: least %v, want %v", st.took, st.after, s.least, st.want)
		}
	}
}

// TestMetadataRequestsTellThePath: the metadata client's requests are what
// the chunk pipe knows of the path before its first chunk (see
// pipe.startShortLocked): the time from a request's sending to its
// answer's first byte, which a slow answer lengthens though its connect
// is quick, as a path behind a middlebox that answers the connect itself.
func TestMetadataRequestsTellThePath(t *testing.T) {
	t.Parallel()
	const answerAfter = 30 * time.Millisecond
	manifest := []byte(`{"schemaVersion":2}`)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(answerAfter)
		w.Header().Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
		w.Write(manifest)
	})
	for _, secure := range []bool{false, true} {
		name := map[bool]string{false: "http", true: "https"}[secure]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewUnstartedServer(handler)
			var opts []Option
			if secure {
				srv.StartTLS()
				pool := x509.NewCertPool()
				pool.AddCert(srv.Certificate())
				opts = append(opts, WithTLSConfig(&tls.Config{RootCAs: pool}))
			} else {
				srv.Start()
			}
			t.Cleanup(srv.Close)
			r := newFetchRegistry(t, FetchConfig{}, []string{srv.URL}, opts...)
			ep := r.endpoints[0]
			if got := ep.pipe.pathRoundTrip(); got != 0 {
				t.Fatalf("round trip known before any request: %v", got)
			}
			if _, _, err := r.GetManifest(t.Context(), "org/app", "latest", nil); err != nil {
				t.Fatalf("GetManifest: %v", err)
			}
			if got := ep.pipe.pathRoundTrip(); got < answerAfter {
				t.Errorf("round trip after a manifest answered in %v: got %v, want at least that", answerAfter, got)
			}
			r.dialer.mu.Lock()
			setup := r.dialer.recent.least(ep.key)
			r.dialer.mu.Unlock()
			if got := setup; got <= 0 {
				t.Errorf("set-up after a manifest: got %v, want it known", got)
			}
		})
	}
}
