package proxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// TestCoreCalls: the mirror core's calls fetch, store and return what a
// client's requests would, and a second call is answered from the store.
func TestCoreCalls(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 300_000, 2)
	ctx := context.Background()
	wantManifest, _ := img.RawManifest()
	wantDigest, _ := img.Digest()
	layer, layerBytes := layerDigest(t, img, 0)

	desc, err := e.srv.ResolveTag(ctx, upstreamName, "test/app", "v1")
	if err != nil || desc.Digest.String() != wantDigest.String() {
		t.Fatalf("ResolveTag: %v, %v; want %s", desc, err, wantDigest)
	}
	for _, ref := range []string{"v1", wantDigest.String()} {
		m, err := e.srv.Manifest(ctx, upstreamName, "test/app", ref)
		if err != nil || !bytes.Equal(m.Body, wantManifest) || m.Digest.String() != wantDigest.String() || m.MediaType == "" {
			t.Fatalf("Manifest %s: %s %s, %d bytes, %v", ref, m.Digest, m.MediaType, len(m.Body), err)
		}
	}

	if _, _, err := e.srv.OpenBlob(ctx, upstreamName, "test/app", layer); !errors.Is(err, storage.ErrNotFound) {
		t.Fatalf("OpenBlob before EnsureBlob: %v, want not found", err)
	}
	var landed int64
	for i := range 2 {
		size, err := e.srv.EnsureBlob(ctx, upstreamName, "test/app", layer, func(n int64) { landed += n })
		if err != nil || size != int64(len(layerBytes)) {
			t.Fatalf("EnsureBlob %d: %d, %v; want %d", i, size, err, len(layerBytes))
		}
	}
	if landed != int64(len(layerBytes)) {
		t.Errorf("landed %d bytes, want %d (once: the second call found it stored)", landed, len(layerBytes))
	}
	if n := e.counter.count("GET blobs"); n == 0 {
		t.Errorf("the upstream was asked for no blob")
	}
	f, size, err := e.srv.OpenBlob(ctx, upstreamName, "test/app", layer)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(f)
	f.Close()
	if size != int64(len(layerBytes)) || !bytes.Equal(got, layerBytes) {
		t.Errorf("OpenBlob: %d bytes (size %d), want the layer's %d", len(got), size, len(layerBytes))
	}

	for _, tc := range []struct {
		name   string
		call   func() error
		status int
	}{
		{"unconfigured upstream", func() error {
			_, err := e.srv.Manifest(ctx, "elsewhere.test", "test/app", "v1")
			return err
		}, http.StatusNotFound},
		{"invalid repository", func() error {
			_, err := e.srv.Manifest(ctx, upstreamName, "Test/App", "v1")
			return err
		}, http.StatusBadRequest},
		{"missing tag", func() error {
			_, err := e.srv.Manifest(ctx, upstreamName, "test/app", "nope")
			return err
		}, http.StatusNotFound},
		{"missing blob", func() error {
			_, err := e.srv.EnsureBlob(ctx, upstreamName, "test/app", digest.FromString("nope"), nil)
			return err
		}, http.StatusNotFound},
	} {
		err := tc.call()
		if err == nil {
			t.Errorf("%s: no error", tc.name)
			continue
		}
		if got := toOCI(err, kindManifest).status; got != tc.status {
			t.Errorf("%s: %v, status %d; want %d", tc.name, err, got, tc.status)
		}
	}
}

// TestSeedFetchesWithoutRequests: a seed stores an image's manifest and
// blobs through the core, counting its progress, and a second seed finds
// them all stored.
func TestSeedFetchesWithoutRequests(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 100_000, 3)
	want, _ := img.Digest()
	for i := range 2 {
		var progress SeedProgress
		d, err := e.srv.Seed(context.Background(), upstreamName, "test/app", "v1", SeedOptions{Progress: &progress})
		if err != nil || d.String() != want.String() {
			t.Fatalf("seed %d: %s, %v", i, d, err)
		}
		if progress.BlobsDone.Load() != 4 || progress.BlobsTotal.Load() != 4 || progress.BytesDone.Load() != progress.BytesTotal.Load() {
			t.Errorf("seed %d: %d of %d blobs, %d of %d bytes", i, progress.BlobsDone.Load(), progress.BlobsTotal.Load(),
				progress.BytesDone.Load(), progress.BytesTotal.Load())
		}
	}
	if n := e.counter.count("GET blobs"); n < 4 {
		t.Errorf("the upstream was asked for %d blobs, want the image's 4", n)
	}
	for i := range 3 {
		d, _ := layerDigest(t, img, i)
		if _, err := e.store.StatBlob(context.Background(), d); err != nil {
			t.Errorf("layer %d not stored: %v", i, err)
		}
	}
}

