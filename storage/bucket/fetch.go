package bucket

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/content"
)

// Source is where a fetch got a blob's bytes.
type Source string

const (
	SourceBucket   Source = "bucket"   // the blob was in the bucket whole
	SourceFollowed Source = "followed" // another replica's download, part by part as it uploaded them
	SourceUpstream Source = "upstream" // this replica held the lease and fetched it
)

// Fetch is a blob download that went through the bucket.
type Fetch struct {
	Source Source
	b      *Bucket
	d      digest.Digest
	h      *holding         // the lease, while this replica uploads
	up     *uploader        // the upload of the parts, while this replica holds the lease
	small  content.Download // a small blob fetched without a lease, to upload whole
	// fromBucket: bytes read from the bucket went into the download, so a
	// digest mismatch may be theirs rather than the upstream's.
	fromBucket bool
}

// FromBucket reports whether bytes of the download came from the bucket:
// when it then fails verification, they, not the upstream, may be to
// blame, and the download is to be made again without the bucket.
func (f *Fetch) FromBucket() bool { return f != nil && f.fromBucket }

// smallBlob is the size under which a blob is fetched without a lease and
// uploaded whole once verified: two replicas fetching one at once waste
// less than the lease's requests would cost.
const smallBlob = 1 << 20

// Fetch fills dl with its blob, going to the upstream only when no replica
// has it or is fetching it:
//
//   - a blob in the bucket is read from there;
//   - a blob another replica is fetching is read part by part as that
//     replica uploads them, until it finishes, or stops renewing its lease:
//     this replica then takes the lease over and goes on from the parts
//     uploaded;
//   - else this replica takes the lease, runs fetch (the upstream into dl),
//     and uploads dl's bytes part by part as they arrive.
//
// confirm is called before bytes from the bucket are used: they were
// fetched for some repository, maybe not the one dl is for. Once Fetch
// returns, dl's owner commits it and tells the result to Finish.
//
// Whenever the bucket fails (unreachable, refusing, a part missing, not
// answering in time), or while it is degraded, fetch runs alone from what
// dl holds: the replica works on without sharing.
func (b *Bucket) Fetch(ctx context.Context, dl content.Download, confirm func(context.Context) error, fetch func(context.Context) error) (*Fetch, error) {
	d := dl.Digest()
	f := &Fetch{Source: SourceUpstream, b: b, d: d}
	if b.Degraded() {
		b.metrics.blobs.WithLabelValues(string(SourceUpstream)).Inc()
		return f, fetch(ctx)
	}
	confirmed := false
	check := func() error {
		if confirmed {
			return nil
		}
		if err := confirm(ctx); err != nil {
			return err
		}
		confirmed, f.fromBucket = true, true // bytes from the bucket follow
		return nil
	}
	alone := func(reason error) (*Fetch, error) {
		class, fix := Diagnose(reason)
		b.log.Warn("the shared bucket failed for this blob: fetching it from the upstream without sharing it",
			"digest", d, "class", class, "err", reason, "fix", fix)
		b.metrics.blobs.WithLabelValues(string(SourceUpstream)).Inc()
		return f, fetch(ctx)
	}

	// From scratch, or over a lease found released or expired.
	from, ifMatch := lease{Size: dl.Size()}, ""
	for attempt := 0; ; attempt++ {
		if attempt == 100 {
			return alone(fmt.Errorf("%w: the lease of %s changed hands 100 times", errUnusable, d))
		}
		found, err := b.fromBlob(ctx, dl, check)
		switch {
		case found && err == nil:
			f.Source = SourceBucket
			b.metrics.blobs.WithLabelValues(string(SourceBucket)).Inc()
			return f, nil
		case errors.Is(err, errUnusable):
			return alone(err)
		case err != nil:
			return nil, err
		}
		if size := dl.Size(); attempt == 0 && size >= 0 && size < smallBlob {
			if err := fetch(ctx); err != nil {
				return nil, err
			}
			f.small = dl
			b.metrics.blobs.WithLabelValues(string(SourceUpstream)).Inc()
			return f, nil
		}
		if from.PartSize == 0 && from.Size >= 0 {
			from.PartSize = b.partSizeFor(from.Size)
		}
		h, err := b.take(ctx, b.blobLease(d), from, ifMatch)
		if err == nil {
			if ifMatch != "" {
				b.metrics.takeover.Inc()
				b.log.Info("took over a blob download from another replica", "digest", d,
					"parts_uploaded", from.count(), "previous_holder", from.Holder)
			}
			return b.hold(ctx, f, dl, h, check, fetch)
		}
		if !errors.Is(err, errPrecondition) {
			return alone(err)
		}
		cur, err := b.readLease(ctx, b.blobLease(d))
		switch {
		case errors.Is(err, storage.ErrNotFound): // released and deleted meanwhile
			from, ifMatch = lease{Size: dl.Size()}, ""
			continue
		case err != nil:
			return alone(err)
		case cur.Holder == "": // released: its parts are for the taking
			from, ifMatch = cur.lease, cur.etag
			continue
		}
		if err := check(); err != nil {
			return nil, err
		}
		done, next, err := b.follow(ctx, dl, cur)
		switch {
		case errors.Is(err, errUnusable):
			return alone(err)
		case err != nil:
			return nil, err
		case done:
			f.Source = SourceFollowed
			b.metrics.blobs.WithLabelValues(string(SourceFollowed)).Inc()
			return f, nil
		}
		from, ifMatch = next.lease, next.etag
		if next.etag == "" {
			from = lease{Size: dl.Size()}
		}
	}
}

