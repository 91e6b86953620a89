package upstream

import (
	"strings"
	"testing"
)

// FuzzParseChallenge: any WWW-Authenticate header parses without failing,
// and a challenge written with quoted parameters gives them back.
func FuzzParseChallenge(f *testing.F) {
	f.Add(`Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/alpine:pull"`, "https://a/token", "reg")
	f.Add(`Basic realm="ECR"`, `x\"y`, "")
	f.Add(`bearer realm=unquoted, service = "s" ,error="invalid_token"`, "", ",")
	f.Fuzz(func(t *testing.T, header, realm, service string) {
		parseChallenge(header)
		if strings.ContainsAny(realm+service, "\"\\") || strings.ContainsFunc(realm+service, func(r rune) bool { return r < ' ' || r == 0x7f }) {
			return
		}
		ch, ok := parseChallenge(`Bearer realm="` + realm + `",service="` + service + `"`)
		if !ok || ch.scheme != "bearer" || ch.params["realm"] != strings.TrimSpace(realm) || ch.params["service"] != strings.TrimSpace(service) {
			t.Fatalf("realm %q, service %q: parsed as %+v, %v", realm, service, ch, ok)
		}
	})
}
