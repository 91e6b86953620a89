package storage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dgraph-io/badger/v4"
	"github.com/dgraph-io/ristretto/v2/z"
	"github.com/opencontainers/go-digest"
)

// Keys in the metadata database:
//
//	tag/<upstream>/<repository>:<tag>  → TagRecord
//	taglist/<upstream>/<repo>?<query>  → TagListRecord
//	blob/<digest>                      → BlobRecord
//	declared/<upstream>/<repo>@<digest> → size a manifest of that repository declares
//	member/<upstream>/<repo>@<digest>  → (empty) the digest is in that repository (members.go)
//	referrers/<upstream>/<repo>@<digest> → ReferrersRecord
//	partial/<digest>                   → a download's progress (checkpoint.go)
//	sync/<rule id>                     → what a sync rule keeps cached (syncstate.go)
const (
	tagPrefix       = "tag/"
	tagListPrefix   = "taglist/"
	blobPrefix      = "blob/"
	declaredPrefix  = "declared/"
	referrersPrefix = "referrers/"
)

// touchInterval bounds how often serving a blob rewrites its last-access
// time: eviction needs hours of resolution, not one write per request.
const touchInterval = time.Hour

// TagRecord is what a tag resolved to upstream, and when that was last checked.
type TagRecord struct {
	Digest    digest.Digest `json:"digest"`
	MediaType string        `json:"mediaType"`
	Size      int64         `json:"size"`
	CheckedAt time.Time     `json:"checkedAt"`
}

// BlobRecord describes a stored blob. MediaType is set for manifests.
type BlobRecord struct {
	Size       int64     `json:"size"`
	MediaType  string    `json:"mediaType,omitempty"`
	LastAccess time.Time `json:"lastAccess"`
	// Evicting marks a blob being evicted: its file is removed, then this
	// record (see evict.go).
	Evicting bool `json:"evicting,omitempty"`
}

func openMeta(dir string, log *slog.Logger) (*badger.DB, error) {
	// Small tables: the metadata is a few hundred bytes per image, and the
	// defaults (64 MiB memtables) would dominate the process's memory.
	opts := badger.DefaultOptions(dir).
		WithLogger(badgerLogger{log}).
		WithMemTableSize(8 << 20).
		WithValueLogFileSize(64 << 20).
		WithBlockCacheSize(8 << 20).
		WithIndexCacheSize(4 << 20).
		WithNumCompactors(2).
		WithSyncWrites(true)
	if inUse(dir) {
		return nil, fmt.Errorf("opening metadata database %s: %w: another process holds it "+
			"(a pullproxy serving this data dir?): stop it first, or give this one a data dir of its own", dir, ErrInUse)
	}
	removeEmptyMemtables(dir, log)
	db, err := badger.Open(opts)
	if err != nil && strings.Contains(err.Error(), z.NewFile.Error()) { // Badger formats it away
		// An empty value log left by a kill as Badger created it: the
		// failed Open has sized it, and a second one opens it
		// (dgraph-io/badger#2207).
		log.Warn("metadata database: a value log file left empty by a crash; opening again", "err", err)
		db, err = badger.Open(opts)
	}
	if err != nil {
		// Not in use, so damaged: a crash of the file system, a disk
		// that filled up at the wrong moment, an edit. The blobs do not
		// depend on it.
		return nil, fmt.Errorf("opening metadata database %s: %w: %v; the blob files do not depend on it: "+
			"`pullproxy verify --repair` moves it aside and rebuilds it from them (or mv %s %s.broken and start again); "+
			"tags are learned again from the upstreams, downloads in progress start over", dir, ErrMetadataDamaged, err, dir, dir)
	}
	return db, nil
}

// removeEmptyMemtables removes the empty memtable files a kill can leave
// in dir when it lands between Badger creating one and sizing it: Badger's
// Open refuses to start on one (dgraph-io/badger#2207), and an empty
// memtable holds nothing.
func removeEmptyMemtables(dir string, log *slog.Logger) {
	paths, _ := filepath.Glob(filepath.Join(dir, "*.mem"))
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil && fi.Size() == 0 {
			if err := os.Remove(p); err == nil {
				log.Warn("metadata database: removed an empty memtable file a crash left", "file", filepath.Base(p))
			}
		}
	}
}

func tagKey(upstream, repo, tag string) []byte {
	return []byte(tagPrefix + upstream + "/" + repo + ":" + tag)
}

func blobKey(d digest.Digest) []byte { return []byte(blobPrefix + d.String()) }

// Tag returns what upstream/repo:tag last resolved to, or ErrNotFound.
func (s *Store) Tag(ctx context.Context, upstream, repo, tag string) (TagRecord, error) {
	var rec TagRecord
	err := s.get(tagKey(upstream, repo, tag), &rec)
	if err != nil {
		return rec, fmt.Errorf("tag %s/%s:%s: %w", upstream, repo, tag, err)
	}
	return rec, nil
}

