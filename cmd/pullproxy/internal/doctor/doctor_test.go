package doctor

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/internal/miniotest"
	"github.com/pullproxy/pullproxy/upstream"
)

// TestDoctorDisk: a data dir's file system under a tenth free fails,
// fixed here; more is fine.
func TestDoctorDisk(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		free, total int64
		verdict     string
	}{
		{9 << 30, 100 << 30, "fail"},
		{30 << 30, 100 << 30, "ok"},
	} {
		d := &doctorRun{cfg: config.File{DataDir: t.TempDir()},
			space: func(string) (int64, int64, error) { return tt.free, tt.total, nil }}
		d.disk()
		if len(d.steps) != 1 || d.steps[0].Verdict != tt.verdict ||
			tt.verdict == "fail" && (d.steps[0].Class != "disk nearly full" || d.steps[0].Where != "here") {
			t.Errorf("%d of %d free: %+v, want %s", tt.free, tt.total, d.steps, tt.verdict)
		}
	}
}

// TestDoctorBucket: with storage type s3, doctor checks the bucket, and
// names what is wrong with it.
func TestDoctorBucket(t *testing.T) {
	srv := miniotest.ForTest(t, "layers")
	t.Setenv("AWS_EC2_METADATA_DISABLED", "true")
	t.Setenv("AWS_CONFIG_FILE", os.DevNull)
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", os.DevNull)
	for _, tt := range []struct {
		name, bucket, secret string
		verdict, class       string
	}{
		{"works", "layers", miniotest.SecretKey, "ok", ""},
		{"no such bucket", "nope", miniotest.SecretKey, "fail", "bucket missing"},
		{"wrong secret", "layers", "wrong-secret", "fail", "bucket credentials refused"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("AWS_ACCESS_KEY_ID", miniotest.AccessKey)
			t.Setenv("AWS_SECRET_ACCESS_KEY", tt.secret)
			d := &doctorRun{cfg: config.File{Storage: config.Storage{Type: "s3", Bucket: tt.bucket,
				Endpoint: srv.Endpoint, PathStyle: true}}}
			d.bucket(t.Context())
			if len(d.steps) != 1 || d.steps[0].Verdict != tt.verdict || d.steps[0].Class != tt.class ||
				tt.verdict == "fail" && d.steps[0].Where != "here" {
				t.Errorf("got %+v, want %s %q", d.steps, tt.verdict, tt.class)
			}
		})
	}
}

// TestCorruptShownWithFix: doctor shows each blob served corrupt, and fails
// the walk when the image needs the blob, with the fix naming pullproxy
// forget.
func TestCorruptShownWithFix(t *testing.T) {
	t.Parallel()
	now := time.Now()
	needed, unrelated := digest.FromString("a layer of the image"), digest.FromString("another image's")
	entries := []upstream.CorruptStatus{
		{Digest: needed, Endpoint: "https://a.test", Failures: 2, Since: now.Add(-time.Minute), RetryAt: now.Add(2 * time.Minute), LastError: "hash to sha256:0000"},
		{Digest: unrelated, Endpoint: "https://a.test", Failures: 1, Since: now.Add(-5 * time.Minute), RetryAt: now.Add(-4 * time.Minute)},
	}
	d := &doctorRun{imageBlobs: map[digest.Digest]bool{needed: true}}
	d.corrupt(entries, now)
	if len(d.steps) != 2 {
		t.Fatalf("doctor steps: got %+v, want 2", d.steps)
	}
	for i, want := range []string{"fail", "warn"} {
		s := d.steps[i]
		if s.Verdict != want || s.Where != "upstream" || !strings.Contains(s.Fix, "pullproxy forget "+entries[i].Digest.String()) {
			t.Errorf("doctor step %d: got %+v, want %s, upstream, the fix naming pullproxy forget", i, s, want)
		}
	}
}
