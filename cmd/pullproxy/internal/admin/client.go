package admin

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
)

// The commands that talk to a running server (seed, import, export,
// status, doctor) find its admin endpoint where the server's own
// configuration puts it: the socket in the data dir, or the admin_listen
// of the config, with the token from its token file. Never a fixed port:
// whatever else holds a port would be sent the request, and the token.

// Target is a running server's admin endpoint, as a command reaches it.
type Target struct {
	socket string // a unix socket's path; or
	url    string // http://host:port, with
	token  string // the bearer token it requires
}

func (t Target) String() string {
	if t.socket != "" {
		return "unix:" + t.socket
	}
	return t.url
}

// Flags are the flags of a command that calls the admin endpoint, with
// --data-dir and --config (config.CommandFlags): an explicit address, and the
// token file for a TCP one.
type Flags struct {
	Server    string // --server: the endpoint's address, when given
	TokenFile string // --admin-token-file
}

// Register adds the flags to fs; what says what the command does through
// the endpoint.
func (a *Flags) Register(fs *flag.FlagSet, what string) {
	fs.StringVar(&a.Server, "server", "", what+" through a running pullproxy's admin endpoint at this address: unix:/path, "+
		"or http://host:port (default: the one the data dir or config names, when a server runs on it)")
	fs.StringVar(&a.TokenFile, "admin-token-file", "", "the admin endpoint's token, for a TCP address (default: the config's admin_token_file, or DATA-DIR/admin.token)")
}

// Target returns the admin endpoint to call: --server if given, else the
// one cfg names.
func (a *Flags) Target(cfg config.File) (Target, error) {
	if a.TokenFile != "" {
		cfg.AdminTokenFile = a.TokenFile
	}
	addr := a.Server
	if addr == "" {
		addr = cfg.AdminAddress()
		if addr == "off" {
			return Target{}, errors.New("the admin endpoint is off (admin_listen: off)")
		}
		if _, port, err := net.SplitHostPort(addr); !strings.HasPrefix(addr, "unix:") && (err != nil || port == "0") {
			return Target{}, fmt.Errorf("admin_listen %s names no port to reach: give --server", addr)
		}
		if !strings.HasPrefix(addr, "unix:") {
			addr = "http://" + addr
		}
	}
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		return Target{socket: path}, nil
	}
	u, err := url.Parse(addr)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return Target{}, fmt.Errorf("--server %q: want unix:/path or http://host:port", addr)
	}
	file := cfg.AdminTokenPath()
	b, err := os.ReadFile(file)
	if err != nil {
		return Target{}, fmt.Errorf("the admin endpoint's token: %w (give --admin-token-file, or run as the server's user)", err)
	}
	return Target{url: strings.TrimSuffix(u.Scheme+"://"+u.Host, "/"), token: string(bytes.TrimSpace(b))}, nil
}

// client returns the HTTP client and base URL that reach t.
func (t Target) client() (*http.Client, string) {
	if t.socket == "" {
		return http.DefaultClient, t.url
	}
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", t.socket)
		},
		ExpectContinueTimeout: time.Second, // as http.DefaultTransport's
	}}, "http://pullproxy-admin"
}

// ErrRefused: the admin endpoint answered, with a status other than 200.
var ErrRefused = errors.New("the admin endpoint refused")

// Call sends a request to the admin endpoint t and returns its
// answer, which is a 200: any other status is an error wrapping
// ErrRefused with what the endpoint said. A file body is sent with
// its size. The caller closes the body.
func Call(ctx context.Context, t Target, method, pathAndQuery, contentType string, body io.Reader) (*http.Response, error) {
	client, base := t.client()
	req, err := http.NewRequestWithContext(ctx, method, base+pathAndQuery, body)
	if err != nil {
		return nil, fmt.Errorf("admin endpoint %s: %w", t, err)
	}
	if f, ok := body.(*os.File); ok {
		fi, err := f.Stat()
		if err != nil {
			return nil, err
		}
		req.ContentLength = fi.Size()
		// The server says whether it takes that size before the bytes go.
		req.Header.Set("Expect", "100-continue")
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if t.token != "" {
		req.Header.Set("Authorization", "Bearer "+t.token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("reaching the admin endpoint %s: %w (is a server running there?)", t, err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s: %s", ErrRefused, resp.Status, strings.TrimSpace(string(b)))
	}
	return resp, nil
}
