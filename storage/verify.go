package storage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dgraph-io/badger/v4"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"
)

// Problem kinds Verify reports.
const (
	ProblemDamaged   = "damaged"    // the file's content does not hash to its digest
	ProblemTruncated = "wrong size" // the file's size is not the one committed
	ProblemStray     = "stray file" // a file under blobs/ that is not named as a blob
	ProblemUnrecord  = "no record"  // a blob file without its metadata record
	ProblemNoFile    = "no file"    // a metadata record without its blob file
	ProblemRebuilt   = "rebuilt"    // the metadata database was damaged and rebuilt
)

// Problem is one thing Verify found wrong.
type Problem struct {
	Kind   string
	Digest digest.Digest // empty for a stray file
	Path   string        // the file, where there is one
	Detail string
	// Repaired says what repair did about it, when it did something.
	Repaired string
}

// VerifyOptions tunes Verify.
type VerifyOptions struct {
	Repair   bool // quarantine damaged blobs, remove stray files, fix records
	Parallel int  // files hashed at once; default 4
	// Progress, when set, is called now and then with the bytes hashed so
	// far and the bytes to hash in all.
	Progress func(done, total int64)
}

// Verify re-hashes every blob the store holds and checks the files against
// the metadata: damaged and wrongly sized blobs, stray files, blobs without
// records and records without blobs. With Repair, a damaged or wrongly
// sized blob is quarantined (and fetched again when asked for), a stray
// file removed, a missing record written from the verified file, and a
// record without its file removed. It returns what it found, in no
// particular order. It runs while no server uses the data dir: Open
// refuses a data dir in use.
func (s *Store) Verify(ctx context.Context, opts VerifyOptions) ([]Problem, error) {
	type blobFile struct {
		d    digest.Digest
		path string
		size int64
	}
	var files []blobFile
	var problems []Problem
	var mu sync.Mutex
	report := func(p Problem) {
		mu.Lock()
		problems = append(problems, p)
		mu.Unlock()
	}
	var total int64
	err := s.walkBlobs(func(d digest.Digest, path string) error {
		fi, err := os.Stat(path)
		if err != nil {
			return nil // gone meanwhile
		}
		files = append(files, blobFile{d: d, path: path, size: fi.Size()})
		total += fi.Size()
		return nil
	}, func(path string) error {
		p := Problem{Kind: ProblemStray, Path: path, Detail: "not named as a blob of the store"}
		if opts.Repair {
			if err := os.Remove(path); err != nil {
				return fmt.Errorf("removing stray file %s: %w", path, err)
			}
			p.Repaired = "removed"
		}
		report(p)
		return nil
	})
	if err != nil {
		return problems, fmt.Errorf("listing blobs: %w", err)
	}

	var done atomic.Int64
	stopProgress := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		if opts.Progress == nil {
			return
		}
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				opts.Progress(done.Load(), total)
			case <-stopProgress:
				opts.Progress(done.Load(), total)
				return
			}
		}
	}()
	g, gctx := errgroup.WithContext(ctx)
	limit := opts.Parallel
	if limit <= 0 {
		limit = 4
	}
	g.SetLimit(limit)
	for _, f := range files {
		g.Go(func() error {
			count := func(r io.Reader) io.Reader { return &ctxReader{ctx: gctx, r: r, done: &done} }
			p, err := s.verifyBlob(gctx, f.d, f.path, count, opts.Repair)
			if p != nil {
				report(*p)
			}
			return err
		})
	}
	err = g.Wait()
	close(stopProgress)
	<-progressDone
	if err != nil {
		return problems, err
	}

	// Records whose file is gone.
	var gone []digest.Digest
	err = s.db.View(func(txn *badger.Txn) error {
		it := txn.NewIterator(badger.IteratorOptions{Prefix: []byte(blobPrefix)})
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			d := digest.Digest(it.Item().Key()[len(blobPrefix):])
			if validate(d) != nil {
				gone = append(gone, d)
				continue
			}
			if _, err := os.Stat(s.blobPath(d)); errors.Is(err, fs.ErrNotExist) {
				gone = append(gone, d)
			}
		}
		return nil
	})
	if err != nil {
		return problems, fmt.Errorf("reading blob records: %w", err)
	}
	for _, d := range gone {
		p := Problem{Kind: ProblemNoFile, Digest: d, Detail: "the metadata records a blob whose file is missing"}
		if opts.Repair {
			if err := s.db.Update(func(txn *badger.Txn) error { return txn.Delete(blobKey(d)) }); err != nil {
				return problems, fmt.Errorf("removing the record of %s: %w", d, err)
			}
			s.sizes.Delete(d)
			p.Repaired = "record removed"
		}
		report(p)
	}
	return problems, nil
}

