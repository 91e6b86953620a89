package upstream

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// challenge is a parsed WWW-Authenticate header.
type challenge struct {
	scheme string            // lower case: "bearer" or "basic"
	params map[string]string // lower-case keys
}

// parseChallenge parses the first challenge of a WWW-Authenticate header:
// `Bearer realm="https://auth.docker.io/token",service="registry.docker.io"`.
func parseChallenge(h string) (challenge, bool) {
	scheme, rest, _ := strings.Cut(strings.TrimSpace(h), " ")
	if scheme == "" {
		return challenge{}, false
	}
	c := challenge{scheme: strings.ToLower(scheme), params: map[string]string{}}
	for rest = strings.TrimSpace(rest); rest != ""; {
		key, after, ok := strings.Cut(rest, "=")
		if !ok {
			break
		}
		key = strings.ToLower(strings.TrimSpace(key))
		var val string
		if strings.HasPrefix(after, `"`) {
			// Quoted string: runs to the next unescaped quote.
			var b strings.Builder
			i := 1
			for ; i < len(after) && after[i] != '"'; i++ {
				if after[i] == '\\' && i+1 < len(after) {
					i++
				}
				b.WriteByte(after[i])
			}
			val, after = b.String(), after[min(i+1, len(after)):]
		} else {
			val, after, _ = strings.Cut(after, ",")
			after = "," + after
		}
		c.params[key] = strings.TrimSpace(val)
		rest = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(after), ","))
	}
	return c, true
}

// token is a bearer token and when to replace it.
type token struct {
	value     string
	refreshAt time.Time
}

// tokenSafetyMargin is how long before its stated expiry a token is replaced,
// so a request never starts with a token about to lapse in flight. Short-lived
// tokens are replaced after half their life instead.
const tokenSafetyMargin = 30 * time.Second

// tokenCache holds bearer tokens per (realm, service, scope), and fetches them
// from the token endpoint named in a challenge.
type tokenCache struct {
	client *http.Client

	mu     sync.Mutex
	tokens map[string]token
	// Concurrent requests for one missing token share one fetch.
	inflight map[string]*tokenFetch
}

type tokenFetch struct {
	done chan struct{}
	tok  token
	err  error
}

func newTokenCache(client *http.Client) *tokenCache {
	return &tokenCache{client: client, tokens: map[string]token{}, inflight: map[string]*tokenFetch{}}
}

func tokenKey(realm, service, scope string) string { return realm + " " + service + " " + scope }

// cached returns a still-valid token for the key, if any.
func (c *tokenCache) cached(key string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, ok := c.tokens[key]
	if !ok || time.Now().After(t.refreshAt) {
		return "", false
	}
	return t.value, true
}

// pruneLocked drops tokens past their replacement time: one is kept per
// repository ever pulled, and most repositories are not pulled again soon.
func (c *tokenCache) pruneLocked(now time.Time) {
	for k, t := range c.tokens {
		if now.After(t.refreshAt) {
			delete(c.tokens, k)
		}
	}
}

// forget drops a token the registry refused.
func (c *tokenCache) forget(key string) {
	c.mu.Lock()
	delete(c.tokens, key)
	c.mu.Unlock()
}

// get returns a token for the challenge and scope, fetching it if needed.
// Concurrent callers share one fetch, which runs detached from any one of
// them, so a caller that gives up neither waits for it nor cancels it.
// creds, when it returns ok, gives the basic credentials to send to the
// token endpoint at realm (authenticated pulls); else the token is
// anonymous.
func (c *tokenCache) get(ctx context.Context, ch challenge, scope string,
	creds func(ctx context.Context, realm *url.URL) (user, pass string, ok bool, err error)) (string, string, error) {
	realm, service := ch.params["realm"], ch.params["service"]
	if realm == "" {
		return "", "", errors.New("bearer challenge names no realm")
	}
	key := tokenKey(realm, service, scope)
	c.mu.Lock()
	if t, ok := c.tokens[key]; ok && time.Now().Before(t.refreshAt) {
		c.mu.Unlock()
		return t.value, key, nil
	}
	f, joined := c.inflight[key]
	if !joined {
		f = &tokenFetch{done: make(chan struct{})}
		c.inflight[key] = f
	}
	c.mu.Unlock()
	if !joined {
		go func() {
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			f.tok, f.err = c.fetch(fctx, realm, service, scope, creds)
			c.mu.Lock()
			delete(c.inflight, key)
			if f.err == nil {
				c.tokens[key] = f.tok
				c.pruneLocked(time.Now())
			}
			c.mu.Unlock()
			close(f.done)
		}()
	}
	select {
	case <-f.done:
	case <-ctx.Done():
		return "", "", ctx.Err()
	}
	return f.tok.value, key, f.err
}

func (c *tokenCache) fetch(ctx context.Context, realm, service, scope string,
	creds func(context.Context, *url.URL) (string, string, bool, error)) (token, error) {
	u, err := url.Parse(realm)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") {
		return token{}, fmt.Errorf("token realm %q is not an http(s) URL", realm)
	}
	q := u.Query()
	if service != "" {
		q.Set("service", service)
	}
	if scope != "" {
		q.Set("scope", scope)
	}
	u.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return token{}, err
	}
	if creds != nil {
		user, pass, ok, err := creds(ctx, u)
		if err != nil {
			return token{}, fmt.Errorf("credentials for the token from %s: %w", u.Host, err)
		}
		if ok {
			req.SetBasicAuth(user, pass)
		}
	}
	resp, err := c.client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its URL would repeat the scope and realm at length
		}
		return token{}, fmt.Errorf("getting token from %s: %w: %w", u.Host, ErrUnavailable, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		kind := ErrUnauthorized
		if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests {
			kind = ErrUnavailable
		}
		return token{}, fmt.Errorf("getting token from %s: %w: %s", u.Host, kind, resp.Status)
	}
	var body struct {
		Token       string    `json:"token"`
		AccessToken string    `json:"access_token"`
		ExpiresIn   int       `json:"expires_in"`
		IssuedAt    time.Time `json:"issued_at"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&body); err != nil {
		return token{}, fmt.Errorf("decoding token from %s: %w", u.Host, err)
	}
	t := token{value: body.Token}
	if t.value == "" {
		t.value = body.AccessToken
	}
	if t.value == "" {
		return token{}, fmt.Errorf("token endpoint %s returned no token", u.Host)
	}
	// The spec's default lifetime when none is given is 60 s. Measure from
	// now, not issued_at: clocks disagree, and now is the conservative end.
	life := time.Duration(body.ExpiresIn) * time.Second
	if life <= 0 {
		life = 60 * time.Second
	}
	t.refreshAt = time.Now().Add(life - min(tokenSafetyMargin, life/2))
	return t, nil
}
