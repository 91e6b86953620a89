package proxy

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"testing"
	"time"
)

func TestRequestLogWritesWhatSlogWrites(t *testing.T) {
	utc := time.Date(2026, 12, 1, 16, 34, 31, 642_000_000, time.UTC)
	zone := time.FixedZone("CET", 3600)
	lines := []struct {
		name  string
		line  requestLine
		plain bool // written by RequestLog rather than slog
	}{
		{"blob", requestLine{time: utc, method: "GET", path: "/v2/node/app/blobs/sha256:cbfa5f76caaf88a74a36de1823453c94c2b208613f56003183922648fec09274",
			ns: "docker.io", remote: "127.0.0.1:48938", status: 200, bytes: 106496, duration: 12 * time.Microsecond}, true},
		{"whole milliseconds", requestLine{time: utc.Truncate(time.Second), method: "HEAD", path: "/v2/", ns: "", remote: "[::1]:5000",
			status: 401, bytes: 0, duration: 3*time.Second + 250*time.Millisecond}, true},
		{"nanoseconds, zone", requestLine{time: time.Date(2026, 1, 2, 3, 4, 5, 999_999_999, zone), method: "GET",
			path: "/v2/library/alpine/manifests/3.20", ns: "registry-1.docker.io:443", remote: "10.0.0.1:1",
			status: 404, bytes: 1234, duration: 0}, true},
		{"empty remote, long duration", requestLine{time: utc, method: "DELETE", path: "/v2/x/blobs/uploads/", ns: "a",
			status: 405, bytes: 99, duration: 90 * time.Minute}, true},
		{"space in path", requestLine{time: utc, method: "GET", path: "/v2/a b/manifests/x", ns: "docker.io", remote: "127.0.0.1:1", status: 404}, false},
		{"quote", requestLine{time: utc, method: "GET", path: `/v2/a"b/tags/list`, ns: "docker.io", remote: "127.0.0.1:1", status: 404}, false},
		{"backslash", requestLine{time: utc, method: "GET", path: `/v2/a\b`, ns: "docker.io", remote: "127.0.0.1:1", status: 404}, false},
		{"equals in ns", requestLine{time: utc, method: "GET", path: "/v2/", ns: "a=b", remote: "127.0.0.1:1", status: 200}, false},
		{"not ASCII", requestLine{time: utc, method: "GET", path: "/v2/é/manifests/µ", ns: "docker.io", remote: "127.0.0.1:1", status: 404}, false},
		{"control byte", requestLine{time: utc, method: "GET", path: "/v2/a\x01", ns: "docker.io", remote: "127.0.0.1:1", status: 404}, false},
		{"odd method", requestLine{time: utc, method: "BREW<>&", path: "/", ns: "", remote: "127.0.0.1:1", status: 405}, true},
	}
	formats := []struct {
		name    string
		handler func(io.Writer) slog.Handler
	}{
		{"text", func(w io.Writer) slog.Handler { return slog.NewTextHandler(w, nil) }},
		{"json", func(w io.Writer) slog.Handler { return slog.NewJSONHandler(w, nil) }},
	}
	for _, f := range formats {
		for _, tc := range lines {
			t.Run(f.name+"/"+tc.name, func(t *testing.T) {
				var want bytes.Buffer
				rec := slog.NewRecord(tc.line.time, slog.LevelInfo, "request", 0)
				rec.AddAttrs(slog.String("method", tc.line.method), slog.String("path", tc.line.path), slog.String("ns", tc.line.ns),
					slog.Int("status", tc.line.status), slog.Int64("bytes", tc.line.bytes),
					slog.Duration("duration", tc.line.duration), slog.String("remote", tc.line.remote))
				if err := f.handler(&want).Handle(context.Background(), rec); err != nil {
					t.Fatal(err)
				}

				var direct, both bytes.Buffer
				l, err := NewRequestLog(&direct, f.name)
				if err != nil {
					t.Fatal(err)
				}
				line := tc.line
				if got := l.write(&line); got != tc.plain {
					t.Errorf("written by RequestLog: %v, want %v", got, tc.plain)
				}
				if tc.plain && direct.String() != want.String() {
					t.Errorf("RequestLog wrote\n%s\nslog writes\n%s", direct.String(), want.String())
				}

				// Through the server, every line comes out as slog's,
				// whichever of the two writes it.
				l, _ = NewRequestLog(&both, f.name)
				s := &Server{requestLog: l}
				s.writeRequestLine(context.Background(), f.handler(&both), &line)
				if both.String() != want.String() {
					t.Errorf("server wrote\n%s\nslog writes\n%s", both.String(), want.String())
				}
			})
		}
	}
}

func TestNewRequestLogRefusesUnknownFormat(t *testing.T) {
	if _, err := NewRequestLog(io.Discard, "logfmt"); err == nil {
		t.Fatal("NewRequestLog accepted format logfmt")
	}
}

func BenchmarkRequestLog(b *testing.B) {
	line := requestLine{time: time.Now(), method: "GET", path: "/v2/node/app/blobs/sha256:cbfa5f76caaf88a74a36de1823453c94c2b208613f56003183922648fec09274",
		ns: "docker.io", remote: "127.0.0.1:48938", status: 200, bytes: 106496, duration: 12 * time.Microsecond}
	for _, format := range []string{"text", "json"} {
		b.Run(format+"/RequestLog", func(b *testing.B) {
			l, _ := NewRequestLog(io.Discard, format)
			s := &Server{requestLog: l}
			h := slog.NewTextHandler(io.Discard, nil)
			b.ReportAllocs()
			for b.Loop() {
				s.writeRequestLine(context.Background(), h, &line)
			}
		})
		b.Run(format+"/slog", func(b *testing.B) {
			s := &Server{}
			h := slog.Handler(slog.NewTextHandler(io.Discard, nil))
			if format == "json" {
				h = slog.NewJSONHandler(io.Discard, nil)
			}
			b.ReportAllocs()
			for b.Loop() {
				s.writeRequestLine(context.Background(), h, &line)
			}
		})
	}
}
