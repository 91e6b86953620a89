package storage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/dgraph-io/badger/v4"
	"github.com/opencontainers/go-digest"
)

// Which repositories a stored digest belongs to.
//
// Content is stored once per digest, whichever upstream and repository it
// came through; it is served under an upstream and repository only when it
// is known to be there: declared by a manifest fetched for that repository
// (declared/ keys, see SetDeclaredSizes), or recorded as a member (member/
// keys): a manifest fetched there, a blob the upstream served or confirmed
// there. Without this, a blob fetched with one upstream's credentials would
// be served under any name, even one that does not exist upstream.

const memberPrefix = "member/"

func memberKey(upstream, repo string, d digest.Digest) []byte {
	return []byte(memberPrefix + upstream + "/" + repo + "@" + d.String())
}

// maxMembersCached bounds the memberships kept in memory. When full, the
// cache starts over: the records stay in the database.
const maxMembersCached = 1 << 18

// memberCache keeps the memberships found so far, by digest: the check
// runs on every blob served, the blob loop's included, and looks up
// without allocating.
type memberCache struct {
	mu sync.RWMutex
	m  map[digest.Digest][]memberOf
	n  int
}

type memberOf struct{ upstream, repo string }

func (c *memberCache) has(upstream, repo string, d digest.Digest) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, e := range c.m[d] {
		if e.repo == repo && e.upstream == upstream {
			return true
		}
	}
	return false
}

func (c *memberCache) add(upstream, repo string, d digest.Digest) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.m[d] {
		if e.repo == repo && e.upstream == upstream {
			return
		}
	}
	if c.m == nil || c.n >= maxMembersCached {
		c.m, c.n = map[digest.Digest][]memberOf{}, 0
	}
	// Cloned: the names may be slices of a request's path.
	d = digest.Digest(strings.Clone(string(d)))
	c.m[d] = append(c.m[d], memberOf{strings.Clone(upstream), strings.Clone(repo)})
	c.n++
}

// IsMember reports whether d is known to belong to upstream/repo.
func (s *Store) IsMember(ctx context.Context, upstream, repo string, d digest.Digest) (bool, error) {
	if s.members.has(upstream, repo, d) {
		return true, nil
	}
	found := false
	err := s.db.View(func(txn *badger.Txn) error {
		for _, key := range [][]byte{declaredKey(upstream, repo, d), memberKey(upstream, repo, d)} {
			_, err := txn.Get(key)
			if err == nil {
				found = true
				return nil
			}
			if !errors.Is(err, badger.ErrKeyNotFound) {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("looking up whether %s is in %s/%s: %w", d, upstream, repo, err)
	}
	if found {
		s.members.add(upstream, repo, d)
	}
	return found, nil
}

// AddMembers records that ds belong to upstream/repo.
func (s *Store) AddMembers(ctx context.Context, upstream, repo string, ds ...digest.Digest) error {
	if len(ds) == 0 {
		return nil
	}
	err := s.db.Update(func(txn *badger.Txn) error {
		for _, d := range ds {
			if err := txn.Set(memberKey(upstream, repo, d), nil); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("recording what %s/%s holds: %w", upstream, repo, err)
	}
	for _, d := range ds {
		s.members.add(upstream, repo, d)
	}
	return nil
}

// membersMigratedKey marks a store whose older records were given their
// membership (migrateMembers).
var membersMigratedKey = []byte("meta/members-migrated")

// migrateMembers gives a store filled before membership was recorded what
// its records imply, once: the digest each tag names is in that tag's
// repository, and so is a manifest that names, as its config, layers or
// platform manifests, digests declared for a repository. Without it, what
// such a store holds would be refused offline or with the upstream down
// until an upstream confirmed it.
func (s *Store) migrateMembers(ctx context.Context) error {
	done := false
	s.db.View(func(txn *badger.Txn) error {
		_, err := txn.Get(membersMigratedKey)
		done = err == nil
		return nil
	})
	if done {
		return nil
	}
	type member struct {
		upstream, repo string
		d              digest.Digest
	}
	var found []member
	declaredIn := map[digest.Digest][]memberOf{} // digest → the repositories declaring it
	var manifests []digest.Digest
	err := s.db.View(func(txn *badger.Txn) error {
		it := txn.NewIterator(badger.IteratorOptions{PrefetchValues: true, PrefetchSize: 100})
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			if err := ctx.Err(); err != nil {
				return err
			}
			key := string(it.Item().Key())
			switch {
			case strings.HasPrefix(key, tagPrefix):
				rest := key[len(tagPrefix):]
				i := strings.LastIndexByte(rest, ':')
				j := strings.IndexByte(rest, '/')
				if i < 0 || j < 0 || j > i {
					continue
				}
				var rec TagRecord
				if it.Item().Value(func(b []byte) error { return json.Unmarshal(b, &rec) }) == nil && rec.Digest != "" {
					found = append(found, member{rest[:j], rest[j+1 : i], rec.Digest})
				}
			case strings.HasPrefix(key, declaredPrefix):
				rest := key[len(declaredPrefix):]
				i := strings.LastIndexByte(rest, '@')
				j := strings.IndexByte(rest, '/')
				if i < 0 || j < 0 || j > i {
					continue
				}
				d := digest.Digest(rest[i+1:])
				declaredIn[d] = append(declaredIn[d], memberOf{rest[:j], rest[j+1 : i]})
			case strings.HasPrefix(key, blobPrefix):
				var rec BlobRecord
				if it.Item().Value(func(b []byte) error { return json.Unmarshal(b, &rec) }) == nil && rec.MediaType != "" {
					manifests = append(manifests, digest.Digest(key[len(blobPrefix):]))
				}
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("giving older records their repositories: %w", err)
	}
	for _, d := range manifests {
		named := map[digest.Digest]bool{}
		// One level down: what d itself names.
		if err := s.manifestDigests(ctx, d, named, maxPinnedManifestDepth-1); err != nil {
			continue
		}
		for child := range named {
			for _, in := range declaredIn[child] {
				found = append(found, member{in.upstream, in.repo, d})
			}
		}
	}
	err = s.db.Update(func(txn *badger.Txn) error {
		for _, m := range found {
			if err := txn.Set(memberKey(m.upstream, m.repo, m.d), nil); err != nil {
				return err
			}
		}
		return txn.Set(membersMigratedKey, []byte(time.Now().UTC().Format(time.RFC3339)))
	})
	if err != nil {
		return fmt.Errorf("giving older records their repositories: %w", err)
	}
	if len(found) > 0 {
		s.log.Info("older records given their repositories", "records", len(found))
	}
	return nil
}
