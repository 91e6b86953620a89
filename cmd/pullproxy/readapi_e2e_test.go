package main

import (
	"context"
	"encoding/json"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/pullproxy/pullproxy/internal/registrytest"
)

// requireTools skips (or, in CI, fails) a test unless every tool is on PATH.
func requireTools(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		_, err := exec.LookPath(tool)
		requireTool(t, err == nil, tool+" is not installed (make deps installs it)")
	}
}

// runClient runs a client command and returns its standard output; it fails the
// test, with everything the command printed, if the command fails.
func runClient(ctx context.Context, t *testing.T, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s%s", name, strings.Join(args, " "), err, out, stderr.String())
	}
	return string(out)
}

// distributionUpstream starts distribution's registry, the code behind
// Docker's registry image, on loopback: an upstream without the referrers
// API, as many are.
func distributionUpstream(t *testing.T) string {
	t.Helper()
	reg, err := registrytest.Start(t.Context(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	return reg.URL()
}

// referrersUpstream starts go-containerregistry's registry with its
// referrers API on.
func referrersUpstream(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithReferrersSupport(true)))
	t.Cleanup(srv.Close)
	return srv.URL
}

// pushTags pushes one small image to upstreamURL's repo under each tag.
func pushTags(t *testing.T, upstreamURL, repo string, tags ...string) v1.Image {
	t.Helper()
	img, err := random.Image(4096, 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range tags {
		ref, err := name.ParseReference(strings.TrimPrefix(upstreamURL, "http://")+"/"+repo+":"+tag, name.Insecure)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Write(ref, img); err != nil {
			t.Fatal(err)
		}
	}
	return img
}

// TestListingClients: the clients people list and inspect repositories
// with, pointed at pullproxy (the upstream's name as the first path
// component, as for CRI-O), list the upstream's tags, and skopeo inspect
// works without --no-tags.
func TestListingClients(t *testing.T) {
	requireTools(t, "crane", "skopeo", "oras", "regctl")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	up := distributionUpstream(t)
	tags := []string{"1.0", "1.1", "2.0", "latest", "v1"}
	pushTags(t, up, "team/app", tags...)
	p := startProxy(t, "--data-dir", t.TempDir(), "--upstream", "reg.test="+up)
	host := strings.TrimPrefix(p.URL, "http://")
	repo := host + "/reg.test/team/app"
	// regctl reads its registry settings from its own config file.
	regctlEnv := []string{"HOME=" + t.TempDir()}
	runClient(ctx, t, regctlEnv, "regctl", "registry", "set", "--tls", "disabled", host)

	lines := func(s string) []string { return strings.Fields(s) }
	for _, tc := range []struct {
		client string
		list   func() []string
	}{
		{"crane ls", func() []string { return lines(runClient(ctx, t, nil, "crane", "ls", "--insecure", repo)) }},
		{"oras repo tags", func() []string { return lines(runClient(ctx, t, nil, "oras", "repo", "tags", "--plain-http", repo)) }},
		{"regctl tag ls", func() []string { return lines(runClient(ctx, t, regctlEnv, "regctl", "tag", "ls", repo)) }},
		{"skopeo list-tags", func() []string {
			var out struct{ Tags []string }
			s := runClient(ctx, t, nil, "skopeo", "list-tags", "--tls-verify=false", "docker://"+repo)
			if err := json.Unmarshal([]byte(s), &out); err != nil {
				t.Errorf("skopeo list-tags: %v\n%s", err, s)
			}
			return out.Tags
		}},
		{"skopeo inspect", func() []string {
			var out struct{ RepoTags []string }
			s := runClient(ctx, t, nil, "skopeo", "--override-os", "linux", "--override-arch", "amd64",
				"inspect", "--tls-verify=false", "docker://"+repo+":v1")
			if err := json.Unmarshal([]byte(s), &out); err != nil {
				t.Errorf("skopeo inspect: %v\n%s", err, s)
			}
			return out.RepoTags
		}},
	} {
		got := tc.list()
		slices.Sort(got)
		if !slices.Equal(got, tags) {
			t.Errorf("%s: %q, want %q", tc.client, got, tags)
		}
	}
	// A page at a time, following Link: regctl asks for n.
	if got := lines(runClient(ctx, t, regctlEnv, "regctl", "tag", "ls", "--limit", "2", repo)); len(got) == 0 || len(got) > 2 {
		t.Errorf("regctl tag ls --limit 2: %q", got)
	}
}

// TestReferrersThroughMirror: an SBOM attached to an image with oras is
// discovered and pulled through pullproxy, its digest checked by oras: from
// an upstream with the referrers API, and from one without (where oras
// attach keeps a tag-schema index, and oras discover through pullproxy
// falls back to it).
func TestReferrersThroughMirror(t *testing.T) {
	requireTools(t, "oras")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, tc := range []struct {
		name     string
		upstream func(*testing.T) string
	}{
		{"referrers API", referrersUpstream},
		{"tag schema", distributionUpstream},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := tc.upstream(t)
			pushTags(t, up, "team/app", "v1")
			upHost := strings.TrimPrefix(up, "http://")
			dir := t.TempDir()
			sbom := filepath.Join(dir, "sbom.spdx.json")
			content := `{"spdxVersion":"SPDX-2.3","name":"team/app"}`
			if err := os.WriteFile(sbom, []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.CommandContext(ctx, "oras", "attach", "--plain-http", "--format", "json",
				"--artifact-type", "application/spdx+json", upHost+"/team/app:v1", "sbom.spdx.json:application/spdx+json")
			cmd.Dir = dir
			out, err := cmd.Output()
			var attached struct{ Digest string }
			if err == nil {
				err = json.Unmarshal(out, &attached)
			}
			if err != nil || attached.Digest == "" {
				t.Fatalf("oras attach: %v\n%s", err, out)
			}

			p := startProxy(t, "--data-dir", filepath.Join(dir, "data"), "--upstream", "reg.test="+up)
			repo := strings.TrimPrefix(p.URL, "http://") + "/reg.test/team/app"
			var found struct {
				Referrers []struct {
					Digest       string `json:"digest"`
					ArtifactType string `json:"artifactType"`
				} `json:"referrers"`
			}
			// Unfiltered: go-containerregistry's registry reports an
			// artifact's config media type as its artifactType.
			listed := runClient(ctx, t, nil, "oras", "discover", "--plain-http", "--format", "json", repo+":v1")
			if err := json.Unmarshal([]byte(listed), &found); err != nil || len(found.Referrers) != 1 ||
				found.Referrers[0].Digest != attached.Digest {
				t.Fatalf("oras discover through pullproxy: %v, want %s\n%s", err, attached.Digest, listed)
			}
			pulled := filepath.Join(dir, "pulled")
			runClient(ctx, t, nil, "oras", "pull", "--plain-http", "-o", pulled, repo+"@"+attached.Digest)
			if got, err := os.ReadFile(filepath.Join(pulled, "sbom.spdx.json")); err != nil || string(got) != content {
				t.Errorf("the SBOM pulled through pullproxy: %q, %v", got, err)
			}
		})
	}
}