// hold runs the download with the lease held: the parts already in the
// bucket first (a download taken over), then the upstream for the rest,
// while the uploader sends dl's bytes to the bucket, all of them: parts
// other replicas uploaded are replaced by this replica's own bytes, which
// its commit verifies, so the blob assembled is only ever bytes verified.
func (b *Bucket) hold(ctx context.Context, f *Fetch, dl content.Download, h *holding, check func() error, fetch func(context.Context) error) (*Fetch, error) {
	if l := h.current(); l.count() > 0 {
		if err := check(); err != nil {
			h.release(ctx)
			return nil, err
		}
		if l.Size >= 0 && dl.Size() != l.Size {
			if err := dl.SetSize(l.Size); err != nil {
				h.release(ctx)
				return nil, fmt.Errorf("taking over the download of %s: %w", f.d, err)
			}
		}
		for i := range l.numParts() {
			if !l.uploaded(i) {
				continue
			}
			if err := b.fillPart(ctx, dl, l, i); err != nil {
				// The upstream brings those bytes instead; followers
				// stop looking for the part until it is uploaded again.
				b.log.Warn("reading a part another replica uploaded: fetching its bytes from the upstream", "digest", f.d, "part", i, "err", err)
				h.update(func(l *lease) { l.clearUploaded(i) })
			}
		}
	}
	up := b.upload(ctx, dl, h)
	if err := fetch(ctx); err != nil {
		up.stop()
		h.release(ctx)
		return nil, err
	}
	f.h, f.up = h, up
	b.metrics.blobs.WithLabelValues(string(SourceUpstream)).Inc()
	return f, nil
}

