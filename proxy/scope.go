package proxy

import (
	"context"
	"errors"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/upstream"
)

// Repository scoping. Content is stored once per digest, but served under
// an upstream and repository only when it is known to be there: named by a
// manifest fetched for that repository, served by the upstream for it, or
// confirmed by the upstream once (a HEAD, remembered). Otherwise a blob
// fetched with one upstream's credentials would be served under another
// upstream's name, or under a repository that does not exist.

// inRepository returns nil when d, stored or being downloaded, may be
// served under rt's upstream and repository; else why not: the upstream's
// own answer when it says d is not there (a 404), or its failure when it
// cannot say. kind is kindBlob or kindManifest.
func (s *Server) inRepository(ctx context.Context, rt route, kind string, d digest.Digest) error {
	known, err := s.members.IsMember(ctx, rt.up.Name(), rt.repo, d)
	if known {
		return nil
	}
	return s.confirmInRepository(ctx, rt, kind, d, err)
}

// confirmInRepository is inRepository once the store did not record d as
// rt's (lookupErr: why it could not say, if that is why): it asks the
// upstream, and remembers its answer.
func (s *Server) confirmInRepository(ctx context.Context, rt route, kind string, d digest.Digest, lookupErr error) error {
	name := rt.up.Name()
	if lookupErr != nil {
		s.log.Warn("reading what a repository holds: asking the upstream", "err", lookupErr)
	}
	if o, ok := rt.up.(offlineUpstream); ok {
		return o.miss(rt.repo, kind+" "+d.String()) // nobody to ask
	}
	key := "member " + name + "/" + rt.repo + "@" + d.String()
	if err, ok := s.notFound.get(key); ok {
		return err
	}
	_, err, _ := s.shared(ctx, key, func(ctx context.Context) (any, error) {
		var err error
		if kind == kindManifest {
			_, err = rt.up.HeadManifest(ctx, rt.repo, d.String(), allManifestTypes)
			if errors.Is(err, upstream.ErrInvalid) { // no HEAD there
				_, _, err = rt.up.GetManifest(ctx, rt.repo, d.String(), allManifestTypes)
			}
		} else {
			_, err = rt.up.HeadBlob(ctx, rt.repo, d)
		}
		if err != nil {
			return nil, err
		}
		s.addMember(ctx, rt, d)
		return nil, nil
	})
	if errors.Is(err, upstream.ErrNotFound) {
		s.notFound.put(key, err)
		s.log.Info("refused stored content under a repository the upstream says does not hold it",
			"upstream", name, "repo", rt.repo, "digest", d)
	}
	return err
}

// addMember records that d is in rt's repository, unless known already.
// A failure to record costs a HEAD upstream the next time: it is logged.
func (s *Server) addMember(ctx context.Context, rt route, d digest.Digest) {
	name := rt.up.Name()
	if known, _ := s.members.IsMember(ctx, name, rt.repo, d); known {
		return
	}
	if err := s.members.AddMembers(ctx, name, rt.repo, d); err != nil {
		s.log.Warn("recording a digest as a repository's", "upstream", name, "repo", rt.repo, "digest", d, "err", err)
	}
}

// ownOrInRepository is inRepository for a running download: one started
// for rt's own upstream and repository needs no check.
func (s *Server) ownOrInRepository(ctx context.Context, rt route, d digest.Digest, own bool) error {
	if own {
		return nil
	}
	return s.inRepository(ctx, rt, kindBlob, d)
}
