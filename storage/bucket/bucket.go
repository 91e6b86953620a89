// Package bucket is the tier pullproxy replicas share: an S3-compatible
// bucket (AWS S3, MinIO, Ceph RGW) holding the blobs, manifests, tags and
// repository memberships one replica fetched, so that the others serve
// them without asking the upstream again.
//
// Each replica keeps its own local store (blob files and Badger) as a
// cache in front of the bucket. Replicas coordinate through the bucket
// alone, with S3 conditional writes: no membership list, no gossip.
//
// Layout under the configured prefix:
//
//	blobs/sha256/<hex>                  a verified blob, whole
//	manifests/sha256/<hex>              a verified manifest; its media type in the object's metadata
//	tags/<upstream>/<repo>:<tag>        the tag's TagRecord, as JSON
//	members/<upstream>/<repo>@<digest>  empty: the digest is known to be in the repository;
//	                                    the size its manifest declared in the metadata
//	uploads/sha256/<hex>/lease          who is fetching the blob (see lease.go)
//	uploads/sha256/<hex>/part-<nnnnn>   the parts uploaded so far, readable as they land
//	turns/<name>                        who holds a piece of work (a sync rule's round), and the
//	                                    state its last holder left (see turn.go)
//
// distribution's s3-aws storage driver was the model and is not reused: it
// is written against aws-sdk-go v1 (past its end of support), its path-only
// driver interface has no conditional writes to build a lease on, and its
// writer's multipart parts cannot be read by anyone until the upload
// completes. Taken from it: reads as ranged GETs, redirects as presigned
// GETs, and multipart assembly (here server-side, from the part objects).
package bucket

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/pullproxy/pullproxy/storage"
)

// Config says which bucket, and how replicas use it.
type Config struct {
	Bucket   string
	Endpoint string // empty: AWS S3 for Region; else an S3-compatible server's URL
	Region   string
	Prefix   string // keys start with it; lets several sites share a bucket
	// PathStyle addresses the bucket as <endpoint>/<bucket>/<key>, as
	// MinIO and Ceph RGW usually need, rather than <bucket>.<endpoint>.
	PathStyle bool
	// Redirect answers a GET of a blob in the bucket with a presigned URL
	// (for nodes that can reach the bucket), rather than serving it
	// through the replica's local cache.
	Redirect bool
	// LeaseTTL is how long a lease whose holder stopped renewing it stands
	// before another replica takes the download over. Default 30s.
	LeaseTTL time.Duration
	// PartSize is the size of the parts a download is uploaded in. At
	// least 5 MiB (S3's least multipart part); default 16 MiB.
	PartSize int64
	// StaleUploads is how long an upload nobody touched is kept before the
	// janitor removes its parts (and multipart uploads are aborted).
	// Default 24h.
	StaleUploads time.Duration
}

const (
	defaultLeaseTTL     = 30 * time.Second
	defaultPartSize     = 16 << 20
	minPartSize         = 5 << 20 // S3's least part of a multipart upload, but the last
	maxPartSize         = 5 << 30 // S3's most, and the most a copy may copy
	maxParts            = 10000   // S3's most parts of a multipart upload
	defaultStaleUploads = 24 * time.Hour
	presignExpiry       = 15 * time.Minute
)

// Bucket is a shared bucket opened by one replica. It is safe for
// concurrent use.
type Bucket struct {
	client  *s3.Client
	presign *s3.PresignClient
	name    string
	prefix  string
	id      string // this replica, as leases name it
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	poll    time.Duration // how often a follower looks at a lease
	// turnsSeen is what this replica saw of turns others hold (turn.go).
	turnsSeen sightings

	health     *health
	probeFirst time.Duration
	// clientTimeout and readStall bound a call a client waits on (see
	// health.go, fetch.go's watch).
	clientTimeout, readStall time.Duration
	writes                   chan backgroundWrite
	dropped                  atomic.Int64
	closed                   atomic.Bool
	stop                     context.CancelFunc // ends the probe and the writers
	bg                       sync.WaitGroup
	closeOnce                sync.Once
}

// Option configures Open.
type Option func(*options)

type options struct {
	log     *slog.Logger
	creds   aws.CredentialsProvider
	reg     prometheus.Registerer
	client  *http.Client
	replica string
	poll    time.Duration
	// clientTimeout and readStall: see Bucket.
	clientTimeout, readStall time.Duration
	probe                    time.Duration
}

// WithLogger sets the logger. Default (and for nil): slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.log = l
		}
	}
}