// Finish ends the fetch once dl's owner has committed it (committed nil)
// or failed to. A blob this replica fetched and verified is assembled in
// the bucket from its parts, and the lease and parts removed. When the
// bytes were wrong, what they came from is removed: the parts of this
// replica's upload, or the blob in the bucket it read. Else the lease is
// released and the parts kept for whoever comes next.
func (f *Fetch) Finish(ctx context.Context, committed error) {
	if f == nil {
		return
	}
	b := f.b
	// Cancelled with ctx (a shutdown): the lease is then released, and
	// whoever takes it finishes the upload.
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	mismatch := errors.Is(committed, storage.ErrDigestMismatch) || errors.Is(committed, storage.ErrSizeMismatch)
	switch {
	case f.small != nil && committed == nil:
		b.putSmall(f.small)
	case f.Source == SourceBucket && mismatch && !errors.Is(committed, storage.ErrChangedOnDisk):
		b.log.Warn("a blob in the shared bucket failed verification: removed from the bucket", "digest", f.d, "err", committed)
		b.delete(ctx, "delete_blob", b.blobKey(f.d))
	}
	h := f.h
	if h == nil {
		return
	}
	switch {
	case committed == nil:
		err := f.up.wait()
		if err == nil {
			err = h.valid()
		}
		if err == nil {
			err = b.compose(ctx, f.d, h, h.current(), h.inherited)
		}
		if err != nil {
			b.log.Warn("the blob is stored here but not in the shared bucket: another replica will finish its upload",
				"digest", f.d, "err", err)
			h.release(ctx)
			return
		}
		h.stop()
		b.removeUpload(ctx, f.d, h)
	case mismatch:
		f.up.stop()
		h.stop()
		b.removeUpload(ctx, f.d, h)
	default:
		f.up.stop()
		h.release(ctx)
	}
}

// putSmall queues the upload of a small verified blob whole, unless
// another replica did first: in the background, as no client waits on it.
// The file is opened now, while the download's bytes are surely there.
func (b *Bucket) putSmall(dl content.Download) {
	f, err := dl.Open()
	if err != nil {
		b.log.Warn("sharing a blob in the bucket: other replicas fetch it themselves", "digest", dl.Digest(), "err", err)
		return
	}
	key := b.blobKey(dl.Digest())
	b.background("put_blob", func(ctx context.Context) error {
		defer f.Close()
		fi, err := f.Stat()
		if err == nil {
			_, err = b.put(ctx, "put_blob", key, f, fi.Size(), "*", "", nil)
		}
		return err
	}, func() { f.Close() })
}

// removeUpload deletes a blob's lease, then its parts, while the lease is
// still this replica's: a follower then finds the blob whole, or nothing
// to follow, never a lease naming parts that are gone.
func (b *Bucket) removeUpload(ctx context.Context, d digest.Digest, h *holding) {
	if err := h.valid(); err != nil {
		b.log.Info("not removing an upload: its lease lapsed, another replica may hold it", "digest", d, "err", err)
		return
	}
	l := h.current()
	keys := make([]string, 0, l.numParts()+1)
	for i := range max(l.numParts(), len(l.Uploaded)) {
		keys = append(keys, b.partKey(d, i))
	}
	err := b.delete(ctx, "delete_upload", b.leaseKey(d))
	if err == nil {
		err = b.delete(ctx, "delete_upload", keys...)
	}
	if err != nil {
		b.log.Warn("removing an upload's parts: the janitor removes them later", "digest", d, "err", err)
	}
}

