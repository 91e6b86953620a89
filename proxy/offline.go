package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/spans"
	"github.com/pullproxy/pullproxy/storage/content"
	"github.com/pullproxy/pullproxy/upstream"
)

// Offline returns an upstream standing for the one named name that is
// never contacted: pullproxy serves what the store holds for it, tags and
// tag lists however old, and a miss is a 404 that names what is missing
// and says the mirror is offline. For an air-gapped site, or an upstream
// cut off on purpose.
func Offline(name string) Upstream { return offlineUpstream{name: upstream.CanonicalName(name)} }

type offlineUpstream struct{ name string }

// isOffline reports whether up is never to be contacted.
func isOffline(up Upstream) bool {
	_, ok := up.(offlineUpstream)
	return ok
}

// miss is the answer to anything not in the store: ErrNotFound, so that
// clients get a 404 (and containerd tries its next host, if it has one).
func (o offlineUpstream) miss(repo, what string) error {
	return &upstream.Error{Upstream: o.name, Op: what + " of " + repo, Status: http.StatusNotFound, Kind: upstream.ErrNotFound,
		Message: fmt.Sprintf("not in the store, and pullproxy is offline for %s: import or seed it (pullproxy import, pullproxy seed)", o.name)}
}

func (o offlineUpstream) Name() string        { return o.name }
func (o offlineUpstream) Endpoints() []string { return nil }

func (o offlineUpstream) HeadManifest(ctx context.Context, repo, ref string, accept []string) (upstream.Descriptor, error) {
	return upstream.Descriptor{}, o.miss(repo, "manifest "+ref)
}

func (o offlineUpstream) GetManifest(ctx context.Context, repo, ref string, accept []string) (upstream.Descriptor, []byte, error) {
	return upstream.Descriptor{}, nil, o.miss(repo, "manifest "+ref)
}

func (o offlineUpstream) HeadBlob(ctx context.Context, repo string, d digest.Digest) (int64, error) {
	return 0, o.miss(repo, "blob "+d.String())
}

func (o offlineUpstream) ListTags(ctx context.Context, repo string, n int, last string) (upstream.TagPage, error) {
	return upstream.TagPage{}, o.miss(repo, "the tag list")
}

func (o offlineUpstream) Referrers(ctx context.Context, repo string, subject digest.Digest) ([]json.RawMessage, error) {
	return nil, o.miss(repo, "the referrers of "+subject.String())
}

func (o offlineUpstream) FetchBlob(ctx context.Context, repo string, d digest.Digest, w content.Writer) (upstream.FetchReport, error) {
	return upstream.FetchReport{}, o.miss(repo, "blob "+d.String())
}

func (o offlineUpstream) ReportCorrupt(d digest.Digest, rep upstream.FetchReport, cause error) []spans.Span {
	return nil
}

func (o offlineUpstream) ReportVerified(d digest.Digest, rep upstream.FetchReport) {}
