package imageref

import "testing"

const sixtyFour = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func TestParse(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in      string
		want    Ref
		wantErr bool
	}{
		{in: "alpine:3.20", want: Ref{"docker.io", "library/alpine", "3.20"}},
		{in: "docker.io/library/busybox", want: Ref{"docker.io", "library/busybox", "latest"}},
		{in: "ghcr.io/org/app@sha256:" + sixtyFour, want: Ref{"ghcr.io", "org/app", "sha256:" + sixtyFour}},
		{in: "registry.internal:5000/team/app:v2", want: Ref{"registry.internal:5000", "team/app", "v2"}},
		{in: "Not A Reference", wantErr: true},
	} {
		got, err := Parse(tt.in)
		if (err != nil) != tt.wantErr || !tt.wantErr && got != tt.want {
			t.Errorf("Parse(%q) = %+v, %v; want %+v (error %v)", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}