// PutTag records what upstream/repo:tag resolves to.
func (s *Store) PutTag(ctx context.Context, upstream, repo, tag string, rec TagRecord) error {
	if err := s.put(tagKey(upstream, repo, tag), rec); err != nil {
		return fmt.Errorf("recording tag %s/%s:%s: %w", upstream, repo, tag, err)
	}
	return nil
}

// TagListRecord is a page of a repository's tag list as its upstream gave
// it, and when.
type TagListRecord struct {
	Tags      []string  `json:"tags"`
	Next      string    `json:"next,omitempty"` // the next page's query (n, last), encoded; empty on the last
	CheckedAt time.Time `json:"checkedAt"`
}

func tagListKey(upstream, repo, query string) []byte {
	return []byte(tagListPrefix + upstream + "/" + repo + "?" + query)
}

// TagList returns the page of upstream/repo's tag list that query (n,
// last, encoded) selects, as last recorded, or ErrNotFound.
func (s *Store) TagList(ctx context.Context, upstream, repo, query string) (TagListRecord, error) {
	var rec TagListRecord
	if err := s.get(tagListKey(upstream, repo, query), &rec); err != nil {
		return rec, fmt.Errorf("tag list of %s/%s?%s: %w", upstream, repo, query, err)
	}
	return rec, nil
}

// PutTagList records a page of upstream/repo's tag list.
func (s *Store) PutTagList(ctx context.Context, upstream, repo, query string, rec TagListRecord) error {
	if err := s.put(tagListKey(upstream, repo, query), rec); err != nil {
		return fmt.Errorf("recording the tag list of %s/%s?%s: %w", upstream, repo, query, err)
	}
	return nil
}

// ReferrersRecord is the referrers of a subject as an upstream gave them:
// the descriptors of the manifests that refer to it, as the upstream wrote
// them, from its referrers API or, for an upstream without one, from the
// subject's tag-schema index; and when.
type ReferrersRecord struct {
	Manifests []json.RawMessage `json:"manifests"`
	TagSchema bool              `json:"tagSchema,omitempty"` // read from the tag-schema index
	CheckedAt time.Time         `json:"checkedAt"`
}

func referrersKey(upstream, repo string, subject digest.Digest) []byte {
	return []byte(referrersPrefix + upstream + "/" + repo + "@" + subject.String())
}

// Referrers returns what upstream/repo's referrers API last answered for
// subject, or ErrNotFound.
func (s *Store) Referrers(ctx context.Context, upstream, repo string, subject digest.Digest) (ReferrersRecord, error) {
	var rec ReferrersRecord
	if err := s.get(referrersKey(upstream, repo, subject), &rec); err != nil {
		return rec, fmt.Errorf("referrers of %s in %s/%s: %w", subject, upstream, repo, err)
	}
	return rec, nil
}

// PutReferrers records what upstream/repo's referrers API answered for subject.
func (s *Store) PutReferrers(ctx context.Context, upstream, repo string, subject digest.Digest, rec ReferrersRecord) error {
	if err := s.put(referrersKey(upstream, repo, subject), rec); err != nil {
		return fmt.Errorf("recording the referrers of %s in %s/%s: %w", subject, upstream, repo, err)
	}
	return nil
}

// Blob returns the record of a stored blob, or ErrNotFound.
func (s *Store) Blob(ctx context.Context, d digest.Digest) (BlobRecord, error) {
	var rec BlobRecord
	if err := s.get(blobKey(d), &rec); err != nil {
		return rec, fmt.Errorf("blob record %s: %w", d, err)
	}
	return rec, nil
}

// SetMediaType records the media type of a stored manifest.
func (s *Store) SetMediaType(ctx context.Context, d digest.Digest, mediaType string) error {
	return s.update(blobKey(d), func(rec *BlobRecord) bool {
		if rec.MediaType == mediaType {
			return false
		}
		rec.MediaType = mediaType
		return true
	})
}