// WithCredentials sets the bucket's credentials. Default (and for nil):
// the AWS default chain (environment, web identity as IRSA gives it,
// shared files, instance or task role).
func WithCredentials(c aws.CredentialsProvider) Option {
	return func(o *options) { o.creds = c }
}

// WithMetrics registers the bucket's metrics with reg. Default (and for
// nil): not registered.
func WithMetrics(reg prometheus.Registerer) Option {
	return func(o *options) { o.reg = reg }
}

// WithReplicaID names this replica in the leases it takes. Default (and for
// ""): the host name, the process ID and a random suffix.
func WithReplicaID(id string) Option {
	return func(o *options) { o.replica = id }
}

// withHTTPClient sets the client requests go through (tests).
func withHTTPClient(c *http.Client) Option {
	return func(o *options) { o.client = c }
}

// withProbe sets the first wait before probing a degraded bucket (tests).
func withProbe(d time.Duration) Option {
	return func(o *options) { o.probe = d }
}

// withDeadlines sets clientTimeout and readStall (tests: the production
// ones are for a bucket next to its replicas, not one sharing a loaded
// test machine with everything else).
func withDeadlines(client, stall time.Duration) Option {
	return func(o *options) { o.clientTimeout, o.readStall = client, stall }
}

// withPoll sets how often followers look at a lease (tests).
func withPoll(d time.Duration) Option {
	return func(o *options) { o.poll = d }
}

// Open connects to the bucket and checks that it can be reached with the
// credentials at hand. A bucket that does not answer is no error: the
// replica starts with it degraded. Close stops what Open starts.
func Open(ctx context.Context, cfg Config, opts ...Option) (*Bucket, error) {
	o := options{log: slog.Default(), poll: 500 * time.Millisecond, probe: probeFirst,
		clientTimeout: clientTimeout, readStall: readStall}
	for _, opt := range opts {
		opt(&o)
	}
	if cfg.Bucket == "" {
		return nil, errors.New("bucket: no bucket named")
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = defaultLeaseTTL
	}
	if cfg.PartSize == 0 {
		cfg.PartSize = defaultPartSize
	}
	if cfg.PartSize < minPartSize || cfg.PartSize > maxPartSize {
		return nil, fmt.Errorf("bucket: part_size %d is outside S3's 5 MiB to 5 GiB", cfg.PartSize)
	}
	if cfg.StaleUploads <= 0 {
		cfg.StaleUploads = defaultStaleUploads
	}
	if cfg.StaleUploads < 4*cfg.LeaseTTL {
		return nil, fmt.Errorf("bucket: stale_uploads %v must be at least 4 lease_ttl (%v): live uploads would be removed", cfg.StaleUploads, cfg.LeaseTTL)
	}
	if cfg.Prefix != "" && !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/"
	}
	loadOpts := []func(*config.LoadOptions) error{}
	if cfg.Region != "" {
		loadOpts = append(loadOpts, config.WithRegion(cfg.Region))
	}
	if o.creds != nil {
		loadOpts = append(loadOpts, config.WithCredentialsProvider(o.creds))
	}

	awsCfg, err := config.LoadDefaultConfig(ctx, loadOpts...)
	if err != nil {
		return nil, fmt.Errorf("bucket %s: loading AWS configuration: %w", cfg.Bucket, err)
	}
	if awsCfg.Region == "" {
		awsCfg.Region = "us-east-1" // S3-compatible servers mostly ignore it, but signing needs one
	}
	client := s3.NewFromConfig(awsCfg, func(so *s3.Options) {
		if cfg.Endpoint != "" {
			so.BaseEndpoint = aws.String(cfg.Endpoint)
		}
		so.UsePathStyle = cfg.PathStyle
		if o.client != nil {
			so.HTTPClient = o.client
		} else {
			// Bounded set-up and first byte: a bucket that does not answer
			// fails a request in seconds, and the replica fetches alone.
			so.HTTPClient = awshttp.NewBuildableClient().
				WithDialerOptions(func(d *net.Dialer) { d.Timeout = 5 * time.Second }).
				WithTransportOptions(func(t *http.Transport) {
					t.TLSHandshakeTimeout = 10 * time.Second
					t.ResponseHeaderTimeout = 30 * time.Second
				})
		}
		// Checksums only where S3 requires them: servers that predate
		// the SDK's default CRC32 trailers (older MinIO, Ceph) refuse them.
		so.RequestChecksumCalculation = aws.RequestChecksumCalculationWhenRequired
		so.ResponseChecksumValidation = aws.ResponseChecksumValidationWhenRequired
	})
	id := o.replica
	if id == "" {
		id = replicaID()
	}
	b := &Bucket{
		client: client, presign: s3.NewPresignClient(client), name: cfg.Bucket, prefix: cfg.Prefix,
		id: id, cfg: cfg, log: o.log, poll: o.poll, probeFirst: o.probe,
		clientTimeout: o.clientTimeout, readStall: o.readStall, writes: make(chan backgroundWrite, writeQueue),
	}
	if b.metrics, err = newMetrics(o.reg); err != nil {
		return nil, err
	}
	b.health = newHealth(b.metrics)
	bgCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	b.stop = stop
	b.bg.Go(func() { b.probe(bgCtx) })
	for range writers {
		b.bg.Go(func() { b.runWrites(bgCtx) })
	}
	opened := false
	defer func() {
		if !opened {
			b.Close()
		}
	}()
	// A listing rather than a HEAD: its refusal says why (a HEAD's has no
	// body), and the janitor needs the permission.
	lctx, cancel := context.WithTimeoutCause(ctx, opTimeout, errCallTimeout)
	_, err = client.ListObjectsV2(lctx, &s3.ListObjectsV2Input{Bucket: aws.String(cfg.Bucket), Prefix: aws.String(cfg.Prefix), MaxKeys: aws.Int32(1)})
	b.settle(lctx, "list_bucket", err)
	cancel()
	if err != nil {
		err = fmt.Errorf("bucket %s at %s: %w", cfg.Bucket, b.where(), err)
		if class, fix := Diagnose(err); class == "bucket unreachable" || class == "bucket error" {
			// An outage, not a mistake: start, and fetch alone until
			// the bucket answers.
			b.log.Warn("the shared bucket does not answer: serving without it until it does", "class", class, "err", err, "fix", fix)
			opened = true
			return b, nil
		}
		return nil, err
	}
	if err := b.Check(ctx); errors.Is(err, ErrNoConditionalWrites) {
		class, fix := Diagnose(err)
		b.log.Warn("the shared bucket cannot hold leases: "+class, "bucket", cfg.Bucket, "err", err, "fix", fix)
	} else if err != nil && !errors.Is(err, ErrDegraded) {
		return nil, err
	}
	opened = true
	return b, nil
}

