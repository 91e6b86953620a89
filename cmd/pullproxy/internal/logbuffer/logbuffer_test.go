package logbuffer

import (
	"bytes"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// syncBuffer is a bytes.Buffer safe for the flusher and the test at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestLogBuffer: info lines reach the output within the flush interval, in
// order; a warning takes every line before it out at once; Close writes
// what is left.
func TestLogBuffer(t *testing.T) {
	var out syncBuffer
	b := New(&out)
	log := slog.New(FlushOnWarn(slog.NewTextHandler(b, nil), b))

	log.Info("first")
	log.Info("second")
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(out.String(), "msg=second") {
		if time.Now().After(deadline) {
			t.Fatalf("info lines not written within 5 s: %q", out.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := out.String(); strings.Index(got, "msg=first") > strings.Index(got, "msg=second") {
		t.Errorf("lines out of order: %q", got)
	}

	log.Info("before the warning")
	log.With("k", "v").Warn("the warning")
	if got := out.String(); !strings.Contains(got, "msg=\"before the warning\"") || !strings.Contains(got, "msg=\"the warning\" k=v") {
		t.Errorf("after a warning: got %q, want it and every line before it written", got)
	}

	log.Info("last")
	b.Close()
	if got := out.String(); !strings.Contains(got, "msg=last") {
		t.Errorf("after Close: got %q, want the last line written", got)
	}
}
