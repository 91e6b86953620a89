package admin

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestAdminGuardRefusesWhatABrowserSends: on TCP, a request a web page could
// make (an Origin, a rebound Host, no token, a form's content type) is
// refused; the CLI's requests pass. On the socket, only Origin and the
// content type are checked: the socket's mode is the access control.
func TestAdminGuardRefusesWhatABrowserSends(t *testing.T) {
	served := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	tcp := &guard{next: served, hosts: listenerHosts(&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 5001}), token: []byte("s3cret")}
	socket := &guard{next: served}
	const auth = "Bearer s3cret"
	for _, tc := range []struct {
		name                      string
		guard                     *guard
		method, path, host        string
		origin, ctype, authHeader string
		want                      int
	}{
		{"the CLI's seed", tcp, "POST", "/seed", "127.0.0.1:5001", "", "application/json", auth, 200},
		{"the CLI's import", tcp, "POST", "/import", "127.0.0.1:5001", "", "application/x-tar", auth, 200},
		{"the CLI's status", tcp, "GET", "/debug/upstreams", "127.0.0.1:5001", "", "", auth, 200},
		{"localhost with the port", tcp, "GET", "/debug/upstreams", "localhost:5001", "", "", auth, 200},
		{"a form's seed with an Origin", tcp, "POST", "/seed", "127.0.0.1:5001", "http://evil.example", "text/plain", auth, 403},
		{"any Origin, even the listener's", tcp, "GET", "/export", "127.0.0.1:5001", "http://127.0.0.1:5001", "", auth, 403},
		{"a rebound name", tcp, "POST", "/seed", "evil.example:5001", "", "application/json", auth, 421},
		{"another port", tcp, "GET", "/export", "127.0.0.1:5002", "", "", auth, 421},
		{"no token", tcp, "POST", "/seed", "127.0.0.1:5001", "", "application/json", "", 401},
		{"a wrong token", tcp, "POST", "/seed", "127.0.0.1:5001", "", "application/json", "Bearer s3cre", 401},
		{"the token as Basic", tcp, "POST", "/seed", "127.0.0.1:5001", "", "application/json", "Basic s3cret", 401},
		{"a seed as text/plain", tcp, "POST", "/seed", "127.0.0.1:5001", "", "text/plain", auth, 415},
		{"an import as a form", tcp, "POST", "/import", "127.0.0.1:5001", "", "multipart/form-data; boundary=x", auth, 415},
		{"a seed with a charset", tcp, "POST", "/seed", "127.0.0.1:5001", "", "application/json; charset=utf-8", auth, 200},
		{"a POST to a path taking none", tcp, "POST", "/export", "127.0.0.1:5001", "", "application/json", auth, 415},
		{"the socket: the CLI's seed", socket, "POST", "/seed", "pullproxy-admin", "", "application/json", "", 200},
		{"the socket: any Host", socket, "GET", "/debug/upstreams", "evil.example", "", "", "", 200},
		{"the socket: an Origin", socket, "POST", "/seed", "pullproxy-admin", "http://evil.example", "application/json", "", 403},
		{"the socket: text/plain", socket, "POST", "/import", "pullproxy-admin", "", "text/plain", "", 415},
	} {
		r := httptest.NewRequest(tc.method, "http://"+tc.host+tc.path, strings.NewReader("{}"))
		r.Host = tc.host
		for k, v := range map[string]string{"Origin": tc.origin, "Content-Type": tc.ctype, "Authorization": tc.authHeader} {
			if v != "" {
				r.Header.Set(k, v)
			}
		}
		w := httptest.NewRecorder()
		tc.guard.ServeHTTP(w, r)
		if w.Code != tc.want {
			t.Errorf("%s: %d %s, want %d", tc.name, w.Code, strings.TrimSpace(w.Body.String()), tc.want)
		}
	}
}

// TestAdminGuardNeverEchoesTheToken: whatever a refused request carried,
// the right token or a near miss, the answer holds neither the token nor
// the Authorization value sent.
func TestAdminGuardNeverEchoesTheToken(t *testing.T) {
	const token = "7f3c9a41d2e8b6057f3c9a41d2e8b605"
	served := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	g := &guard{next: served, hosts: listenerHosts(&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 5001}), token: []byte(token)}
	for _, tc := range []struct {
		name, host, origin, ctype, auth string
		want                            int
	}{
		{"the token with an Origin", "127.0.0.1:5001", "http://evil.example", "application/json", "Bearer " + token, 403},
		{"the token to a rebound Host", "evil.example:5001", "", "application/json", "Bearer " + token, 421},
		{"the token as text/plain", "127.0.0.1:5001", "", "text/plain", "Bearer " + token, 415},
		{"the token and more", "127.0.0.1:5001", "", "application/json", "Bearer " + token + "0", 401},
		{"the token cut short", "127.0.0.1:5001", "", "application/json", "Bearer " + token[:31], 401},
		{"the token as Basic", "127.0.0.1:5001", "", "application/json", "Basic " + token, 401},
		{"the token without a scheme", "127.0.0.1:5001", "", "application/json", token, 401},
	} {
		r := httptest.NewRequest("POST", "http://"+tc.host+"/seed", strings.NewReader("{}"))
		r.Host = tc.host
		for k, v := range map[string]string{"Origin": tc.origin, "Content-Type": tc.ctype, "Authorization": tc.auth} {
			if v != "" {
				r.Header.Set(k, v)
			}
		}
		w := httptest.NewRecorder()
		g.ServeHTTP(w, r)
		if w.Code != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, w.Code, tc.want)
		}
		answer := w.Body.String()
		for k, vs := range w.Header() {
			answer += k + ": " + strings.Join(vs, ",") + "\n"
		}
		if strings.Contains(answer, token[:16]) {
			t.Errorf("%s: the answer holds the token:\n%s", tc.name, answer)
		}
	}
}

