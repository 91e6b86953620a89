package proxy

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/miniotest"
	"github.com/pullproxy/pullproxy/storage/bucket"
)

// A blob in the shared bucket whose bytes are wrong: the download that
// read them fails verification, the blob is removed from the bucket, the
// upstream is not blamed, and the client's next request gets the blob,
// fetched again from the upstream.
func TestSharedBlobFailingVerificationFetchedAgain(t *testing.T) {
	const name = "layers"
	srv := miniotest.ForTest(t, name)
	b, err := bucket.Open(t.Context(), bucket.Config{Bucket: name, Endpoint: srv.Endpoint, PathStyle: true},
		bucket.WithCredentials(srv.Credentials()), bucket.WithLogger(testLog(t)))
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, WithSharedBlobs(b))
	img := e.push("team/app", "v1", 3<<20, 1)
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	rc, err := layers[0].Compressed()
	if err != nil {
		t.Fatal(err)
	}
	blob, _ := io.ReadAll(rc)
	rc.Close()
	d := digest.FromBytes(blob)
	bad := bytes.Clone(blob)
	bad[len(bad)/3] ^= 1
	key := "blobs/sha256/" + d.Encoded()
	if _, err := srv.Client().PutObject(t.Context(), &s3.PutObjectInput{Bucket: aws.String(name), Key: aws.String(key),
		Body: bytes.NewReader(bad), ContentLength: aws.Int64(int64(len(bad)))}); err != nil {
		t.Fatal(err)
	}
	path := "/v2/team/app/blobs/" + d.String() + "?ns=" + upstreamName

	// The first answer ends short: its bytes failed verification.
	req, _ := http.NewRequest(http.MethodGet, e.proxy.URL+path, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	first, rerr := io.ReadAll(resp.Body)
	resp.Body.Close()
	if rerr == nil && digest.FromBytes(first) == d {
		t.Fatal("the first answer verified, from corrupt bytes in the bucket")
	}
	var got []byte
	for deadline := time.Now().Add(30 * time.Second); ; {
		resp, body := e.get(http.MethodGet, path, nil)
		if resp.StatusCode == http.StatusOK && digest.FromBytes(body) == d {
			got = body
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no good answer within 30 s; last: %s", resp.Status)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !bytes.Equal(got, blob) {
		t.Fatal("served other bytes")
	}
	if n := e.counter.count("GET " + d.String()); n == 0 {
		t.Error("the blob was never fetched from the upstream")
	}
	// The corrupt copy is gone from the bucket (the good one may be there
	// now, uploaded by the download that verified).
	out, err := srv.Client().GetObject(t.Context(), &s3.GetObjectInput{Bucket: aws.String(name), Key: aws.String(key)})
	if err == nil {
		inBucket, _ := io.ReadAll(out.Body)
		out.Body.Close()
		if digest.FromBytes(inBucket) != d {
			t.Error("the corrupt blob is still in the bucket")
		}
	} else if nsk := (*types.NoSuchKey)(nil); !errors.As(err, &nsk) {
		t.Fatal(err)
	}
}