// TestCoreTags: Tags lists every tag the upstream holds, page after page,
// asking the upstream each time.
func TestCoreTags(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	img := e.push("test/app", "v1", 1000, 1)
	want := []string{"v1", "v2", "v3", "v4", "v5"}
	for _, tag := range want[1:] {
		e.write("test/app", tag, img)
	}
	for _, n := range []int{1000, 2} {
		before := e.counter.count("GET list")
		got, err := e.srv.tagsPaged(t.Context(), upstreamName, "test/app", n)
		if err != nil {
			t.Fatalf("pages of %d: %v", n, err)
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("pages of %d: got %v, want %v", n, got, want)
		}
		pages := e.counter.count("GET list") - before
		if wantPages := (len(want) + n - 1) / n; pages < wantPages {
			t.Errorf("pages of %d: the upstream was asked %d times, want %d at least", n, pages, wantPages)
		}
	}
	if _, err := e.srv.Tags(t.Context(), "not-configured", "test/app"); err == nil {
		t.Error("Tags of an upstream not configured: got nil, want an error")
	}
}

// TestCoreRepositories: Repositories lists the upstream's catalog under a
// prefix, and nothing for an upstream not configured.
func TestCoreRepositories(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	for _, repo := range []string{"team/a", "team/b/c", "teams/x", "other/y"} {
		e.push(repo, "v1", 1000, 1)
	}
	got, err := e.srv.Repositories(t.Context(), upstreamName, "team/")
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	if want := []string{"team/a", "team/b/c"}; !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if _, err := e.srv.Repositories(t.Context(), "not-configured", ""); err == nil {
		t.Error("Repositories of an upstream not configured: got nil, want an error")
	}
}

// TestCoreCheckTag: CheckTag asks the upstream whatever the tag TTL, and
// sees a tag moved that ResolveTag, within its TTL, still answers from the
// store; a client's lookup then gets the new digest too.
func TestCoreCheckTag(t *testing.T) {
	t.Parallel()
	e := newEnv(t, WithTagTTL(time.Hour))
	first := e.push("test/app", "v1", 1000, 1)
	ctx := t.Context()
	firstDigest, _ := first.Digest()
	if d, err := e.srv.ResolveTag(ctx, upstreamName, "test/app", "v1"); err != nil || d.Digest.String() != firstDigest.String() {
		t.Fatalf("ResolveTag: %v, %v; want %s", d.Digest, err, firstDigest)
	}
	second := e.push("test/app", "v1", 1000, 1)
	secondDigest, _ := second.Digest()
	if d, _ := e.srv.ResolveTag(ctx, upstreamName, "test/app", "v1"); d.Digest.String() != firstDigest.String() {
		t.Fatalf("ResolveTag within the TTL: got %s, want the stored %s", d.Digest, firstDigest)
	}
	heads := e.counter.count("HEAD manifests")
	d, err := e.srv.CheckTag(ctx, upstreamName, "test/app", "v1")
	if err != nil || d.Digest.String() != secondDigest.String() {
		t.Fatalf("CheckTag: %v, %v; want the moved tag's %s", d.Digest, err, secondDigest)
	}
	if n := e.counter.count("HEAD manifests") - heads; n != 1 {
		t.Errorf("CheckTag made %d HEAD requests, want 1", n)
	}
	if d, _ := e.srv.ResolveTag(ctx, upstreamName, "test/app", "v1"); d.Digest.String() != secondDigest.String() {
		t.Errorf("ResolveTag after CheckTag: got %s, want %s", d.Digest, secondDigest)
	}
	if _, err := e.srv.CheckTag(ctx, upstreamName, "test/app", "gone"); !errors.Is(err, upstream.ErrNotFound) {
		t.Errorf("CheckTag of a tag the upstream lacks: got %v, want ErrNotFound", err)
	}
}
