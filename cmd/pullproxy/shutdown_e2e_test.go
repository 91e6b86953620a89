package main

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// stallingBlob serves the bytes of one blob below dark, and nothing at or
// past it: a response reaching it stalls until the client hangs up, as on a
// path that has gone dark.
type stallingBlob struct {
	content []byte
	dark    int64
}

func (s *stallingBlob) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Docker-Content-Digest", digest.FromBytes(s.content).String())
	if r.Method == http.MethodHead {
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(s.content))
		return
	}
	first, _, _ := strings.Cut(strings.TrimPrefix(r.Header.Get("Range"), "bytes="), "-")
	off, _ := strconv.ParseInt(first, 10, 64)
	sw := &stallingWriter{ResponseWriter: w, left: max(s.dark-off, 0), done: r.Context().Done()}
	http.ServeContent(sw, r, "", time.Time{}, bytes.NewReader(s.content))
}

// stallingWriter passes left bytes on, then blocks until done.
type stallingWriter struct {
	http.ResponseWriter
	left int64
	done <-chan struct{}
}

func (w *stallingWriter) Write(p []byte) (int, error) {
	n, _ := w.ResponseWriter.Write(p[:min(int64(len(p)), w.left)])
	w.left -= int64(n)
	if n < len(p) {
		w.ResponseWriter.(http.Flusher).Flush()
		<-w.done
		return n, errors.New("client gone")
	}
	return n, nil
}

// TestShutdownDuringColdPull: told to stop while a client reads a cold blob
// whose upstream has gone silent, pullproxy cancels its downloads first, so
// the client's response ends at once with a clean close (which it can resume
// from), and the server does not sit out its shutdown grace period waiting
// for the upstream.
func TestShutdownDuringColdPull(t *testing.T) {
	content := make([]byte, 4<<20)
	rand.Read(content)
	d := digest.FromBytes(content)
	upstreamSrv := httptest.NewServer(&stallingBlob{content: content, dark: 512 << 10})
	defer upstreamSrv.Close()
	// Attempts enough that the download outlasts the shutdown grace period.
	cfg := writeConfig(t, "fetch: {max_attempts: 1000}\nupstreams:\n  - name: reg.test\n    endpoints: [{url: "+upstreamSrv.URL+"}]\n")
	p := startProxy(t, "--data-dir", filepath.Join(t.TempDir(), "data"), "--config", cfg)

	resp, err := http.Get(p.URL + "/v2/team/app/blobs/" + d.String() + "?ns=reg.test")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status: got %d, want 200", resp.StatusCode)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 64<<10)); err != nil {
		t.Fatalf("reading the first bytes: %v", err)
	}

	start := time.Now()
	p.cmd.Process.Signal(os.Interrupt)
	n, err := io.Copy(io.Discard, resp.Body)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("the response ended with %v after %d more bytes, want a clean close short of the end (unexpected EOF)", err, n)
	}
	p.cmd.Wait()
	t.Logf("pullproxy stopped %v after the signal", time.Since(start).Round(time.Millisecond))
	if log := p.logged(); strings.Contains(log, "connections still open at shutdown were closed") {
		t.Errorf("shutdown waited out its grace period for a response that waited for the upstream")
	}
}
