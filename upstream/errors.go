package upstream

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// Kinds of upstream failure, checked with errors.Is on an *Error.
var (
	// ErrNotFound: the upstream says the repository, manifest or blob does not exist.
	ErrNotFound = errors.New("not found upstream")
	// ErrUnauthorized: the upstream wants credentials we lack or it rejected.
	ErrUnauthorized = errors.New("unauthorized")
	// ErrDenied: the credentials were accepted but do not grant access.
	ErrDenied = errors.New("denied")
	// ErrTooManyRequests: the upstream is rate limiting us.
	ErrTooManyRequests = errors.New("too many requests")
	// ErrUnavailable: the upstream could not be reached or failed (network, TLS, 5xx).
	ErrUnavailable = errors.New("unavailable")
	// ErrInvalid: the upstream answered with something that breaks the protocol
	// (wrong digest, size over the limit, unexpected status).
	ErrInvalid = errors.New("invalid response")

	// ErrCredentialsRefused is the cause of an ErrUnauthorized or ErrDenied
	// when the request carried credentials from the configuration: the fix
	// is those credentials, not configuring some.
	ErrCredentialsRefused = errors.New("the configured credentials were refused")
)

// Error is a failed exchange with an upstream: where, what, and why.
type Error struct {
	Upstream string // configured upstream name, e.g. docker.io
	Endpoint string // host that answered (or failed to), e.g. registry-1.docker.io
	Op       string // e.g. "GET /v2/library/alpine/manifests/latest"
	Status   int    // HTTP status, 0 when none was received
	Code     string // first OCI error code in the body, e.g. MANIFEST_UNKNOWN
	Message  string // the upstream's own words, or ours when it gave none
	// RetryAfter is the upstream's Retry-After on a 429, if any.
	RetryAfter time.Duration
	Kind       error // one of the Err* kinds above
	Err        error // underlying cause, if any
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "upstream %s", e.Upstream)
	if e.Endpoint != "" && e.Endpoint != e.Upstream {
		fmt.Fprintf(&b, " (%s)", e.Endpoint)
	}
	fmt.Fprintf(&b, ": %s: ", e.Op)
	if e.Status != 0 {
		fmt.Fprintf(&b, "%d ", e.Status)
	}
	if e.Code != "" {
		fmt.Fprintf(&b, "%s: ", e.Code)
	}
	switch {
	case e.Message != "":
		b.WriteString(e.Message)
	case e.Err != nil:
		b.WriteString(e.Err.Error())
	default:
		b.WriteString(e.Kind.Error())
	}
	return b.String()
}

func (e *Error) Unwrap() []error {
	if e.Err != nil {
		return []error{e.Kind, e.Err}
	}
	return []error{e.Kind}
}

// kindOf classifies an HTTP status.
func kindOf(status int) error {
	switch {
	case status == http.StatusNotFound:
		return ErrNotFound
	case status == http.StatusUnauthorized:
		return ErrUnauthorized
	case status == http.StatusForbidden:
		return ErrDenied
	case status == http.StatusTooManyRequests:
		return ErrTooManyRequests
	case status >= 500:
		return ErrUnavailable
	}
	return ErrInvalid
}

// ociErrors is the error body of the distribution spec.
type ociErrors struct {
	Errors []struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"errors"`
}

// statusError builds an Error from a non-success response, reading (a bounded
// part of) its body for the upstream's own error code and message.
func (r *Registry) statusError(host, op string, resp *http.Response) *Error {
	e := &Error{
		Upstream: r.name,
		Endpoint: host,
		Op:       op,
		Status:   resp.StatusCode,
		Kind:     kindOf(resp.StatusCode),
	}
	if resp.StatusCode == http.StatusTooManyRequests {
		e.RetryAfter = parseRetryAfter(resp.Header.Get("Retry-After"))
	}
	if resp.Request != nil && resp.Request.URL != nil && r.targets != nil && !r.targets.isEndpoint(resp.Request.URL) {
		// A redirect target (object storage, a CDN) is not the registry:
		// what it says is not for clients to read, and may echo what it
		// was sent.
		e.Message = strings.ToLower(http.StatusText(resp.StatusCode)) + " (from " + resp.Request.URL.Host + ", where the registry redirected)"
		return e
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 16<<10))
	var oe ociErrors
	if json.Unmarshal(body, &oe) == nil && len(oe.Errors) > 0 {
		e.Code = oe.Errors[0].Code
		e.Message = oe.Errors[0].Message
	} else if resp.Request != nil && resp.Request.Method != http.MethodHead {
		e.Message = strings.TrimSpace(string(body))
		if len(e.Message) > 200 {
			e.Message = e.Message[:200] + "…"
		}
	}
	if e.Message == "" {
		e.Message = strings.ToLower(http.StatusText(resp.StatusCode))
	}
	return e
}

func (r *Registry) transportError(host, op string, err error) *Error {
	// net/http's errors quote the whole URL; after a redirect that is a
	// presigned URL whose query is a credential. Keep only scheme, host, path.
	var ue *url.Error
	if errors.As(err, &ue) {
		if u, perr := url.Parse(ue.URL); perr == nil {
			u.RawQuery, u.User = "", nil
			err = fmt.Errorf("%s %s: %w", ue.Op, u.Redacted(), ue.Err)
		}
	}
	kind := ErrUnavailable
	if errors.Is(err, errTargetRefused) {
		kind = ErrInvalid // the upstream sent pullproxy somewhere it does not go: asking again will not help
	}
	return &Error{Upstream: r.name, Endpoint: host, Op: op, Kind: kind, Err: err}
}

func parseRetryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	var secs int
	if _, err := fmt.Sscanf(v, "%d", &secs); err == nil && secs >= 0 {
		return time.Duration(secs) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}
