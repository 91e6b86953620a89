package main

import "testing"

func TestParseStoreBound(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in      string
		want    storeBound
		wantErr bool
	}{
		{in: "100MiB", want: storeBound{bytes: 100 << 20, set: true}},
		{in: "2GB", want: storeBound{bytes: 2e9, set: true}},
		{in: "80%", want: storeBound{percent: 80, set: true}},
		{in: " 92.5 % ", want: storeBound{percent: 92.5, set: true}},
		{in: "off", want: storeBound{off: true, set: true}},
		{in: "0", wantErr: true},
		{in: "-1", wantErr: true},
		{in: "101%", wantErr: true},
		{in: "3%", wantErr: true},
		{in: "lots", wantErr: true},
	} {
		got, err := parseStoreBound(tt.in)
		if (err != nil) != tt.wantErr || !tt.wantErr && got != tt.want {
			t.Errorf("parseStoreBound(%q) = %+v, %v; want %+v (error %v)", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestParsePin(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in      string
		want    pinnedImage
		wantErr bool
	}{
		{in: "alpine:3.20", want: pinnedImage{"docker.io", "library/alpine", "3.20"}},
		{in: "docker.io/library/busybox", want: pinnedImage{"docker.io", "library/busybox", "latest"}},
		{in: "ghcr.io/org/app@sha256:" + sixtyFour, want: pinnedImage{"ghcr.io", "org/app", "sha256:" + sixtyFour}},
		{in: "registry.internal:5000/team/app:v2", want: pinnedImage{"registry.internal:5000", "team/app", "v2"}},
		{in: "Not A Reference", wantErr: true},
	} {
		got, err := parsePin(tt.in)
		if (err != nil) != tt.wantErr || !tt.wantErr && got != tt.want {
			t.Errorf("parsePin(%q) = %+v, %v; want %+v (error %v)", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

const sixtyFour = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
