package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"io"
	"log"
	"math"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/pullproxy/pullproxy/bench/carrier"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/doctor"
)

// TestProbeMeasuresTheCarrier: probe, against the incident's carrier set
// to cut 60% of sessions after 1.3 to 3.1 MB, reports that cut rate and
// that range within a few percent, how sessions die, and a budget below
// the cuts; --compare reports a clean path beside it as clean.
func TestProbeMeasuresTheCarrier(t *testing.T) {
	blob := make([]byte, 8<<20)
	rand.Read(blob)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(blob))
	}))
	t.Cleanup(srv.Close)
	for _, tc := range []struct {
		mode    carrier.Mode
		outcome string
	}{
		{carrier.Reset, "reset"},
		{carrier.CleanClose, "eof"},
	} {
		relay, err := carrier.Start(carrier.Config{Target: srv.Listener.Addr().String(), CutProb: 0.6,
			CutMin: 1_300_000, CutMax: 3_100_000, Mode: tc.mode, Seed: 42})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { relay.Close() })
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, pullproxyBin, "probe", "--sessions", "300", "--bytes", "4MiB", "--json",
			"--compare", srv.URL, relay.URL()).Output()
		if err != nil {
			t.Fatalf("probe: %v\n%s", err, out)
		}
		var got []doctor.ProbeSummary
		if err := json.Unmarshal(out, &got); err != nil || len(got) != 2 {
			t.Fatalf("probe --json: %v\n%s", err, out)
		}
		cut, clean := got[0], got[1]
		t.Logf("%s: cut %d of %d (%.3f), points from %d (median %d) to %d, budget %d; clean path: cut %d, %v",
			tc.outcome, cut.Cut, cut.Sessions, cut.CutRate, cut.CutMin, cut.CutMed, cut.CutMax, cut.Budget, clean.Cut, clean.Outcomes)
		if math.Abs(cut.CutRate-0.6) > 0.06 {
			t.Errorf("%s: cut rate %.3f, want 0.6 within 0.06", tc.outcome, cut.CutRate)
		}
		if d := math.Abs(float64(cut.CutMin)-1.3e6) / 1.3e6; d > 0.03 {
			t.Errorf("%s: smallest cut point %d, want 1.3 MB within 3%%", tc.outcome, cut.CutMin)
		}
		if d := math.Abs(float64(cut.CutMax)-3.1e6) / 3.1e6; d > 0.03 {
			t.Errorf("%s: largest cut point %d, want 3.1 MB within 3%%", tc.outcome, cut.CutMax)
		}
		if cut.Outcomes[tc.outcome] != cut.Cut || cut.Outcomes["complete"] != cut.Sessions-cut.Cut {
			t.Errorf("%s: outcomes %v, want %d %s and the rest complete", tc.outcome, cut.Outcomes, cut.Cut, tc.outcome)
		}
		if cut.Budget >= cut.CutMin || cut.Budget < 64<<10 {
			t.Errorf("%s: budget %d, want below the smallest cut point %d", tc.outcome, cut.Budget, cut.CutMin)
		}
		if cut.Rate <= 0 || clean.Rate <= 0 {
			t.Errorf("%s: throughput %v and %v, want both measured", tc.outcome, cut.Rate, clean.Rate)
		}
		if clean.Cut != 0 || clean.Outcomes["complete"] != clean.Sessions {
			t.Errorf("the clean path: %d cut, outcomes %v", clean.Cut, clean.Outcomes)
		}
	}
}

// TestProbeImage: given an image of a configured upstream, probe reads its
// largest layer from the upstream's endpoint, with its credentials.
func TestProbeImage(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	inner := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	open := httptest.NewServer(inner)
	t.Cleanup(open.Close)
	authed := httptest.NewServer(basicAuthRegistry{user: "puller", pass: "s3cret", next: inner})
	t.Cleanup(authed.Close)
	img, err := random.Image(8<<20, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := name.ParseReference(strings.TrimPrefix(open.URL, "http://")+"/team/app:v1", name.Insecure)
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	path := cuttingCarrier(t, authed.Listener.Addr().String())
	pw := writeConfig(t, "s3cret\n")
	config := writeConfig(t, "upstreams:\n  - name: reg.test\n    endpoints: [{url: "+path.URL()+"}]\n"+
		"    auth: {type: basic, username: puller, password_file: "+pw+"}\n")
	out, err := exec.CommandContext(ctx, pullproxyBin, "probe", "--sessions", "40", "--bytes", "4MiB", "--json",
		"--config", config, "reg.test/team/app:v1").Output()
	if err != nil {
		t.Fatalf("probe: %v\n%s", err, out)
	}
	var got []doctor.ProbeSummary
	if err := json.Unmarshal(out, &got); err != nil || len(got) != 1 {
		t.Fatalf("probe --json: %v\n%s", err, out)
	}
	s := got[0]
	t.Logf("the image's layer across the carrier: cut %d of %d, %v, %.0f B/s", s.Cut, s.Sessions, s.Outcomes, s.Rate)
	if s.Outcomes["error"] != 0 || s.Cut == 0 || s.Rate <= 0 {
		t.Errorf("probe of the image: %+v", s.Outcomes)
	}
}
