package progress

import (
	"strings"
	"testing"
	"time"
)

func TestProgressLine(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		done, total int64
		extra, want string
	}{
		{50 << 20, 100 << 20, "blobs 1/3", "seeding x: 50.0 MiB of 100.0 MiB, 5.0 MiB/s, ETA 10s, blobs 1/3"},
		{50 << 20, 0, "", "seeding x: 50.0 MiB, 5.0 MiB/s"},
		{0, 100 << 20, "", "seeding x: 0 B of 100.0 MiB, 0 B/s, ETA ?"},
	} {
		p := &Reporter{label: "seeding x", read: func() (int64, int64, string) { return tt.done, tt.total, tt.extra }}
		got := p.line(time.Now().Add(-10 * time.Second))
		// The rate depends on the clock: compare with it rounded off.
		if !strings.HasPrefix(got, strings.SplitN(tt.want, ",", 2)[0]) || strings.Contains(tt.want, "ETA ?") != strings.Contains(got, "ETA ?") ||
			!strings.HasSuffix(got, tt.extra) {
			t.Errorf("line = %q, want about %q", got, tt.want)
		}
	}
}

func TestBytes(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		n    int64
		want string
	}{{0, "0 B"}, {1023, "1023 B"}, {1024, "1.0 KiB"}, {3 << 29, "1.5 GiB"}} {
		if got := Bytes(tt.n); got != tt.want {
			t.Errorf("Bytes(%d): got %q, want %q", tt.n, got, tt.want)
		}
	}
}
