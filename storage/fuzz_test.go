package storage

import (
	"testing"

	"github.com/opencontainers/go-digest"
)

// FuzzValidate: the store's quick digest check accepts exactly what the
// digest package does, and never a digest whose path would leave blobs/.
func FuzzValidate(f *testing.F) {
	for _, s := range []string{digest.FromString("x").String(), digest.SHA512.FromString("x").String(),
		"sha256:" + string(make([]byte, 64)), "sha256:../../etc/passwd", "SHA256:abc", "sha256:" + digest.FromString("x").Encoded() + "\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d := digest.Digest(s)
		got, want := validate(d) == nil, d.Validate() == nil
		if got != want {
			t.Fatalf("validate(%q): ok %v, digest.Validate: ok %v", s, got, want)
		}
	})
}
