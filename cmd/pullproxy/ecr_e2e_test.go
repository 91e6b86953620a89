package main

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/pullproxy/pullproxy/internal/containerdtest"
	"github.com/pullproxy/pullproxy/internal/ecrtest"
)

// TestContainerdPullsFromECRReplica is the incident's workaround, automated:
// the image's ECR registry in us-east-2 is unreachable, its replica in
// us-east-1 holds the same digests. containerd asks pullproxy for the
// us-east-2 image; pullproxy gets a us-east-1 token from the ECR API
// (a stand-in, reached through api_endpoint, with the SDK's credential chain
// reading the environment) and pulls from the replica. When the registry
// then refuses that token as expired, the next pull renews it and goes on.
// No token appears in pullproxy's log.
func TestContainerdPullsFromECRReplica(t *testing.T) {
	ok, reason := containerdtest.Available()
	requireTool(t, ok, reason)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()

	api := ecrtest.NewAPI(time.Hour)
	apiSrv := httptest.NewServer(api)
	defer apiSrv.Close()
	backend := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	plain := httptest.NewServer(backend) // to push through, without ECR's auth
	defer plain.Close()
	replica := ecrtest.NewRegistry("us-east-1", api, backend)
	replicaSrv := httptest.NewServer(replica)
	defer replicaSrv.Close()
	deadSrv := httptest.NewServer(nil)
	deadSrv.Close() // us-east-2: nothing listens any more

	push := func(tag string) {
		img, err := random.Image(512<<10, 3)
		if err != nil {
			t.Fatal(err)
		}
		ref, _ := name.ParseReference(strings.TrimPrefix(plain.URL, "http://")+"/team/app:"+tag, name.Insecure)
		if err := remote.Write(ref, img); err != nil {
			t.Fatal(err)
		}
	}
	push("v1")
	push("v2")

	const ecrHost = "123456789012.dkr.ecr.us-east-2.amazonaws.com"
	cfg := writeConfig(t, fmt.Sprintf(`
upstreams:
  - name: %s
    endpoints:
      - url: %s
        region: us-east-2
      - url: %s
        region: us-east-1
    auth:
      type: ecr
      api_endpoint: %s
`, ecrHost, deadSrv.URL, replicaSrv.URL, apiSrv.URL))
	dir := t.TempDir()
	p := startProxyEnv(t, []string{
		"AWS_ACCESS_KEY_ID=AKIDTEST", "AWS_SECRET_ACCESS_KEY=secret-aws-key",
		"AWS_CONFIG_FILE=" + filepath.Join(dir, "none"), "AWS_SHARED_CREDENTIALS_FILE=" + filepath.Join(dir, "none"),
		"AWS_EC2_METADATA_DISABLED=true",
	}, "--data-dir", filepath.Join(dir, "data"), "--config", cfg)

	pull := func(tag string) {
		t.Helper()
		d, err := containerdtest.Start(ctx, t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		defer d.Stop()
		hosts, err := d.WriteHostsDir(ecrHost, p.URL)
		if err != nil {
			t.Fatal(err)
		}
		if out, err := d.ContentFetch(ctx, hosts, ecrHost+"/team/app:"+tag); err != nil {
			t.Fatalf("pull of %s: %v\n%s", tag, err, out)
		}
	}
	pull("v1")
	if got := len(api.Tokens("us-east-1")); got != 1 {
		t.Errorf("us-east-1 tokens after the first pull: got %d, want 1", got)
	}
	replica.Expire()
	pull("v2")
	if got := len(api.Tokens("us-east-1")); got != 2 {
		t.Errorf("us-east-1 tokens after the token expired: got %d, want 2", got)
	}
	for _, secret := range []string{ecrtest.TokenPrefix, "secret-aws-key"} {
		if strings.Contains(p.logged(), secret) {
			t.Errorf("pullproxy's log contains a credential (%q…)", secret)
		}
	}
}
