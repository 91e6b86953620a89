package admin

import (
	"crypto/subtle"
	"mime"
	"net"
	"net/http"
	"strings"
)

// The admin endpoint writes to the store, so a request to it must come
// from the operator, not from a web page the operator has open: a browser
// sends a cross-site form (text/plain, no preflight) to any loopback port,
// and with DNS rebinding a page's own name can resolve to 127.0.0.1. A
// browser always sends Origin on such a POST and the page's Host; it cannot
// set Authorization without a preflight that nothing here answers. The
// guard turns away what a browser could forge, before the admin mux.

// contentTypes is the content type each admin POST takes: what the
// CLI sends. Anything else (a form's text/plain, multipart) is refused.
var contentTypes = map[string]string{
	"/seed":   "application/json",
	"/import": "application/x-tar",
	"/forget": "application/json",
}

// guard checks each request before next serves it.
type guard struct {
	next http.Handler
	// hosts are the Host values the listener answers to; empty on a unix
	// socket, where any is taken (no browser reaches a socket by name).
	hosts map[string]bool
	// token is the bearer token a TCP request must carry; nil on a unix
	// socket, where the file's mode is the access control.
	token []byte
}

func (g *guard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Origin") != "" {
		http.Error(w, "admin endpoint: requests from web pages (with an Origin header) are refused", http.StatusForbidden)
		return
	}
	if g.hosts != nil && !g.hosts[strings.ToLower(r.Host)] {
		http.Error(w, "admin endpoint: Host "+truncate(r.Host, 100)+" is not this listener's address", http.StatusMisdirectedRequest)
		return
	}
	if g.token != nil {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(strings.TrimSpace(got)), g.token) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="pullproxy-admin"`)
			http.Error(w, "admin endpoint: a bearer token is required (the admin_token_file's content)", http.StatusUnauthorized)
			return
		}
	}
	if r.Method == http.MethodPost {
		want := contentTypes[r.URL.Path]
		got, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
		if want == "" || got != want {
			http.Error(w, "admin endpoint: POST "+r.URL.Path+" takes Content-Type "+want, http.StatusUnsupportedMediaType)
			return
		}
	}
	g.next.ServeHTTP(w, r)
}

// listenerHosts returns the Host values a TCP listener on addr answers to:
// its address, and localhost with its port.
func listenerHosts(addr net.Addr) map[string]bool {
	_, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		return map[string]bool{strings.ToLower(addr.String()): true}
	}
	return map[string]bool{
		strings.ToLower(addr.String()): true,
		"localhost:" + port:            true,
	}
}

// truncate returns s cut to n bytes, for echoing a client's value.
func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