// follow reads the parts of cur's download into dl as its holder uploads
// them. It returns done once dl has every byte (or the blob was
// completed in the bucket and read from there), or the lease to take
// over: one released, expired (its ETag unchanged for LeaseTTL by this
// replica's clock), or none (etag "") when it was deleted before the
// blob was complete. Errors of the bucket wrap errUnusable.
func (b *Bucket) follow(ctx context.Context, dl content.Download, cur held) (done bool, next held, err error) {
	d := dl.Digest()
	seen, seenAt := cur.etag, time.Now()
	ttl := b.cfg.LeaseTTL
	tick := time.NewTicker(b.poll)
	defer tick.Stop()
	failing := time.Time{} // since when reading the bucket fails
	failed := func(err error) error {
		if failing.IsZero() {
			failing = time.Now()
		}
		if time.Since(failing) > ttl {
			return fmt.Errorf("%w: following %s: %w", errUnusable, d, err)
		}
		b.log.Warn("following a blob another replica is fetching", "digest", d, "err", err)
		return nil
	}
	for {
		l := cur.lease
		if l.Size >= 0 && l.PartSize > 0 {
			if dl.Size() != l.Size {
				if err := dl.SetSize(l.Size); err != nil {
					return false, held{}, fmt.Errorf("following %s in the bucket: %w", d, err)
				}
			}
			// Parts already read are skipped without a request; a part
			// not found was removed with its upload, as the lease says
			// next.
			ok := true
			for i := range l.numParts() {
				if !l.uploaded(i) {
					continue
				}
				err := b.fillPart(ctx, dl, l, i)
				if errors.Is(err, ErrDegraded) {
					return false, held{}, fmt.Errorf("%w: following %s: %w", errUnusable, d, err)
				}
				if err != nil && !errors.Is(err, storage.ErrNotFound) {
					if ctx.Err() != nil {
						return false, held{}, ctx.Err()
					}
					if err := failed(err); err != nil {
						return false, held{}, err
					}
					ok = false
					break
				}
			}
			if ok {
				failing = time.Time{}
			}
			if start, end := dl.Missing(0); start == end {
				return true, held{}, nil
			}
		}
		if l.Holder == "" {
			return false, cur, nil
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			return false, held{}, ctx.Err()
		}
		nl, err := b.readLease(ctx, b.blobLease(d))
		switch {
		case errors.Is(err, ErrDegraded):
			return false, held{}, fmt.Errorf("%w: following %s: %w", errUnusable, d, err)
		case errors.Is(err, storage.ErrNotFound):
			found, err := b.fromBlob(ctx, dl, func() error { return nil })
			if err != nil {
				return false, held{}, err
			}
			return found, held{}, nil // not found: given up without completing; start over
		case err != nil:
			if err := failed(err); err != nil {
				return false, held{}, err
			}
		case nl.etag != seen:
			cur, seen, seenAt = nl, nl.etag, time.Now()
			continue
		}
		if time.Since(seenAt) > ttl {
			b.log.Info("a replica stopped renewing its lease of a blob download", "digest", d, "holder", cur.Holder,
				"parts_uploaded", cur.count(), "unchanged_for", time.Since(seenAt).Round(time.Second))
			return false, cur, nil
		}
	}
}

// errUnusable: the bucket could not be used (unreachable, refusing, cut).
var errUnusable = errors.New("bucket unusable")

// fromBlob fills dl from the whole blob in the bucket, and reports whether
// the bucket holds it: the first GET says, with no HEAD before it. check
// is called before dl is written. An error from the bucket itself wraps
// errUnusable; one from check or dl does not.
func (b *Bucket) fromBlob(ctx context.Context, dl content.Download, check func() error) (bool, error) {
	d := dl.Digest()
	key := b.blobKey(d)
	start := int64(0)
	if dl.Size() >= 0 {
		start, _ = dl.Missing(0)
		start = min(start, max(dl.Size()-1, 0)) // one byte at least: the GET is what says the blob is there
	}
	rctx, w := b.watch(ctx)
	defer w.Stop()
	o, err := b.get(rctx, "get_blob", key, start, -1)
	switch {
	case errors.Is(err, ErrDegraded):
		return false, fmt.Errorf("%w: %w", errUnusable, err)
	case errors.Is(err, storage.ErrNotFound):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("%w: %w", errUnusable, err)
	}
	defer o.body.Close()
	w.Reset(b.readStall)
	if err := check(); err != nil {
		return false, err
	}
	if dl.Size() != o.total {
		if err := dl.SetSize(o.total); err != nil {
			return false, fmt.Errorf("reading %s from the bucket: %w", d, err)
		}
	}
	buf := copyBuffers.Get().(*[]byte)
	n, err := b.copyBody(dl, o.body, key, start, o.size, *buf, w)
	copyBuffers.Put(buf)
	if err == nil {
		return true, nil
	}
	if isTimeout(rctx, err) && ctx.Err() == nil {
		b.settle(rctx, "get_blob", err) // a stall: the bucket hangs
	}
	// Cut short: the rest in ranged GETs, resumed where each stops.
	b.log.Warn("reading from the bucket: resuming", "key", key, "at", start+n, "err", err)
	if err := b.fill(ctx, dl, key, 0, start+n, o.total); err != nil {
		return false, fmt.Errorf("%w: %w", errUnusable, err)
	}
	return true, nil
}

