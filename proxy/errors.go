package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// ociError is an error as the distribution spec shapes it for clients.
type ociError struct {
	status  int
	code    string
	message string
}

func (e *ociError) Error() string { return e.code + ": " + e.message }

func errUnsupported(msg string) *ociError {
	return &ociError{status: http.StatusNotFound, code: "UNSUPPORTED", message: msg}
}

// toOCI maps any error met while serving a request of the given kind to what
// the client is told. It is the one place that decides status codes.
func toOCI(err error, kind string) *ociError {
	var oe *ociError
	if errors.As(err, &oe) {
		return oe
	}
	unknown := "BLOB_UNKNOWN"
	if kind == kindManifest {
		unknown = "MANIFEST_UNKNOWN"
	}
	e := &ociError{message: err.Error()}
	var ue *upstream.Error
	switch {
	case errors.Is(err, storage.ErrNotFound):
		e.status, e.code = http.StatusNotFound, unknown
	case errors.Is(err, upstream.ErrNotFound):
		e.status, e.code = http.StatusNotFound, unknown
		if errors.As(err, &ue) && ue.Code == "NAME_UNKNOWN" {
			e.code = ue.Code
		}
	case errors.Is(err, upstream.ErrUnauthorized):
		e.status, e.code = http.StatusUnauthorized, "UNAUTHORIZED"
	case errors.Is(err, upstream.ErrDenied):
		e.status, e.code = http.StatusForbidden, "DENIED"
	case errors.Is(err, upstream.ErrTooManyRequests):
		e.status, e.code = http.StatusTooManyRequests, "TOOMANYREQUESTS"
	case errors.Is(err, upstream.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
		e.status, e.code = http.StatusServiceUnavailable, "UNAVAILABLE"
	case errors.Is(err, upstream.ErrInvalid), errors.Is(err, storage.ErrDigestMismatch), errors.Is(err, storage.ErrSizeMismatch):
		e.status, e.code = http.StatusBadGateway, "UNKNOWN"
	default:
		e.status, e.code = http.StatusInternalServerError, "UNKNOWN"
	}
	return e
}

// writeError sends err to the client as OCI error JSON.
func writeError(w http.ResponseWriter, r *http.Request, e *ociError) {
	body, _ := json.Marshal(map[string]any{
		"errors": []map[string]string{{"code": e.code, "message": e.message}},
	})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Del("Docker-Content-Digest")
	w.WriteHeader(e.status)
	if r.Method != http.MethodHead {
		w.Write(body)
	}
}

// hint turns a failure into the likely fix, for the operator's log line.
func hint(err error) string {
	msg := err.Error()
	switch {
	case errors.Is(err, upstream.ErrUnauthorized) && strings.Contains(msg, "were refused"):
		return "check the upstream's credentials: wrong, expired, or lacking pull permission"
	case errors.Is(err, upstream.ErrUnauthorized):
		return "configure credentials for this upstream, or check that the image is public"
	case errors.Is(err, upstream.ErrDenied):
		return "the credentials lack pull permission on this repository"
	case errors.Is(err, upstream.ErrTooManyRequests):
		return "the upstream is rate limiting this address: authenticate, or pre-seed the images"
	case strings.Contains(msg, "no space left on device"):
		return "the data dir's disk is full: free space or give pullproxy a larger volume"
	case strings.Contains(msg, "no such host"):
		return "DNS cannot resolve the endpoint: check its URL and the resolver"
	case strings.Contains(msg, "x509:"), strings.Contains(msg, "tls:"):
		return "TLS failed: check the endpoint's certificate and the CA bundle"
	case strings.Contains(msg, "connection refused"):
		return "nothing listens at the endpoint: check its URL and port"
	case errors.Is(err, context.DeadlineExceeded), strings.Contains(msg, "timeout"):
		return "the endpoint did not answer in time: check the network path"
	case errors.Is(err, storage.ErrDigestMismatch), errors.Is(err, storage.ErrSizeMismatch):
		return "the upstream serves content that does not match its digest: nothing was cached"
	}
	return ""
}
