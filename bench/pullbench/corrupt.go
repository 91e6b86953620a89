package main

import (
	"net/http"
	"strings"
	"sync"
)

// corruptHosts makes the registry serve one blob corrupt to the requests
// that reached it through given relays (their Host header, a relay's
// address): one endpoint of an upstream serving a blob corrupt while the
// others serve it intact, as a replica with a bad copy would.
type corruptHosts struct {
	mu    sync.Mutex
	blobs map[string]string // relay address → the blob's hex digest, in its storage path
}

// set has requests through host get blob hex corrupt; "" ends it.
func (c *corruptHosts) set(host, hex string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if hex == "" {
		delete(c.blobs, host)
		return
	}
	if c.blobs == nil {
		c.blobs = map[string]string{}
	}
	c.blobs[host] = hex
}

// wrap serves next, corrupting the blob's file where set for the request's host.
func (c *corruptHosts) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		hex := c.blobs[r.Host]
		c.mu.Unlock()
		// The redirect's target: the blob's data file in the registry's storage.
		if hex != "" && r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/"+hex+"/data") {
			w = &flippingWriter{ResponseWriter: w}
		}
		next.ServeHTTP(w, r)
	})
}

// flippingWriter flips the first byte of every write: every range of the
// blob it answers is wrong, its length right.
type flippingWriter struct {
	http.ResponseWriter
	buf []byte
}

func (f *flippingWriter) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	f.buf = append(f.buf[:0], p...)
	f.buf[0] ^= 0xff
	return f.ResponseWriter.Write(f.buf)
}
