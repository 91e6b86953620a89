package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/content"
	"github.com/pullproxy/pullproxy/upstream"
)

// The mirror core: what the mirror holds and fetches, as Go calls. The
// HTTP handlers answer clients with it, and what runs inside the process
// (seed, export, sync) calls it directly: the same downloads, checks and
// store as a client's pull, without HTTP in between.
//
// Each call names content as a client's request does: a configured
// upstream, a repository there, and a tag or digest. Unlike a client's
// request, a call is not subject to allow_clients.

// Manifest is a manifest or an index as the mirror serves it.
type Manifest struct {
	Digest    digest.Digest
	MediaType string
	Body      []byte
}

// ResolveTag returns what tag of repo at upstreamName points to: from the
// store while younger than the tag TTL, else asked of the upstream (and
// the stored answer when the upstream cannot give one).
func (s *Server) ResolveTag(ctx context.Context, upstreamName, repo, tag string) (upstream.Descriptor, error) {
	rt, err := s.routeFor(upstreamName, repo, kindManifest, tag)
	if err != nil {
		return upstream.Descriptor{}, err
	}
	return s.resolveTag(ctx, rt)
}

// CheckTag asks the upstream now what tag of repo at upstreamName points
// to (a HEAD of its manifest, where the upstream names the digest in it),
// whatever the tag TTL, records the answer as a client's lookup would, and
// returns it. A sync round asks it once per tag: when nothing moved, it is
// the round's only request for the tag.
func (s *Server) CheckTag(ctx context.Context, upstreamName, repo, tag string) (upstream.Descriptor, error) {
	rt, err := s.routeFor(upstreamName, repo, kindManifest, tag)
	if err != nil {
		return upstream.Descriptor{}, err
	}
	return s.refreshTag(ctx, rt)
}

// maxTagPages bounds the pages Tags follows: a million tags at 1000 a page.
const maxTagPages = 1000

// Tags returns every tag of repo at upstreamName, as the upstream lists
// them now, following its pages (n and last, as its Link header gives the
// next). The tag list clients are served, with its own TTL, is neither
// read nor written.
func (s *Server) Tags(ctx context.Context, upstreamName, repo string) ([]string, error) {
	return s.tagsPaged(ctx, upstreamName, repo, 1000)
}

func (s *Server) tagsPaged(ctx context.Context, upstreamName, repo string, n int) ([]string, error) {
	rt, err := s.routeFor(upstreamName, repo, kindTags, "")
	if err != nil {
		return nil, err
	}
	var tags []string
	last := ""
	for range maxTagPages {
		page, err := rt.up.ListTags(ctx, rt.repo, n, last)
		if err != nil {
			return nil, fmt.Errorf("listing the tags of %s/%s after %q: %w", upstreamName, repo, last, err)
		}
		tags = append(tags, page.Tags...)
		next := page.Next.Get("last")
		if next == "" || next == last || len(page.Tags) == 0 {
			return tags, nil
		}
		last = next
		if m, err := strconv.Atoi(page.Next.Get("n")); err == nil && m > 0 {
			n = m
		}
	}
	return nil, fmt.Errorf("listing the tags of %s/%s: more than %d pages", upstreamName, repo, maxTagPages)
}

// repositoryLister is what an upstream with a catalog adds (an offline
// upstream has none to ask).
type repositoryLister interface {
	ListRepositories(ctx context.Context, n int, last string) (upstream.RepositoryPage, error)
}

// Repositories returns the repositories the catalog of upstreamName lists
// now under prefix ("team/"; "": all), following its pages.
func (s *Server) Repositories(ctx context.Context, upstreamName, prefix string) ([]string, error) {
	up := s.upstreams[upstream.CanonicalName(upstreamName)]
	if up == nil {
		return nil, fmt.Errorf("listing the repositories of %s: no upstream of that name is configured", upstreamName)
	}
	lister, ok := up.(repositoryLister)
	if !ok {
		return nil, fmt.Errorf("listing the repositories of %s: it is offline", upstreamName)
	}
	var repos []string
	// No n at first: registries bound the page (distribution refuses more
	// than its maxentries, 100 by default) and say where the next one is.
	last, n := "", 0
	for range maxTagPages {
		page, err := lister.ListRepositories(ctx, n, last)
		if err != nil {
			return nil, fmt.Errorf("listing the repositories of %s after %q: %w", upstreamName, last, err)
		}
		for _, r := range page.Repositories {
			if strings.HasPrefix(r, prefix) {
				repos = append(repos, r)
			}
		}
		next := page.Next.Get("last")
		if next == "" || next == last || len(page.Repositories) == 0 {
			return repos, nil
		}
		last = next
		if m, err := strconv.Atoi(page.Next.Get("n")); err == nil && m > 0 {
			n = m
		}
	}
	return nil, fmt.Errorf("listing the repositories of %s: more than %d pages", upstreamName, maxTagPages)
}

// Manifest returns the manifest or index that ref (a tag or a digest)
// names in repo at upstreamName: from the store, or fetched, checked and
// stored.
func (s *Server) Manifest(ctx context.Context, upstreamName, repo, ref string) (Manifest, error) {
	rt, err := s.routeFor(upstreamName, repo, kindManifest, ref)
	if err != nil {
		return Manifest{}, err
	}
	m, _, err := s.manifest(ctx, rt)
	return m, err
}