// fillPart writes what dl lacks of part i of l.
func (b *Bucket) fillPart(ctx context.Context, dl content.Download, l lease, i int) error {
	start, end := l.part(i)
	return b.fill(ctx, dl, b.partKey(dl.Digest(), i), start, start, end)
}

// fill writes the ranges of [from, to) that dl lacks, read from key, an
// object holding the blob's bytes from offset base on. A read cut short
// is resumed where it stopped, a few times.
func (b *Bucket) fill(ctx context.Context, dl content.Download, key string, base, from, to int64) error {
	buf := copyBuffers.Get().(*[]byte)
	defer copyBuffers.Put(buf)
	failures := 0
	for off := from; off < to; {
		start, end := dl.Missing(off)
		if start == end || start >= to {
			return nil
		}
		end = min(end, to)
		n, err := b.copyRange(ctx, dl, key, base, start, end, *buf)
		off = start + n
		if err == nil {
			continue
		}
		if errors.Is(err, storage.ErrNotFound) || ctx.Err() != nil {
			return err
		}
		if failures++; failures > 5 {
			return err
		}
		b.log.Warn("reading from the bucket: resuming", "key", key, "at", off, "err", err)
		select {
		case <-time.After(time.Duration(failures) * 200 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// copyRange copies [start, end) of the blob from key into dl, and returns
// how many bytes it wrote.
func (b *Bucket) copyRange(ctx context.Context, dl content.Download, key string, base, start, end int64, buf []byte) (int64, error) {
	rctx, w := b.watch(ctx)
	defer w.Stop()
	o, err := b.get(rctx, "get_blob", key, start-base, end-start)
	if err != nil {
		return 0, err
	}
	defer o.body.Close()
	w.Reset(b.readStall)
	n, err := b.copyBody(dl, o.body, key, start, end-start, buf, w)
	if isTimeout(rctx, err) && ctx.Err() == nil {
		b.settle(rctx, "get_blob", err)
	}
	return n, err
}

// readStall is how long a read from the bucket may bring no byte before
// it is abandoned: a client waits on those bytes, and a bucket next to its
// replicas that brings none for this long hangs. The bucket is then
// degraded, and the upstream brings the rest.
const readStall = 5 * time.Second

// watch returns a context that ends when the timer it comes with fires:
// first after clientTimeout, for the answer's first byte (a client waits
// on it); reset to readStall at every read then, it abandons a read that
// stalls.
func (b *Bucket) watch(ctx context.Context) (context.Context, *time.Timer) {
	ctx, cancel := context.WithCancelCause(ctx)
	return ctx, time.AfterFunc(b.clientTimeout, func() { cancel(errCallTimeout) })
}

// copyBody copies n bytes of body into dl at off, through buf, resetting
// the stall timer at every read.
func (b *Bucket) copyBody(dl content.Download, body io.Reader, key string, off, n int64, buf []byte, stall *time.Timer) (int64, error) {
	var done int64
	for done < n {
		k, rerr := io.ReadFull(body, buf[:min(int64(len(buf)), n-done)])
		if k > 0 {
			stall.Reset(b.readStall)
			if _, err := dl.WriteAt(buf[:k], off+done); err != nil {
				return done, fmt.Errorf("writing %s at %d: %w", dl.Digest(), off+done, err)
			}
			done += int64(k)
		}
		if rerr != nil && done < n {
			return done, fmt.Errorf("reading %s at %d: %w", key, off+done, rerr)
		}
	}
	return done, nil
}

var copyBuffers = sync.Pool{New: func() any { b := make([]byte, 256<<10); return &b }}

// uploader sends a download's parts to the bucket as its bytes arrive.
type uploader struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

// upload starts uploading every part of dl, each as soon as the download
// holds all of it.
func (b *Bucket) upload(ctx context.Context, dl content.Download, h *holding) *uploader {
	ctx, cancel := context.WithCancel(ctx)
	u := &uploader{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(u.done)
		u.err = b.uploadParts(ctx, dl, h)
		if u.err != nil && ctx.Err() == nil {
			// Others take over at once rather than wait on a holder
			// that uploads nothing more.
			b.log.Warn("uploading a blob's parts to the shared bucket: released its lease", "digest", dl.Digest(), "err", u.err)
			h.release(ctx)
		}
	}()
	return u
}

// partTries is how many times a part's upload is tried, with a pause
// doubling from a second between tries, besides the SDK's own retries.
const partTries = 4

func (b *Bucket) uploadParts(ctx context.Context, dl content.Download, h *holding) error {
	d := dl.Digest()
	size, err := dl.WaitSize(ctx)
	if err != nil {
		return err
	}
	if l := h.current(); l.Size != size || l.PartSize == 0 {
		if l.count() > 0 {
			return fmt.Errorf("uploading %s: its lease says %d bytes, the download %d", d, l.Size, size)
		}
		h.update(func(l *lease) { l.Size, l.PartSize = size, b.partSizeFor(size) })
	}
	f, err := dl.Open()
	if err != nil {
		return err
	}
	defer f.Close()
	l := h.current()
	n := l.numParts()
	// Each part goes up as soon as the download holds all of it: a
	// download fills its blob in parallel chunks, not in order.
	type result struct {
		part int
		err  error
	}
	results := make(chan result, uploadsAtOnce)
	mine := make([]bool, n) // parts this replica uploaded
	left := n
	busy := map[int]bool{}
	lost := h.Lost()
	var failed error
	for {
		if failed == nil {
			for i := range n {
				if mine[i] || busy[i] || len(busy) == uploadsAtOnce {
					continue
				}
				start, end := l.part(i)
				if s, _ := dl.Missing(start); s < end {
					continue
				}
				busy[i] = true
				go func() { results <- result{i, b.putPart(ctx, h, f, d, i, start, end)} }()
			}
		}
		switch {
		case len(busy) > 0:
		case failed != nil:
			return failed
		case left == 0:
			return nil
		}
		select {
		case r := <-results:
			delete(busy, r.part)
			switch {
			case r.err != nil && failed == nil:
				failed = r.err
			case r.err == nil:
				mine[r.part] = true
				left--
				h.update(func(l *lease) { l.setUploaded(r.part) })
			}
		case <-time.After(50 * time.Millisecond): // the download may hold more whole parts
		case <-lost:
			lost = nil
			if failed == nil {
				failed = h.valid()
			}
		case <-ctx.Done():
			if failed == nil {
				failed = ctx.Err()
			}
		}
	}
}

// putPart uploads part i of d, [start, end) of f, while the lease is this
// replica's: each try ends when the lease would lapse.
func (b *Bucket) putPart(ctx context.Context, h *holding, f *os.File, d digest.Digest, i int, start, end int64) error {
	var err error
	for try := range partTries {
		if try > 0 {
			select {
			case <-time.After(time.Second << (try - 1)):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		if err = h.valid(); err != nil {
			return err
		}
		began := time.Now()
		pctx, cancel := context.WithDeadline(ctx, h.validUntil())
		_, err = b.put(pctx, "put_part", b.partKey(d, i), io.NewSectionReader(f, start, end-start), end-start, "", "", nil)
		cancel()
		if err == nil {
			b.log.Debug("uploaded a part to the shared bucket", "digest", d, "part", i, "bytes", end-start,
				"duration", time.Since(began).Round(time.Millisecond))
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return fmt.Errorf("uploading %s part %d: %w", d, i, err)
}

func (u *uploader) stop() {
	u.cancel()
	<-u.done
}

func (u *uploader) wait() error {
	<-u.done
	return u.err
}

// uploadsAtOnce bounds the parts of one blob uploading at once.
const uploadsAtOnce = 4

// compose assembles the blob in the bucket from its parts, server-side: a
// copy for one part, else a multipart upload of part copies. Replicas read
// the whole blob from then on.
func (b *Bucket) compose(ctx context.Context, d digest.Digest, h *holding, l lease, inherited bool) error {
	if err := b.health.skip(); err != nil {
		return fmt.Errorf("assembling %s in the bucket: %w", d, err)
	}
	dst := b.blobKey(d)
	n := l.numParts()
	src := func(i int) *string { return aws.String(copySource(b.name, b.partKey(d, i))) }
	// Each request while the lease is this replica's, and no longer than it
	// stays so unless renewed (keep goes on renewing it meanwhile): once it
	// lapses another replica may assemble.
	held := func() (context.Context, context.CancelFunc, error) {
		if err := h.valid(); err != nil {
			return nil, nil, err
		}
		ctx, cancel := context.WithDeadline(ctx, h.validUntil())
		return ctx, cancel, nil
	}
	if n == 1 {
		cctx, cancel, err := held()
		if err != nil {
			return err
		}
		_, err = b.client.CopyObject(cctx, &s3.CopyObjectInput{Bucket: &b.name, Key: &dst, CopySource: src(0)})
		cancel()
		b.settle(cctx, "copy_blob", err)
		if err != nil {
			return b.wrap("assembling", dst, err)
		}
	} else {
		// An assembly of the blob begun before is a dead holder's: this
		// replica holds the lease now. Only a lease taken over can have had one.
		if inherited {
			if _, err := b.abortAssemblies(ctx, dst, time.Time{}); err != nil {
				b.log.Warn("aborting an earlier assembly of a blob: the janitor aborts it later", "digest", d, "err", err)
			}
		}
		cctx, cancel, err := held()
		if err != nil {
			return err
		}
		mu, err := b.client.CreateMultipartUpload(cctx, &s3.CreateMultipartUploadInput{Bucket: &b.name, Key: &dst})
		cancel()
		b.settle(cctx, "create_multipart", err)
		if err != nil {
			return b.wrap("assembling", dst, err)
		}
		parts := make([]types.CompletedPart, n)
		g, gctx := errgroup.WithContext(ctx)
		g.SetLimit(8)
		for i := range n {
			g.Go(func() error {
				if err := h.valid(); err != nil {
					return err
				}
				pctx, cancel := context.WithDeadline(gctx, h.validUntil())
				defer cancel()
				out, err := b.client.UploadPartCopy(pctx, &s3.UploadPartCopyInput{Bucket: &b.name, Key: &dst,
					UploadId: mu.UploadId, PartNumber: aws.Int32(int32(i + 1)), CopySource: src(i)})
				b.settle(pctx, "copy_part", err)
				if err != nil {
					return b.wrap("copying a part into", dst, err)
				}
				parts[i] = types.CompletedPart{PartNumber: aws.Int32(int32(i + 1)), ETag: out.CopyPartResult.ETag}
				return nil
			})
		}
		err = g.Wait()
		if err == nil {
			var cctx context.Context
			if cctx, cancel, err = held(); err == nil {
				_, err = b.client.CompleteMultipartUpload(cctx, &s3.CompleteMultipartUploadInput{Bucket: &b.name, Key: &dst,
					UploadId: mu.UploadId, MultipartUpload: &types.CompletedMultipartUpload{Parts: parts}})
				cancel()
				b.settle(cctx, "complete_multipart", err)
				if err != nil {
					err = b.wrap("assembling", dst, err)
				}
			}
		}
		if err != nil {
			actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
			_, aerr := b.client.AbortMultipartUpload(actx, &s3.AbortMultipartUploadInput{Bucket: &b.name, Key: &dst, UploadId: mu.UploadId})
			cancel()
			b.settle(actx, "abort_multipart", aerr)
			return err
		}
	}
	size, err := b.head(ctx, "head_blob", dst)
	if err != nil {
		return err
	}
	if size != l.Size {
		b.delete(ctx, "delete_blob", dst)
		return fmt.Errorf("assembling %s in the bucket: %d bytes, want %d: %w", d, size, l.Size, storage.ErrSizeMismatch)
	}
	return nil
}

// copySource is a CopySource header's value: bucket and key, URL-encoded
// a path segment at a time.
func copySource(bucket, key string) string {
	segs := strings.Split(bucket+"/"+key, "/")
	for i, s := range segs {
		segs[i] = url.PathEscape(s)
	}
	return strings.Join(segs, "/")
}
