package upstream

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/pullproxy/pullproxy/bench/carrier"
)

// cutImage is an image in the test registry, as lookups must find it.
type cutImage struct {
	repo, tag string
	desc      Descriptor
	manifest  []byte
	layer     digest.Digest
	layerSize int64
}

// pushCutImages pushes n small images, one tag each, to the registry at srv.
func pushCutImages(t *testing.T, srv *httptest.Server, n int) []cutImage {
	t.Helper()
	var imgs []cutImage
	for i := range n {
		repo, tag := fmt.Sprintf("team%d/app", i%2), fmt.Sprintf("v%d", i)
		img := pushRandomImage(t, srv, repo+":"+tag, 512, 2)
		d, _ := img.Digest()
		raw, _ := img.RawManifest()
		mt, _ := img.MediaType()
		layers, _ := img.Layers()
		ld, _ := layers[0].Digest()
		size, _ := layers[0].Size()
		imgs = append(imgs, cutImage{repo: repo, tag: tag, manifest: raw, layer: digest.Digest(ld.String()), layerSize: size,
			desc: Descriptor{Digest: digest.Digest(d.String()), MediaType: string(mt), Size: int64(len(raw))}})
	}
	return imgs
}

// lookup performs the i-th of a cycle of lookups of img and checks the
// answer against what the registry holds.
func lookup(ctx context.Context, r *Registry, img cutImage, i int) error {
	accept := []string{img.desc.MediaType}
	switch i % 6 {
	case 0:
		got, err := r.HeadManifest(ctx, img.repo, img.tag, accept)
		if err != nil || got != img.desc {
			return fmt.Errorf("HeadManifest %s:%s: got %+v, %v, want %+v", img.repo, img.tag, got, err, img.desc)
		}
	case 1, 2:
		ref := img.tag
		if i%6 == 2 {
			ref = img.desc.Digest.String()
		}
		got, body, err := r.GetManifest(ctx, img.repo, ref, accept)
		if err != nil || got != img.desc || string(body) != string(img.manifest) {
			return fmt.Errorf("GetManifest %s:%s: got %+v, %v, want %+v", img.repo, ref, got, err, img.desc)
		}
	case 3:
		got, err := r.HeadBlob(ctx, img.repo, img.layer)
		if err != nil || got != img.layerSize {
			return fmt.Errorf("HeadBlob %s@%s: got %v, %v, want %v", img.repo, img.layer, got, err, img.layerSize)
		}
	case 4:
		if _, err := r.HeadManifest(ctx, img.repo, "missing-"+img.tag, accept); !errors.Is(err, ErrNotFound) || errors.Is(err, ErrUnavailable) {
			return fmt.Errorf("HeadManifest of a missing tag: got %v, want %v", err, ErrNotFound)
		}
	case 5:
		if _, _, err := r.GetManifest(ctx, img.repo, "missing-"+img.tag, accept); !errors.Is(err, ErrNotFound) || errors.Is(err, ErrUnavailable) {
			return fmt.Errorf("GetManifest of a missing tag: got %v, want %v", err, ErrNotFound)
		}
	}
	return nil
}

// bearerGate puts token auth in front of a registry, with the token realm on
// the registry's own host: tokens cross the same carrier as manifests.
// Tokens are large, as Docker Hub's are, and short-lived, so that they are
// fetched again and again.
type bearerGate struct {
	next    http.Handler
	realm   atomic.Pointer[string] // nil: requests pass without a token
	fetches atomic.Int64
}

func (g *bearerGate) token(scope string) string {
	return "tok." + base64.RawURLEncoding.EncodeToString([]byte(scope)) + "." + strings.Repeat("x", 1500)
}