// SetDeclaredSizes records the sizes a manifest of upstream/repo declares
// for blobs, so that a download knows what to expect before the upstream
// says anything. They are kept per repository: a manifest elsewhere that
// declares a wrong size for the same digest must not decide how it is
// fetched for this one.
func (s *Store) SetDeclaredSizes(ctx context.Context, upstream, repo string, sizes map[digest.Digest]int64) error {
	if len(sizes) == 0 {
		return nil
	}
	err := s.db.Update(func(txn *badger.Txn) error {
		for d, n := range sizes {
			if err := txn.Set(declaredKey(upstream, repo, d), []byte(strconv.FormatInt(n, 10))); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("recording declared sizes: %w", err)
	}
	for d := range sizes {
		s.members.add(upstream, repo, d)
	}
	return nil
}

func declaredKey(upstream, repo string, d digest.Digest) []byte {
	return []byte(declaredPrefix + upstream + "/" + repo + "@" + d.String())
}

// DeclaredSize returns the size a manifest of upstream/repo declared for d,
// or ErrNotFound.
func (s *Store) DeclaredSize(ctx context.Context, upstream, repo string, d digest.Digest) (int64, error) {
	var n int64
	err := s.db.View(func(txn *badger.Txn) error {
		item, err := txn.Get(declaredKey(upstream, repo, d))
		if errors.Is(err, badger.ErrKeyNotFound) {
			return ErrNotFound
		}
		if err != nil {
			return err
		}
		return item.Value(func(b []byte) error {
			n, err = strconv.ParseInt(string(b), 10, 64)
			return err
		})
	})
	if err != nil {
		return -1, fmt.Errorf("declared size of %s: %w", d, err)
	}
	return n, nil
}

// Touch records that d was served now. It writes at most once per hour per blob.
func (s *Store) Touch(ctx context.Context, d digest.Digest) error {
	now := time.Now()
	return s.update(blobKey(d), func(rec *BlobRecord) bool {
		// No record (LastAccess is set whenever one is written): the blob
		// was evicted meanwhile, and a record alone would outlive it.
		if rec.LastAccess.IsZero() || now.Sub(rec.LastAccess) < touchInterval {
			return false
		}
		rec.LastAccess = now
		return true
	})
}

func (s *Store) recordBlob(ctx context.Context, d digest.Digest, size int64) error {
	now := time.Now()
	s.sizes.Store(d, size)
	var prev int64
	existed := false
	err := s.update(blobKey(d), func(rec *BlobRecord) bool {
		prev, existed = rec.Size, !rec.LastAccess.IsZero()
		rec.Size = size
		rec.LastAccess = now
		rec.Evicting = false // committed again: an eviction in progress leaves it
		return true
	})
	if err != nil {
		return err
	}
	s.storedBytes.Add(size - prev)
	if !existed {
		s.storedBlobs.Add(1)
	}
	s.evictAfterCommit(ctx, d)
	return nil
}

// update applies change to the record under key in one transaction, writing
// only when change reports a difference.
func (s *Store) update(key []byte, change func(*BlobRecord) bool) error {
	// Two updates of one record at once (a commit and a last-access flush)
	// conflict, and the later is to be run again on what the first wrote.
	var err error
	for range 3 {
		if err = s.updateOnce(key, change); !errors.Is(err, badger.ErrConflict) {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("updating %s: %w", key, err)
	}
	return nil
}

func (s *Store) updateOnce(key []byte, change func(*BlobRecord) bool) error {
	return s.db.Update(func(txn *badger.Txn) error {
		var rec BlobRecord
		if err := getTxn(txn, key, &rec); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		if !change(&rec) {
			return nil
		}
		b, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		return txn.Set(key, b)
	})
}

func (s *Store) get(key []byte, v any) error {
	return s.db.View(func(txn *badger.Txn) error { return getTxn(txn, key, v) })
}

func getTxn(txn *badger.Txn, key []byte, v any) error {
	item, err := txn.Get(key)
	if errors.Is(err, badger.ErrKeyNotFound) {
		return ErrNotFound
	}
	if err != nil {
		return err
	}
	return item.Value(func(b []byte) error { return json.Unmarshal(b, v) })
}

func (s *Store) put(key []byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return s.db.Update(func(txn *badger.Txn) error { return txn.Set(key, b) })
}

// badgerLogger sends Badger's chatter to slog; its info lines are routine
// compaction notes, so they go out at debug.
type badgerLogger struct{ log *slog.Logger }

func (l badgerLogger) Errorf(f string, a ...any)   { l.logf(slog.LevelError, f, a) }
func (l badgerLogger) Warningf(f string, a ...any) { l.logf(slog.LevelWarn, f, a) }
func (l badgerLogger) Infof(f string, a ...any)    { l.logf(slog.LevelDebug, f, a) }
func (l badgerLogger) Debugf(f string, a ...any)   { l.logf(slog.LevelDebug, f, a) }

// logf formats a line only when it is to be logged: Badger writes a few
// debug lines for every write batch.
func (l badgerLogger) logf(level slog.Level, f string, a []any) {
	ctx := context.Background()
	if l.log.Enabled(ctx, level) {
		l.log.Log(ctx, level, strings.TrimSpace(fmt.Sprintf(f, a...)), "component", "badger")
	}
}

// Repositories returns the repositories the store knows, as
// "<upstream>/<repo>", sorted: those with a tag resolved, a tag list, or
// a manifest whose sizes were recorded (pulled by digest), content
// recorded as theirs.
func (s *Store) Repositories(ctx context.Context) ([]string, error) {
	seen := map[string]bool{}
	err := s.db.View(func(txn *badger.Txn) error {
		for _, p := range []struct{ prefix, sep string }{{tagPrefix, ":"}, {tagListPrefix, "?"}, {declaredPrefix, "@"}, {memberPrefix, "@"}} {
			it := txn.NewIterator(badger.IteratorOptions{Prefix: []byte(p.prefix)})
			for it.Rewind(); it.Valid(); it.Next() {
				if err := ctx.Err(); err != nil {
					it.Close()
					return err
				}
				key := string(it.Item().Key()[len(p.prefix):])
				if i := strings.LastIndex(key, p.sep); i > 0 {
					seen[key[:i]] = true
				}
			}
			it.Close()
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("listing repositories: %w", err)
	}
	return slices.Sorted(maps.Keys(seen)), nil
}
