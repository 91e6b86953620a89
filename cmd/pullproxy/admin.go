package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/pullproxy/pullproxy/upstream"
)

// The admin endpoint takes seeds (and imports) into a running server. It
// listens apart from the registry API, on loopback or a unix socket by
// default, so that nodes, which reach the registry listener, cannot fill
// the store.

// defaultAdminListen is where the admin endpoint listens unless told.
const defaultAdminListen = "127.0.0.1:5001"

// listenAdmin opens the admin listener: "off", "unix:/path", or host:port.
// It returns nil for off.
func listenAdmin(addr string) (net.Listener, error) {
	switch {
	case addr == "off":
		return nil, nil
	case strings.HasPrefix(addr, "unix:"):
		path := strings.TrimPrefix(addr, "unix:")
		os.Remove(path) // a socket left by a killed process
		ln, err := net.Listen("unix", path)
		if err != nil {
			return nil, fmt.Errorf("admin_listen %s: %w", addr, err)
		}
		os.Chmod(path, 0o600) // the operator's, as root or the service's user
		return ln, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("admin_listen %s: %w (set admin_listen: off, or another address)", addr, err)
	}
	return ln, nil
}

// adminHandler serves the admin endpoint over m, whose data dir is dataDir.
func adminHandler(m *mirror, dataDir string, log *slog.Logger) http.Handler {
	srv := m.srv
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/upstreams", func(w http.ResponseWriter, r *http.Request) {
		st := []upstream.Status{}
		for _, u := range m.upstreams {
			st = append(st, u.Status())
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(st)
	})
	mux.HandleFunc("GET /export", func(w http.ResponseWriter, r *http.Request) {
		var pins []pinnedImage
		for _, ref := range r.URL.Query()["ref"] {
			p, err := parsePin(ref)
			if err != nil {
				http.Error(w, "export: "+err.Error(), http.StatusBadRequest)
				return
			}
			pins = append(pins, p)
		}
		if len(pins) == 0 {
			http.Error(w, "export: want ?ref=registry/repository:tag (repeatable)", http.StatusBadRequest)
			return
		}
		log.Info("exporting through the admin endpoint", "refs", r.URL.Query()["ref"])
		// The archive is assembled first, so that a failure is an error
		// status rather than a tar cut short.
		tmp, err := os.CreateTemp(dataDir, ".export-*")
		if err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusInternalServerError)
			return
		}
		defer os.Remove(tmp.Name())
		defer tmp.Close()
		if err := exportImages(r.Context(), srv, pins, dataDir, tmp, io.Discard, false); err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusBadGateway)
			return
		}
		fi, err := tmp.Stat()
		if err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/x-tar")
		w.Header().Set("Content-Length", fmt.Sprint(fi.Size()))
		http.NewResponseController(w).SetWriteDeadline(time.Time{})
		io.Copy(w, io.NewSectionReader(tmp, 0, fi.Size()))
	})
	mux.HandleFunc("POST /import", func(w http.ResponseWriter, r *http.Request) {
		// The archive is kept beside the store first: reading an image
		// layout needs random access.
		tmp, err := os.CreateTemp(dataDir, ".import-upload-*")
		if err != nil {
			http.Error(w, "import: "+err.Error(), http.StatusInternalServerError)
			return
		}
		defer os.Remove(tmp.Name())
		_, err = io.Copy(tmp, r.Body)
		if cerr := tmp.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			http.Error(w, "import: receiving the archive: "+err.Error(), http.StatusBadRequest)
			return
		}
		name := r.URL.Query().Get("name")
		if name == "" {
			name = "the archive"
		}
		log.Info("importing through the admin endpoint", "archive", name)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		imp := newImporter(m, tmp.Name(), r.URL.Query().Get("retag") == "1")
		if err := imp.run(r.Context(), dataDir); err != nil {
			fmt.Fprintf(w, "error %s: %v\n", name, err)
			return
		}
		imp.report(w, name)
		fmt.Fprintln(w, "done")
	})
	mux.HandleFunc("POST /seed", func(w http.ResponseWriter, r *http.Request) {
		var req seedRequest
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || len(req.Refs) == 0 {
			http.Error(w, "want JSON: {\"refs\": [...], \"platforms\": [...], \"referrers\": bool}", http.StatusBadRequest)
			return
		}
		log.Info("seeding through the admin endpoint", "refs", req.Refs, "platforms", req.Platforms, "referrers", req.Referrers)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fw := flushWriter{w, http.NewResponseController(w)}
		// The client reads the progress as it comes; a seed takes longer
		// than any write timeout.
		fw.rc.SetWriteDeadline(time.Time{})
		if err := seedImages(r.Context(), srv, req, fw, false); err != nil {
			fmt.Fprintln(fw, err)
			return
		}
		fmt.Fprintln(fw, "done")
	})
	return mux
}

// flushWriter sends each write to the client at once.
type flushWriter struct {
	w  io.Writer
	rc *http.ResponseController
}

func (f flushWriter) Write(p []byte) (int, error) {
	n, err := f.w.Write(p)
	f.rc.Flush()
	return n, err
}

// adminClient returns the client and base URL that reach an admin
// endpoint named as --server takes it: a URL (http://127.0.0.1:5001), or
// unix:/path for a socket.
func adminClient(server string) (*http.Client, string) {
	path, ok := strings.CutPrefix(server, "unix:")
	if !ok {
		return http.DefaultClient, strings.TrimSuffix(server, "/")
	}
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		},
	}}, "http://pullproxy-admin"
}

// errAdminRefused: the admin endpoint answered, with a status other than 200.
var errAdminRefused = errors.New("the admin endpoint refused")

// adminCall sends a request to the admin endpoint named by server (see
// adminClient) and returns its answer, which is a 200: any other status is
// an error wrapping errAdminRefused with what the endpoint said. The caller
// closes the body.
func adminCall(ctx context.Context, server, method, pathAndQuery, contentType string, body io.Reader) (*http.Response, error) {
	client, base := adminClient(server)
	req, err := http.NewRequestWithContext(ctx, method, base+pathAndQuery, body)
	if err != nil {
		return nil, fmt.Errorf("--server %q: %w", server, err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("reaching the admin endpoint: %w (is admin_listen set on the server?)", err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s: %s", errAdminRefused, resp.Status, strings.TrimSpace(string(b)))
	}
	return resp, nil
}
