package bucket

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"

	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/smithy-go"
)

// ErrNoConditionalWrites: the server ignores If-None-Match on PUT, so a
// lease is no lease: replicas may fetch the same blob at once (each
// verifies what it fetched; nothing wrong is served, bytes are wasted).
var ErrNoConditionalWrites = errors.New("the server ignores conditional writes (If-None-Match on PUT)")

// Check writes a probe object with If-None-Match: *, again (which must be
// refused), over a wrong ETag with If-Match (refused too), then deletes
// it: it fails when this replica may not write to the bucket, and returns
// an error wrapping ErrNoConditionalWrites when a condition is ignored.
func (b *Bucket) Check(ctx context.Context) error {
	key := b.prefix + "probe/" + b.id
	if _, err := b.putBytes(ctx, "put_probe", key, []byte(b.id), "*", "", nil); err != nil && !errors.Is(err, errPrecondition) {
		return err
	}
	_, err := b.putBytes(ctx, "put_probe", key, []byte(b.id), "*", "", nil)
	if err == nil {
		b.delete(ctx, "delete_probe", key)
		return fmt.Errorf("bucket %s at %s: %w", b.name, b.where(), ErrNoConditionalWrites)
	}
	if !errors.Is(err, errPrecondition) {
		return err
	}
	// And If-Match: a write over an ETag the object does not have.
	_, err = b.putBytes(ctx, "put_probe", key, []byte(b.id), "", `"0123456789abcdef0123456789abcdef"`, nil)
	derr := b.delete(ctx, "delete_probe", key)
	switch {
	case err == nil:
		return fmt.Errorf("bucket %s at %s: If-Match: %w", b.name, b.where(), ErrNoConditionalWrites)
	case !errors.Is(err, errPrecondition):
		return err
	}
	return derr
}

// Diagnose names what kind of failure err from the bucket is, and the
// fix, for logs and doctor.
func Diagnose(err error) (class, fix string) {
	var ae smithy.APIError
	code := ""
	if errors.As(err, &ae) {
		code = ae.ErrorCode()
	}
	status := 0
	var re *awshttp.ResponseError
	if errors.As(err, &re) {
		status = re.HTTPStatusCode()
	}
	var netErr net.Error
	switch {
	case errors.Is(err, ErrNoConditionalWrites):
		return "no conditional writes", "use an S3 server that honours If-None-Match and If-Match on PUT (AWS S3, a recent MinIO or Ceph RGW): without them replicas may fetch a blob more than once"
	case code == "NoSuchBucket" || code == "NotFound" && status == http.StatusNotFound:
		return "bucket missing", "create the bucket, or fix storage.bucket, storage.region and storage.endpoint"
	case status >= 500:
		return "bucket error", "the S3 server failed (" + http.StatusText(status) + "): see its logs; replicas fetch alone meanwhile"
	case code == "InvalidAccessKeyId" || code == "SignatureDoesNotMatch" || code == "ExpiredToken" || code == "InvalidToken":
		return "bucket credentials refused", "give valid credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, IRSA, an instance role)"
	case code == "AccessDenied" || code == "Forbidden" || status == http.StatusForbidden:
		return "bucket access denied", "let the credentials get, put, delete and list objects and multipart uploads under the prefix"
	case code == "PermanentRedirect" || code == "AuthorizationHeaderMalformed" || status == http.StatusMovedPermanently:
		return "wrong region", "set storage.region to the bucket's region"
	case errors.As(err, &netErr):
		return "bucket unreachable", "check storage.endpoint, DNS and the route to the S3 endpoint"
	}
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		return "bucket unreachable", "check storage.endpoint and DNS"
	}
	return "bucket error", "see the error; check storage settings and the S3 server's logs"
}
