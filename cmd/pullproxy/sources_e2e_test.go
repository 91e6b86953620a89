package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/registrytest"
	"github.com/pullproxy/pullproxy/upstream"
)

// lackingUpstream wraps a registry that lacks one blob, as a replica that
// lags: 404 BLOB_UNKNOWN for it, every other request served.
type lackingUpstream struct {
	next http.Handler
	blob digest.Digest
}

func (l *lackingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.HasSuffix(r.URL.Path, "/blobs/"+l.blob.String()) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown to registry"}]}`)
		return
	}
	l.next.ServeHTTP(w, r)
}

// TestContainerdPullsFromSeveralRegistries: one upstream at two registries
// (distribution, each with its own storage) holding the same image;
// containerd pulls it through pullproxy, chunks of its layers coming from
// both. When the second lacks a layer, the first brings that one and the second
// is not left aside. When the first serves a layer corrupt, a pull that
// fails on it is made again, as kubelet does, and gets the image; the
// layer's bytes the second brought are kept, the first's fetched again from
// the second; status then names the first, and only it, as serving that
// layer corrupt (unless the second brought the whole layer, and the first
// pull got the image).
func TestContainerdPullsFromSeveralRegistries(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	t.Parallel()
	img := registrytest.Image{Repo: "team/app", Tag: "v1", LayerSizes: []int64{8 << 20, 6 << 20, 300 << 10}, Seed: 44}
	for _, tc := range []string{"both serve", "the second lacks a layer", "the first serves a layer corrupt"} {
		t.Run(tc, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
			defer cancel()
			corrupting := &corruptingUpstream{}
			lacking := &lackingUpstream{}
			first := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { corrupting.next = h; return corrupting }))
			second := startRegistry(t, registrytest.WithHandlerWrapper(func(h http.Handler) http.Handler { lacking.next = h; return lacking }))
			var pushed registrytest.Pushed
			for _, reg := range []*registrytest.Registry{first, second} {
				var err error
				if pushed, err = reg.Push(ctx, img); err != nil {
					t.Fatal(err)
				}
			}
			layer := pushed.Layers[0].Digest
			switch tc {
			case "the second lacks a layer":
				lacking.blob = layer
			case "the first serves a layer corrupt":
				corrupting.blob = layer
				corrupting.broken.Store(true)
			}
			// Small connection budgets: the layers come as many chunks,
			// which both endpoints share.
			cfg := writeConfig(t, fmt.Sprintf(`
upstreams:
  - name: reg.test
    endpoints:
      - url: %s
      - url: %s
fetch:
  connection_budget: 256KiB
  max_connection_budget: 256KiB
`, first.URL(), second.URL()))
			p := startProxy(t, "--data-dir", t.TempDir(), "--config", cfg)

			pulls := 1
			for ; ; pulls++ {
				err := pullOnce(ctx, t, p.URL, "reg.test/team/app:v1")
				if err == nil {
					break
				}
				if tc != "the first serves a layer corrupt" || pulls == 4 {
					t.Fatalf("pull %d: %v", pulls, err)
				}
			}
			st := upstreamStatus(ctx, t, p)
			var corrupt []string
			for _, c := range st.Corrupt {
				corrupt = append(corrupt, c.Endpoint+" "+c.Digest.String())
			}
			for i, e := range st.Endpoints {
				t.Logf("%s: endpoint %d received %d bytes, up %v", tc, i, e.ReceivedBytes, e.Up)
				if !e.Up {
					t.Errorf("endpoint %d left aside: %s", i, e.LastError)
				}
			}
			switch tc {
			case "both serve":
				// Each claims chunks as its connections free up: the
				// shares follow the pipes, not a rule (pullbench measures
				// them), but together they brought every layer.
				var layers, received int64
				for _, l := range pushed.Layers {
					layers += l.Size
				}
				for _, e := range st.Endpoints {
					received += e.ReceivedBytes
				}
				if received < layers {
					t.Errorf("the endpoints brought %d bytes together, fewer than the layers' %d", received, layers)
				}
				if out, err := runPullproxy(ctx, t, "status", "--server", p.AdminURL); err != nil || strings.Count(out, "of the upstream's)") != 2 {
					t.Errorf("pullproxy status: %v\n%s\nwant each endpoint's share of the bytes", err, out)
				}
			case "the second lacks a layer":
				if !p.loggedWithin("an endpoint lacks a blob the others hold", 5*time.Second) {
					t.Error("the log does not say the second endpoint lacked the layer")
				}
			case "the first serves a layer corrupt":
				// A first pull that got the image had the layer's chunks
				// all from the second endpoint: nothing failed to record.
				want := []string{strings.TrimSuffix(first.URL(), "/") + " " + layer.String()}
				if pulls > 1 && (len(corrupt) != 1 || corrupt[0] != want[0]) {
					t.Errorf("blobs served corrupt, by endpoint: %v, want %v", corrupt, want)
				}
				// The bytes the second brought stay: only the first's
				// ranges are fetched again.
				if pulls > 1 && !p.loggedWithin("keeping the rest", 5*time.Second) {
					t.Error("the log does not say the layer's other bytes were kept")
				}
				t.Logf("pulls until the image came: %d", pulls)
			}
			if tc != "the first serves a layer corrupt" && len(corrupt) > 0 {
				t.Errorf("blobs served corrupt: %v, want none", corrupt)
			}
		})
	}
}

// pullOnce pulls ref through the pullproxy at proxyURL with a new containerd.
func pullOnce(ctx context.Context, t *testing.T, proxyURL, ref string) error {
	t.Helper()
	d, err := containerdtest.Start(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	host, _, _ := strings.Cut(ref, "/")
	hosts, err := d.WriteHostsDir(host, proxyURL)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := d.ContentFetch(ctx, hosts, ref); err != nil {
		return fmt.Errorf("%w\n%s", err, out)
	}
	return nil
}

// upstreamStatus returns the one upstream's state, as pullproxy status
// --json prints it.
func upstreamStatus(ctx context.Context, t *testing.T, p *proxyProcess) upstream.Status {
	t.Helper()
	out, err := runPullproxy(ctx, t, "status", "--json", "--server", p.AdminURL)
	if err != nil {
		t.Fatalf("pullproxy status: %v\n%s", err, out)
	}
	var st []upstream.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil || len(st) != 1 {
		t.Fatalf("pullproxy status --json: %v\n%s", err, out)
	}
	return st[0]
}