// Referrers returns the descriptors of the manifests that refer to subject
// in repo at upstreamName (signatures, SBOMs).
func (s *Server) Referrers(ctx context.Context, upstreamName, repo string, subject digest.Digest) ([]ocispec.Descriptor, error) {
	rt, err := s.routeFor(upstreamName, repo, kindReferrers, subject.String())
	if err != nil {
		return nil, err
	}
	rec, _, err := s.referrers(ctx, rt, subject)
	if err != nil {
		return nil, err
	}
	out := make([]ocispec.Descriptor, 0, len(rec.Manifests))
	for _, raw := range rec.Manifests {
		var desc ocispec.Descriptor
		if err := json.Unmarshal(raw, &desc); err != nil {
			return nil, fmt.Errorf("the referrers of %s in %s/%s: %w", subject, upstreamName, repo, err)
		}
		out = append(out, desc)
	}
	return out, nil
}

// EnsureBlob makes sure blob d of repo at upstreamName is stored, and
// returns its size: at once when it is, else by joining its download, or
// starting one, and waiting until it is verified and committed. landed,
// when not nil, is told of the bytes as they land.
func (s *Server) EnsureBlob(ctx context.Context, upstreamName, repo string, d digest.Digest, landed func(n int64)) (int64, error) {
	rt, err := s.routeFor(upstreamName, repo, kindBlob, d.String())
	if err != nil {
		return 0, err
	}
	// A download that verified is committing while its waiters wake: the
	// next look finds it stored, or its join says so (errStored). One that
	// failed verification is started again at once (from another
	// endpoint, or the suspect's ranges from the others), and is joined.
	progress := landedOnce{landed: landed}
	// Looks: each failed verification (the suspect's ranges again, then
	// another endpoint), each errStored, and the last that finds it.
	for range 8 {
		size, err := s.blobs.StatBlob(ctx, d)
		switch v, err := s.blobAllowed(ctx, rt, false, err, true); v {
		case blobRefused:
			return 0, err
		case blobServe:
			return size, nil
		}
		p, own, err := s.downloads.join(ctx, rt, d)
		if errors.Is(err, errStored) {
			continue
		}
		if err != nil {
			return 0, err
		}
		err = waitLanded(ctx, p, progress.attempt())
		if errors.Is(err, storage.ErrDigestMismatch) && s.downloads.has(d) {
			continue
		}
		if err != nil {
			return 0, err
		}
		if own {
			s.addMember(ctx, rt, d)
		}
	}
	return 0, fmt.Errorf("blob %s: committed but not found in the store", d)
}

// landedOnce tells landed of a download's bytes as they land, each once
// across attempts: an attempt started again lands from byte 0.
type landedOnce struct {
	landed    func(n int64)
	told, off int64
}

// attempt returns what a new attempt's bytes are told to, nil when nobody
// listens.
func (l *landedOnce) attempt() func(int64) {
	if l.landed == nil {
		return nil
	}
	l.off = 0
	return l.add
}

func (l *landedOnce) add(n int64) {
	l.off += n
	if l.off > l.told {
		l.landed(l.off - l.told)
		l.told = l.off
	}
}

// waitLanded waits until every byte of the download p has landed and the
// whole verified (the last bytes are held back until it does).
func waitLanded(ctx context.Context, p content.Reader, landed func(n int64)) error {
	if _, err := p.WaitStarted(ctx); err != nil {
		return err
	}
	for off := int64(0); ; {
		n, err := p.WaitAvailable(ctx, off)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		off += n
		if landed != nil {
			landed(n)
		}
	}
}

// OpenBlob opens blob d of repo at upstreamName, stored, for reading, and
// returns its size; the caller closes it. It is storage.ErrNotFound when
// the store lacks it (EnsureBlob stores it), or, from an offline upstream,
// upstream.ErrNotFound naming the fix. The rules are a client's (see
// blobAllowed), but allow_clients.
func (s *Server) OpenBlob(ctx context.Context, upstreamName, repo string, d digest.Digest) (*os.File, int64, error) {
	rt, err := s.routeFor(upstreamName, repo, kindBlob, d.String())
	if err != nil {
		return nil, 0, err
	}
	f, size, err := s.blobs.OpenBlob(ctx, d)
	switch v, perr := s.blobAllowed(ctx, rt, false, err, true); v {
	case blobServe:
		return f, size, nil
	case blobMissing:
		return nil, 0, err // storage.ErrNotFound
	default:
		if f != nil {
			f.Close()
		}
		return nil, 0, perr
	}
}

// routeFor is the route to ref (of kind) in repo at upstreamName, for a
// call from the process.
func (s *Server) routeFor(upstreamName, repo, kind, ref string) (route, error) {
	up := s.upstreams[upstream.CanonicalName(upstreamName)]
	if up == nil {
		return route{}, &ociError{status: http.StatusNotFound, code: "NAME_UNKNOWN",
			message: fmt.Sprintf("pullproxy does not mirror %s: no upstream of that name is configured", upstreamName)}
	}
	return routeTo(up, repo, kind, ref)
}

// manifest returns rt's manifest, and whether it came from the store or
// the upstream (sourceCache, sourceUpstream).
func (s *Server) manifest(ctx context.Context, rt route) (Manifest, string, error) {
	var desc upstream.Descriptor
	byDigest := false
	if d, err := digest.Parse(rt.ref); err == nil {
		desc.Digest, byDigest = d, true
	} else if desc, err = s.resolveTag(ctx, rt); err != nil {
		return Manifest{}, "", err
	}
	// A tag of rt's repository names a digest of it; a digest asked for
	// by itself may be stored from another repository.
	body, mediaType, source, err := s.manifestContent(ctx, rt, desc.Digest, byDigest)
	if err != nil {
		return Manifest{}, "", err
	}
	if desc.MediaType != "" {
		mediaType = desc.MediaType
	}
	return Manifest{Digest: desc.Digest, MediaType: mediaType, Body: body}, source, nil
}