// Redirect reports whether GETs of blobs in the bucket are redirected.
func (b *Bucket) Redirect() bool { return b.cfg.Redirect }

func (b *Bucket) where() string {
	if b.cfg.Endpoint != "" {
		return b.cfg.Endpoint
	}
	return "S3 " + b.cfg.Region
}

// Replica names this replica, as leases and turns name their holders.
func (b *Bucket) Replica() string { return b.id }

func replicaID() string {
	host, _ := os.Hostname()
	var r [4]byte
	rand.Read(r[:])
	return host + "-" + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(r[:])
}

// Keys.

func (b *Bucket) blobKey(d digest.Digest) string {
	return b.prefix + "blobs/" + d.Algorithm().String() + "/" + d.Encoded()
}

func (b *Bucket) manifestKey(d digest.Digest) string {
	return b.prefix + "manifests/" + d.Algorithm().String() + "/" + d.Encoded()
}

func (b *Bucket) uploadsKey(d digest.Digest) string {
	return b.prefix + "uploads/" + d.Algorithm().String() + "/" + d.Encoded() + "/"
}

func (b *Bucket) leaseKey(d digest.Digest) string { return b.uploadsKey(d) + "lease" }

func (b *Bucket) partKey(d digest.Digest, i int) string {
	return fmt.Sprintf("%spart-%05d", b.uploadsKey(d), i)
}

// Tags and repositories are named as the local store names them: an
// upstream's canonical name has no "/", a repository no ":" or "@", a tag no "/".
func (b *Bucket) tagKey(upstream, repo, tag string) string {
	return b.prefix + "tags/" + upstream + "/" + repo + ":" + tag
}

func (b *Bucket) memberKey(upstream, repo string, d digest.Digest) string {
	return b.prefix + "members/" + upstream + "/" + repo + "@" + d.String()
}

// Requests. Each is counted by operation and outcome.

// object is what get returns: a body to close, and what S3 said of it.
type object struct {
	body     io.ReadCloser
	size     int64 // of the answer (the range, when one was asked)
	total    int64 // of the object
	etag     string
	metadata map[string]string
	modified time.Time
}