func (g *bearerGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	realm := g.realm.Load()
	if realm == nil {
		g.next.ServeHTTP(w, r)
		return
	}
	if r.URL.Path == "/token" {
		g.fetches.Add(1)
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"token": g.token(r.URL.Query().Get("scope")), "expires_in": 1})
		return
	}
	rest := strings.TrimPrefix(r.URL.Path, "/v2/")
	for _, k := range []string{"/manifests/", "/blobs/"} {
		if i := strings.LastIndex(rest, k); i > 0 {
			scope := "repository:" + rest[:i] + ":pull"
			if r.Header.Get("Authorization") != "Bearer "+g.token(scope) {
				w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm=%q,service="registry.test",scope=%q`, *realm, scope))
				w.WriteHeader(http.StatusUnauthorized)
				return
			}
		}
	}
	g.next.ServeHTTP(w, r)
}

// TestMetadataThroughCarrier sends thousands of manifest, blob HEAD and token
// requests through a carrier that resets every session after 24 to 48 KiB,
// far less than the lookups carry. Every lookup must get its true answer:
// a cut is retried on a fresh connection, kept-alive connections are
// retired before their budget once a cut has taught it, and the endpoint is
// never taken for down.
func TestMetadataThroughCarrier(t *testing.T) {
	t.Parallel()
	const (
		lookups = 2000
		workers = 8
	)
	tests := []struct {
		name   string
		cfg    FetchConfig
		bearer bool
		// minCuts: with a minimum budget above the carrier's cut, every
		// kept-alive session is cut, and every cut is retried.
		minCuts int64
		// maxCuts, when not 0, bounds the relay's cuts: with a minimum budget
		// below the carrier's cut, the first cut teaches a budget under it,
		// and only sessions already carrying requests can still be cut.
		maxCuts int64
	}{
		{name: "budget floor above the cut", cfg: FetchConfig{MinConnectionBudget: 128 << 10}, minCuts: 10},
		{name: "budget learnt", cfg: FetchConfig{MinConnectionBudget: 8 << 10}, minCuts: 1, maxCuts: workers},
		{name: "bearer tokens across the carrier", cfg: FetchConfig{MinConnectionBudget: 128 << 10}, bearer: true, minCuts: 10},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			gate := &bearerGate{next: registry.New(registry.Logger(log.New(io.Discard, "", 0)))}
			srv := httptest.NewServer(gate)
			t.Cleanup(srv.Close)
			imgs := pushCutImages(t, srv, 4) // before the gate closes: the push is not authenticated
			relay, err := carrier.Start(carrier.Config{Target: host(srv), CutProb: 1, CutMin: 24 << 10, CutMax: 48 << 10,
				Mode: carrier.Reset, Seed: 7})
			if err != nil {
				t.Fatalf("carrier.Start: %v", err)
			}
			t.Cleanup(func() { relay.Close() })
			if tt.bearer {
				realm := relay.URL() + "/token"
				gate.realm.Store(&realm)
			}
			// A spare endpoint that fails: a lookup the first endpoint could
			// not answer would end up there.
			spare := &countingHandler{h: statusHandler(http.StatusServiceUnavailable)}
			spareSrv := httptest.NewServer(spare)
			t.Cleanup(spareSrv.Close)

			m, reg := newTestMetrics(t)
			tr := NewTransport()
			t.Cleanup(tr.CloseIdleConnections)
			r, err := New(testUpstream, []string{relay.URL(), spareSrv.URL}, WithTransport(tr), WithLogger(discardLogger),
				WithMetrics(m), WithFetchConfig(tt.cfg))
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			t.Cleanup(r.client.CloseIdleConnections)

			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			start := time.Now()
			var next, failed atomic.Int64
			var mu sync.Mutex
			var errs []error
			var wg sync.WaitGroup
			for range workers {
				wg.Go(func() {
					for i := int(next.Add(1) - 1); i < lookups; i = int(next.Add(1) - 1) {
						if err := lookup(ctx, r, imgs[i%len(imgs)], i/len(imgs)); err != nil {
							failed.Add(1)
							mu.Lock()
							if len(errs) < 5 {
								errs = append(errs, err)
							}
							mu.Unlock()
						}
					}
				})
			}
			wg.Wait()
			elapsed := time.Since(start)
			relay.Close() // final counts
			st := relay.Stats()
			ep := r.endpoints[0]
			retries := metricValue(t, reg, "pullproxy_upstream_retries_total", nil)
			t.Logf("%d lookups in %v: relay sessions %d, cut %d, %d bytes down; retries %v; budget %d",
				lookups, elapsed.Round(time.Millisecond), st.Sessions, st.Cut, st.BytesDown, retries, ep.budget.get())
			if tt.bearer {
				t.Logf("token fetches: %d", gate.fetches.Load())
			}

			if n := failed.Load(); n > 0 {
				t.Errorf("%d of %d lookups failed, the first: %v", n, lookups, errors.Join(errs...))
			}
			if n := spare.n.Load(); n > 0 {
				t.Errorf("requests to the spare endpoint: got %d, want 0 (the first endpoint failed requests)", n)
			}
			if ep.health.down(time.Now()) || testutil.ToFloat64(ep.up) != 1 {
				t.Errorf("the first endpoint is left aside, want it up")
			}
			if st.Cut == 0 || st.BytesDown < 10*(48<<10) {
				t.Errorf("relay: %d cuts, %d bytes down; want the cut-off reached many times over", st.Cut, st.BytesDown)
			}
			if st.Cut < tt.minCuts {
				t.Errorf("relay cuts: got %d, want at least %d", st.Cut, tt.minCuts)
			}
			if tt.maxCuts > 0 && st.Cut > tt.maxCuts {
				t.Errorf("relay cuts: got %d, want at most %d once the budget is learnt", st.Cut, tt.maxCuts)
			}
			if got := metricValue(t, reg, "pullproxy_upstream_connection_cuts_total", map[string]string{"endpoint": ep.host}); got < 1 {
				t.Errorf("cuts recorded for the endpoint: got %v, want some", got)
			}
			if got := ep.budget.get(); got >= 1<<20 {
				t.Errorf("budget: got %d, want it lowered by the cuts on metadata connections", got)
			}
		})
	}
}