// walkBlobs calls blob for every blob file of the store, and stray, when
// not nil, for every other file under blobs/.
func (s *Store) walkBlobs(blob func(d digest.Digest, path string) error, stray func(path string) error) error {
	return filepath.WalkDir(s.blobs, func(path string, e fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // removed meanwhile
		}
		if err != nil || e.IsDir() {
			return err
		}
		alg := filepath.Base(filepath.Dir(filepath.Dir(path)))
		d := digest.NewDigestFromEncoded(digest.Algorithm(alg), filepath.Base(path))
		if validate(d) != nil || s.blobPath(d) != path || !e.Type().IsRegular() {
			if stray != nil {
				return stray(path)
			}
			return nil
		}
		return blob(d, path)
	})
}

// verifyBlob hashes one blob file, read through wrap(file), and checks it
// against its record; with repair, it quarantines a damaged blob (to be
// fetched again) and writes or corrects the record of a verified one. It
// is what verify and the scrubber share.
func (s *Store) verifyBlob(ctx context.Context, d digest.Digest, path string, wrap func(io.Reader) io.Reader, repair bool) (*Problem, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil // evicted or quarantined meanwhile
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h := d.Algorithm().Hash()
	n, err := io.Copy(h, wrap(f))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	fd := int(f.Fd())
	if got := digest.NewDigest(d.Algorithm(), h); got != d {
		p := &Problem{Kind: ProblemDamaged, Digest: d, Path: path, Detail: "its content hashes to " + got.String()}
		if repair {
			s.quarantine(d, fd, p.Detail)
			p.Repaired = "quarantined, to be fetched again"
		}
		return p, nil
	}
	want, recorded := s.recordedSize(d)
	switch {
	case recorded && want != n:
		// The content hashes right: the record is what is wrong.
		p := &Problem{Kind: ProblemTruncated, Digest: d, Path: path,
			Detail: fmt.Sprintf("the file holds %d bytes and verifies, the record says %d", n, want)}
		if repair {
			if err := s.recordBlob(ctx, d, n); err != nil {
				return nil, err
			}
			p.Repaired = "record corrected"
		}
		return p, nil
	case !recorded:
		p := &Problem{Kind: ProblemUnrecord, Digest: d, Path: path, Detail: "a verified blob without its metadata record"}
		if repair {
			if err := s.recordBlob(ctx, d, n); err != nil {
				return nil, err
			}
			p.Repaired = "record written"
		}
		return p, nil
	}
	return nil, nil
}

// ctxReader reads r until ctx ends, counting what it read into done.
type ctxReader struct {
	ctx  context.Context
	r    io.Reader
	done *atomic.Int64
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	n, err := c.r.Read(p)
	c.done.Add(int64(n))
	return n, err
}

// OpenForRepair opens the store under dir as Open does, and when its
// metadata database is damaged, moves it aside (meta.broken-<time>) and
// starts an empty one, reporting that it did: Verify with Repair then
// writes the records of the blobs it verifies.
func OpenForRepair(ctx context.Context, dir string, opts ...Option) (*Store, *Problem, error) {
	s, err := Open(ctx, dir, opts...)
	if !errors.Is(err, ErrMetadataDamaged) {
		return s, nil, err
	}
	meta := filepath.Join(dir, "meta")
	aside := meta + ".broken-" + time.Now().UTC().Format("20060102T150405Z")
	if rerr := os.Rename(meta, aside); rerr != nil {
		return nil, nil, fmt.Errorf("%w; moving it aside: %w", err, rerr)
	}
	s, err = Open(ctx, dir, opts...)
	if err != nil {
		return nil, nil, err
	}
	return s, &Problem{Kind: ProblemRebuilt, Path: meta, Detail: "the metadata database could not be opened",
		Repaired: "moved to " + aside + "; records rebuilt from the verified blobs, tags learned again from the upstreams"}, nil
}