// TestListenAdminRefuses: the admin endpoint listens on loopback or a unix
// socket only; any other address is refused, saying why.
func TestListenAdminRefuses(t *testing.T) {
	for _, tc := range []struct {
		addr    string
		refusal string // what the error says; "": listening
	}{
		{"127.0.0.1:0", ""},
		{"localhost:0", ""},
		{"off", ""},
		{"0.0.0.0:0", "loopback"},
		{":0", "loopback"},
		{"[::]:0", "loopback"},
		{"192.0.2.1:5001", "loopback"},
		{"evil.example:5001", "loopback"},
		{"127.0.0.1", "host:port"},
	} {
		ln, err := Listen(tc.addr)
		if ln != nil {
			ln.Close()
		}
		switch {
		case tc.refusal == "" && err != nil:
			t.Errorf("%s: %v", tc.addr, err)
		case tc.refusal != "" && err == nil:
			t.Errorf("%s: listening, want it refused", tc.addr)
		case tc.refusal != "" && !strings.Contains(err.Error(), tc.refusal):
			t.Errorf("%s: %v, want the error to say %q", tc.addr, err, tc.refusal)
		}
	}
}

func TestListenAdminSocket(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "admin.sock")
	ln, err := Listen("unix:" + path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("%s: %v %v, want a socket of mode 0600", path, fi.Mode(), err)
	}
	if ln.Addr().String() != path {
		t.Errorf("the listener's address is %s, want %s", ln.Addr(), path)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("the directory holds %d entries, want the socket alone", len(entries))
	}
	// A live socket is not taken over.
	if _, err := Listen("unix:" + path); err == nil {
		t.Error("a second listener took over a live socket")
	}
	// A socket no process answers on (left by a killed one) is replaced.
	stale := filepath.Join(dir, "stale.sock")
	sl, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	sl.(*net.UnixListener).SetUnlinkOnClose(false)
	sl.Close()
	if ln, err := Listen("unix:" + stale); err != nil {
		t.Errorf("a stale socket: %v, want it replaced", err)
	} else {
		ln.Close()
	}
	// A regular file is not removed.
	file := filepath.Join(dir, "file")
	os.WriteFile(file, []byte("x"), 0o644)
	if _, err := Listen("unix:" + file); err == nil {
		t.Error("a regular file was replaced by a socket")
	}
	ln.Close()
	if _, err := os.Lstat(path); err == nil {
		t.Error("the socket is left after Close")
	}
}

func TestAdminToken(t *testing.T) {
	path := filepath.Join(t.TempDir(), "admin.token")
	tok, err := readToken(path)
	if err != nil || len(tok) < 32 {
		t.Fatalf("created token %d bytes, %v", len(tok), err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("token file mode %v, %v; want 0600", fi.Mode().Perm(), err)
	}
	again, err := readToken(path)
	if err != nil || string(again) != string(tok) {
		t.Errorf("reread: %q, %v; want the same token", again, err)
	}
	other, _ := readToken(filepath.Join(t.TempDir(), "admin.token"))
	if string(other) == string(tok) {
		t.Error("two token files hold the same token")
	}
	os.Chmod(path, 0o644)
	if _, err := readToken(path); err == nil {
		t.Error("a token file other users can read was taken")
	}
}

// TestAdminShutdownDrains: shutdown returns only once the admin requests
// running have returned: those that finish within the grace, and those
// cancelled after it (an import rolling back), so that none touches the
// store after it closes.
func TestAdminShutdownDrains(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{}, 2)
	var returned atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		if r.URL.Path == "/stuck" {
			<-r.Context().Done() // as an import does, until cancelled
		}
		returned.Add(1)
	})
	a := serve(ln, h, slog.New(slog.NewTextHandler(io.Discard, nil)))
	for _, path := range []string{"/stuck", "/stuck"} {
		go func() {
			if resp, err := http.Get("http://" + ln.Addr().String() + path); err == nil {
				resp.Body.Close()
			}
		}()
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatal("the request did not reach the handler")
		}
	}
	// A tenth of a second to finish, then drainWait to end once
	// cancelled.
	ctx, cancel := context.WithTimeout(context.Background(), drainWait+100*time.Millisecond)
	defer cancel()
	a.Shutdown(ctx)
	if n := returned.Load(); n != 2 {
		t.Errorf("shutdown returned with %d of 2 handlers still running", 2-n)
	}
	a.Shutdown(ctx) // a second call is a no-op
}