// get reads key from off on (the whole object for off 0 and n < 0), or n
// bytes from off.
func (b *Bucket) get(ctx context.Context, op, key string, off, n int64) (object, error) {
	if err := b.health.skip(); err != nil {
		return object{}, fmt.Errorf("reading %s: %w", key, err)
	}
	in := &s3.GetObjectInput{Bucket: &b.name, Key: &key}
	if off > 0 || n >= 0 {
		r := "bytes=" + strconv.FormatInt(off, 10) + "-"
		if n >= 0 {
			r += strconv.FormatInt(off+n-1, 10)
		}
		in.Range = &r
	}
	out, err := b.client.GetObject(ctx, in)
	b.settle(ctx, op, err)
	if err != nil {
		return object{}, b.wrap("reading", key, err)
	}
	o := object{body: out.Body, size: aws.ToInt64(out.ContentLength), etag: aws.ToString(out.ETag),
		metadata: out.Metadata, modified: aws.ToTime(out.LastModified), total: aws.ToInt64(out.ContentLength)}
	if cr := aws.ToString(out.ContentRange); cr != "" {
		if i := strings.LastIndexByte(cr, '/'); i >= 0 {
			o.total, _ = strconv.ParseInt(cr[i+1:], 10, 64)
		}
	}
	b.metrics.read.Add(float64(o.size))
	return o, nil
}

// opTimeout bounds a request no client waits on (a background write, a
// deletion, the check at start).
const opTimeout = 15 * time.Second

// getSmall reads a small object whole, within clientTimeout: a client
// waits on it.
func (b *Bucket) getSmall(ctx context.Context, op, key string) ([]byte, object, error) {
	ctx, cancel := b.withClientTimeout(ctx)
	defer cancel()
	o, err := b.get(ctx, op, key, 0, -1)
	if err != nil {
		return nil, o, err
	}
	defer o.body.Close()
	body, err := io.ReadAll(io.LimitReader(o.body, 16<<20))
	if err != nil {
		if isTimeout(ctx, err) {
			b.settle(ctx, op, err)
		}
		return nil, o, b.wrap("reading", key, err)
	}
	return body, o, nil
}

// head returns key's size, or an error wrapping storage.ErrNotFound.
func (b *Bucket) head(ctx context.Context, op, key string) (int64, error) {
	n, _, err := b.headMeta(ctx, op, key)
	return n, err
}

// headMeta returns key's size and metadata, within clientTimeout.
func (b *Bucket) headMeta(ctx context.Context, op, key string) (int64, map[string]string, error) {
	if err := b.health.skip(); err != nil {
		return 0, nil, fmt.Errorf("looking up %s: %w", key, err)
	}
	ctx, cancel := b.withClientTimeout(ctx)
	defer cancel()
	out, err := b.client.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &b.name, Key: &key})
	b.settle(ctx, op, err)
	if err != nil {
		return 0, nil, b.wrap("looking up", key, err)
	}
	return aws.ToInt64(out.ContentLength), out.Metadata, nil
}

// put writes body under key. ifNoneMatch ("*") and ifMatch (an ETag) make
// it conditional: it then fails with errPrecondition when the condition
// does not hold. It returns the new object's ETag.
func (b *Bucket) put(ctx context.Context, op, key string, body io.ReadSeeker, size int64, ifNoneMatch, ifMatch string, metadata map[string]string) (string, error) {
	if err := b.health.skip(); err != nil {
		return "", fmt.Errorf("writing %s: %w", key, err)
	}
	in := &s3.PutObjectInput{Bucket: &b.name, Key: &key, Body: body, ContentLength: aws.Int64(size), Metadata: metadata}
	if ifNoneMatch != "" {
		in.IfNoneMatch = &ifNoneMatch
	}
	if ifMatch != "" {
		in.IfMatch = &ifMatch
	}
	out, err := b.client.PutObject(ctx, in)
	b.settle(ctx, op, err)
	if err != nil {
		return "", b.wrap("writing", key, err)
	}
	b.metrics.written.Add(float64(size))
	return aws.ToString(out.ETag), nil
}

// putBytes writes a small object, within clientTimeout: a client may
// wait on it (a manifest, tag, member or lease).
func (b *Bucket) putBytes(ctx context.Context, op, key string, body []byte, ifNoneMatch, ifMatch string, metadata map[string]string) (string, error) {
	ctx, cancel := b.withClientTimeout(ctx)
	defer cancel()
	return b.put(ctx, op, key, bytes.NewReader(body), int64(len(body)), ifNoneMatch, ifMatch, metadata)
}

