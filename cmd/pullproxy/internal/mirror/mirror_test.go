package mirror

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// TestOpen: a command's mirror holds the data dir alone, names its
// upstreams as logged, and removes what interrupted imports and exports
// left behind.
func TestOpen(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, leftover := range []string{".import-1", ".import-upload-2", ".export-3", ".pullproxy-export-4"} {
		if err := os.Mkdir(filepath.Join(dir, leftover), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cfg := config.Default()
	cfg.DataDir = dir
	cfg.Upstreams = []config.Upstream{{Name: "offline.test", Offline: true}}
	log := slog.New(slog.DiscardHandler)
	m, err := Open(t.Context(), cfg, log, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"offline.test=offline"}; !reflect.DeepEqual(m.Names, want) || len(m.Upstreams) != 0 {
		t.Errorf("got names %v and %d online upstreams, want %v and none", m.Names, len(m.Upstreams), want)
	}
	for _, leftover := range []string{".import-1", ".import-upload-2", ".export-3", ".pullproxy-export-4"} {
		if _, err := os.Stat(filepath.Join(dir, leftover)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: got %v, want it removed", leftover, err)
		}
	}
	if _, err := Open(t.Context(), cfg, log, nil, false); !errors.Is(err, storage.ErrInUse) {
		t.Errorf("a second Open: got %v, want %v", err, storage.ErrInUse)
	}
	m.Close()
	m, err = Open(t.Context(), cfg, log, nil, false)
	if err != nil {
		t.Fatalf("Open after Close: %v", err)
	}
	m.Close()
}

// TestNewRegistry: an upstream's client is named canonically, whatever
// the configuration calls it, and reaches the endpoints given.
func TestNewRegistry(t *testing.T) {
	t.Parallel()
	metrics, err := upstream.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	u := config.Upstream{Name: "Registry-1.Docker.io", Endpoints: []config.Endpoint{{URL: "https://a.test"}, {URL: "https://b.test"}}}
	log := slog.New(slog.DiscardHandler)
	r, err := NewRegistry(u, nil, log, metrics, upstream.NewTransport(), upstream.FetchConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if r.Name() != "docker.io" || len(r.Endpoints()) != 2 {
		t.Errorf("got %s over %v, want docker.io over both endpoints", r.Name(), r.Endpoints())
	}
	one, err := NewRegistry(u, []string{"https://b.test"}, log, metrics, upstream.NewTransport(), upstream.FetchConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if got := one.Endpoints(); len(got) != 1 {
		t.Errorf("one endpoint asked: got %v", got)
	}
	if _, err := NewRegistry(config.Upstream{Name: "x.test", Auth: config.Auth{Type: "kerberos"}}, []string{"https://x.test"},
		log, metrics, upstream.NewTransport(), upstream.FetchConfig{}); err == nil {
		t.Error("an unknown auth type: got no error")
	}
}
