package imagesync

import (
	"io"
	"log"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/proxy"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// TestSyncRepositoryThroughTheCore: rounds through the mirror core, with a
// registry as the upstream: the first caches the tags the rule keeps and
// not the others, a round in which nothing moved fetches nothing, and a
// tag pushed later is cached by the next round.
func TestSyncRepositoryThroughTheCore(t *testing.T) {
	t.Parallel()
	reg := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(reg.Close)
	host := strings.TrimPrefix(reg.URL, "http://")
	push := func(tag string) v1.Image {
		t.Helper()
		img, err := random.Image(2000, 2)
		if err != nil {
			t.Fatal(err)
		}
		ref, err := name.ParseReference(host+"/team/app:"+tag, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Write(ref, img); err != nil {
			t.Fatal(err)
		}
		return img
	}
	ctx := t.Context()
	logger := slog.New(slog.DiscardHandler)
	st, err := storage.Open(ctx, t.TempDir(), storage.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	up, err := upstream.New("reg", []string{reg.URL}, upstream.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	core, err := proxy.New(proxy.WithStore(st), proxy.WithUpstream(up), proxy.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { core.Close() })
	sel, err := Compile(Rule{Upstream: "reg", Repository: "team/app", Tags: []string{"^v[0-9]+$"}})
	if err != nil {
		t.Fatal(err)
	}
	cached := func(img v1.Image) bool {
		t.Helper()
		layers, err := img.Layers()
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range layers {
			d, _ := l.Digest()
			if _, err := st.StatBlob(ctx, digest.Digest(d.String())); err != nil {
				return false
			}
		}
		return true
	}

	v1img, devImg := push("v1"), push("dev")
	kept, round, err := SyncRepository(ctx, core, sel, "team/app", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !cached(v1img) || cached(devImg) || len(kept) != 1 || len(round.Fetched) != 1 {
		t.Fatalf("first round: v1 cached %v, dev cached %v, kept %v, fetched %v; want v1 alone", cached(v1img), cached(devImg), kept, round.Fetched)
	}
	kept, round, err = SyncRepository(ctx, core, sel, "team/app", kept)
	if err != nil || len(round.Fetched) != 0 || len(kept) != 1 {
		t.Fatalf("a round with nothing moved: fetched %v, kept %v, %v; want nothing fetched", round.Fetched, kept, err)
	}
	v2img := push("v2")
	kept, round, err = SyncRepository(ctx, core, sel, "team/app", kept)
	if err != nil || !cached(v2img) || len(kept) != 2 || len(round.Fetched) != 1 || round.Fetched[0] != "v2" {
		t.Fatalf("after v2 was pushed: v2 cached %v, kept %v, fetched %v, %v; want v2 fetched", cached(v2img), kept, round.Fetched, err)
	}
}