// delete deletes keys, a thousand (S3's most) per request; one at a time
// where the server refuses batches (some S3-compatible servers want a
// Content-MD5 the SDK does not send).
func (b *Bucket) delete(ctx context.Context, op string, keys ...string) error {
	if err := b.health.skip(); err != nil {
		return fmt.Errorf("deleting %s: %w", keys[0], err)
	}
	ctx, cancel := context.WithTimeoutCause(ctx, opTimeout*time.Duration(1+len(keys)/100), errCallTimeout)
	defer cancel()
	if len(keys) > 1 {
		err := b.deleteBatches(ctx, op, keys)
		if err == nil {
			return nil
		}
		if class, _ := Diagnose(err); class == "bucket access denied" || class == "bucket credentials refused" || ctx.Err() != nil {
			return err
		}
	}
	for _, key := range keys {
		_, err := b.client.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: &b.name, Key: &key})
		b.settle(ctx, op, err)
		if err != nil && !isNotFound(err) {
			return b.wrap("deleting", key, err)
		}
	}
	return nil
}

func (b *Bucket) deleteBatches(ctx context.Context, op string, keys []string) error {
	for batch := range slices.Chunk(keys, 1000) {
		objs := make([]types.ObjectIdentifier, len(batch))
		for i := range batch {
			objs[i].Key = &batch[i]
		}
		out, err := b.client.DeleteObjects(ctx, &s3.DeleteObjectsInput{Bucket: &b.name,
			Delete: &types.Delete{Objects: objs, Quiet: aws.Bool(true)}})
		b.settle(ctx, op, err)
		if err != nil {
			return b.wrap("deleting", batch[0]+" and others", err)
		}
		for _, e := range out.Errors {
			if aws.ToString(e.Code) != "NoSuchKey" {
				return fmt.Errorf("deleting %s in bucket %s: %s: %s", aws.ToString(e.Key), b.name, aws.ToString(e.Code), aws.ToString(e.Message))
			}
		}
	}
	return nil
}

// Errors.

// errPrecondition: a conditional write found the object other than it
// expected (there already, or changed since read).
var errPrecondition = errors.New("precondition failed")

// wrap says what was being done to which key, and maps S3's answers to
// the errors callers check: storage.ErrNotFound and errPrecondition.
func (b *Bucket) wrap(what, key string, err error) error {
	switch {
	case isNotFound(err):
		return fmt.Errorf("%s %s in bucket %s: %w", what, key, b.name, storage.ErrNotFound)
	case isPrecondition(err):
		return fmt.Errorf("%s %s in bucket %s: %w", what, key, b.name, errPrecondition)
	}
	return fmt.Errorf("%s %s in bucket %s at %s: %w", what, key, b.name, b.where(), err)
}

func isNotFound(err error) bool {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		switch ae.ErrorCode() {
		case "NotFound", "NoSuchKey":
			return true
		}
	}
	var re *awshttp.ResponseError
	return errors.As(err, &re) && re.HTTPStatusCode() == http.StatusNotFound
}

// isPrecondition: 412, or 409 ConditionalRequestConflict, which S3 answers
// when another conditional write of the key is in progress: either way
// someone else wrote first.
func isPrecondition(err error) bool {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		switch ae.ErrorCode() {
		case "PreconditionFailed", "ConditionalRequestConflict":
			return true
		}
	}
	var re *awshttp.ResponseError
	return errors.As(err, &re) && re.HTTPStatusCode() == http.StatusPreconditionFailed
}

// StatBlob returns the size of d in the bucket, or an error wrapping
// storage.ErrNotFound.
func (b *Bucket) StatBlob(ctx context.Context, d digest.Digest) (int64, error) {
	return b.head(ctx, "head_blob", b.blobKey(d))
}

// BlobURL returns a presigned URL for GETs of d, valid for a while, or an
// error wrapping storage.ErrNotFound when the bucket does not hold d.
func (b *Bucket) BlobURL(ctx context.Context, d digest.Digest) (string, error) {
	key := b.blobKey(d)
	if _, err := b.head(ctx, "head_blob", key); err != nil {
		return "", err
	}
	req, err := b.presign.PresignGetObject(ctx, &s3.GetObjectInput{Bucket: &b.name, Key: &key},
		s3.WithPresignExpires(presignExpiry))
	if err != nil {
		return "", fmt.Errorf("presigning %s: %w", key, err)
	}
	return req.URL, nil
}
