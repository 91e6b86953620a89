package proxy

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io/fs"
	"net"
	"net/http"
	"strconv"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/upstream"
)

// ociError is an error as the distribution spec shapes it for clients.
type ociError struct {
	status  int
	code    string
	message string
	// cause is the failure in one line, sent as the reason phrase of the
	// status line (see writeError); "" sends message there.
	cause      string
	retryAfter time.Duration // sent as Retry-After when positive
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
	switch kind {
	case kindManifest:
		unknown = "MANIFEST_UNKNOWN"
	case kindTags:
		unknown = "NAME_UNKNOWN"
	case kindReferrers:
		unknown = "NAME_UNKNOWN" // the one 404 it passes on
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
		if errors.As(err, &ue) {
			e.retryAfter = ue.RetryAfter
		}
	case kind != kindBlob && errors.As(err, &ue) && ue.Status >= 400 && ue.Status < 500 && ue.Status != http.StatusTooManyRequests:
		// The upstream refused a manifest or tag list request as the
		// client made it (a 400 MANIFEST_INVALID for an Accept it cannot
		// serve): the client gets the same status and code. Not for blobs,
		// whose requests upstream are pullproxy's own chunks.
		e.status, e.code = ue.Status, ue.Code
		if e.code == "" {
			e.code = "UNKNOWN"
		}
	case errors.Is(err, upstream.ErrUnavailable), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, errShuttingDown):
		e.status, e.code = http.StatusServiceUnavailable, "UNAVAILABLE"
	case errors.Is(err, upstream.ErrInvalid), errors.Is(err, storage.ErrDigestMismatch), errors.Is(err, storage.ErrSizeMismatch):
		e.status, e.code = http.StatusBadGateway, "UNKNOWN"
	case errors.Is(err, storage.ErrNoSpace):
		// 507, not 503: containerd moves to its next host on any status
		// from 400 up, and a full disk is no reason to retry here.
		e.status, e.code = http.StatusInsufficientStorage, "UNAVAILABLE"
	case errors.Is(err, syscall.ENOSPC):
		e.status, e.code = http.StatusInsufficientStorage, "UNAVAILABLE"
		e.message = "pullproxy's data dir is full: nothing more can be stored until room is made"
	default:
		e.status, e.code = http.StatusInternalServerError, "UNKNOWN"
		// The data dir's paths are the operator's business, not a
		// client's: the log has them.
		if pe := (*fs.PathError)(nil); errors.As(err, &pe) {
			e.message = "pullproxy could not " + pe.Op + " a file of its data dir: " + pe.Err.Error()
		}
	}
	return e
}

// writeError sends e to the client as OCI error JSON, with its cause in
// the status line.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, e *ociError) {
	body := errorHeader(w, e)
	if reason := reasonPhrase(cmp.Or(e.cause, e.message)); reason != "" && s.writeWithReason(w, r, e.status, reason, body) {
		return
	}
	w.WriteHeader(e.status)
	if r.Method != http.MethodHead {
		w.Write(body)
	}
}

// writeErrorJSON sends e as OCI error JSON under the standard status line:
// for errors in the request itself (a range, a precondition), which its
// status names.
func writeErrorJSON(w http.ResponseWriter, r *http.Request, e *ociError) {
	body := errorHeader(w, e)
	w.WriteHeader(e.status)
	if r.Method != http.MethodHead {
		w.Write(body)
	}
}

// errorHeader sets the header of an error response and returns its body.
func errorHeader(w http.ResponseWriter, e *ociError) []byte {
	body, _ := json.Marshal(map[string]any{
		"errors": []map[string]string{{"code": e.code, "message": e.message}},
	})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Del("Docker-Content-Digest")
	h.Del("Etag")
	h.Del("Accept-Ranges")
	h.Del("Cache-Control") // an error is no answer to keep
	h.Del("Pullproxy-Source")
	if e.retryAfter > 0 {
		h.Set("Retry-After", strconv.FormatInt(int64((e.retryAfter+time.Second-1)/time.Second), 10))
	}
	return body
}

// corruptFix is the fix for err when it says that d's bytes from the
// upstream failed verification, and "" otherwise: the operator pushes it
// again upstream, then has pullproxy ask for it at once.
func corruptFix(err error, d digest.Digest) string {
	if !errors.Is(err, storage.ErrDigestMismatch) || errors.Is(err, storage.ErrChangedOnDisk) || d.Validate() != nil {
		return ""
	}
	return upstream.CorruptFix(d)
}

// hint turns a failure into the likely fix, for the operator's log line.
func hint(err error) string {
	var (
		dnsErr   *net.DNSError
		netErr   net.Error
		certErr  *tls.CertificateVerificationError
		authErr  x509.UnknownAuthorityError
		hostErr  x509.HostnameError
		invalid  x509.CertificateInvalidError
		alertErr tls.AlertError
		recErr   tls.RecordHeaderError
	)
	switch {
	case errors.Is(err, upstream.ErrCredentialsRefused):
		return "check the upstream's credentials: wrong, expired, or lacking pull permission"
	case errors.Is(err, upstream.ErrUnauthorized):
		return "configure credentials for this upstream, or check that the image is public"
	case errors.Is(err, upstream.ErrDenied):
		return "the credentials lack pull permission on this repository"
	case errors.Is(err, upstream.ErrTooManyRequests):
		return "the upstream is rate limiting this address: authenticate, or pre-seed the images"
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, storage.ErrNoSpace):
		return "the data dir's disk is full: free space or give pullproxy a larger volume"
	case errors.As(err, &dnsErr):
		return "DNS cannot resolve the endpoint: check its URL and the resolver"
	case errors.As(err, &certErr), errors.As(err, &authErr), errors.As(err, &hostErr), errors.As(err, &invalid):
		return "the endpoint's certificate does not verify: check its URL and the CA bundle"
	case errors.As(err, &alertErr), errors.As(err, &recErr):
		return "TLS failed: check that the endpoint speaks HTTPS, and its TLS settings"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "nothing listens at the endpoint: check its URL and port"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return "the endpoint did not answer in time: check the network path"
	case errors.Is(err, storage.ErrDigestMismatch), errors.Is(err, storage.ErrSizeMismatch):
		return "the upstream serves content that does not match its digest, and nothing was cached: " +
			"delete the blob upstream and push it again, then run `pullproxy forget <digest>` to fetch it at once"
	}
	return ""
}
