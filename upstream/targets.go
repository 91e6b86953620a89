package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// targets decides where an upstream's requests may go besides its own
// endpoints, and which of them carry its credentials. A registry sends
// pullproxy on to other hosts: a token realm named in its challenge, a
// blob's or manifest's redirect (object storage, a CDN). A registry that
// lies, or a compromised one, must not thereby get the credentials sent to
// another host, nor make pullproxy fetch from inside its own network:
//
//   - credentials (Basic, or Bearer tokens) go only to the endpoints'
//     origins (scheme, host, port), and to a token realm on one of them or
//     on a host the upstream allows (Docker Hub's auth.docker.io); never
//     over plain http unless the endpoint itself is http. A realm elsewhere
//     gets an anonymous token request;
//   - a redirect drops Authorization when it leaves the origin, goes only to
//     http(s), not from https down to http, and not to a loopback,
//     link-local (cloud metadata: 169.254.169.254) or private address,
//     unless an endpoint of the upstream was reached at an address of that
//     kind (a registry inside the site redirecting to storage inside it) or
//     the upstream's redirect_allow names the host or network. The address
//     is checked where the connection is opened, so a name that resolves
//     to a public address when looked at and a private one when dialled is
//     caught too;
//   - the body of a redirect target's error never reaches a client (see
//     Registry.statusError).
type targets struct {
	log        *slog.Logger
	origins    []origin
	realmHosts map[string]bool // lower-case hosts a realm may be on and get credentials (https only)
	allowHosts map[string]bool // lower-case hosts a redirect may go to whatever their address and scheme
	allowNets  []netip.Prefix  // addresses a redirect may go to
	direct     map[string]bool // lower-case host:port dialled unchecked: the endpoints and proxies
	classify   func(netip.Addr) addrClass
	resolve    func(ctx context.Context, host string) ([]netip.Addr, error)

	reached atomic.Uint32 // bit per addrClass an endpoint was reached at

	warnedMu sync.Mutex
	warned   map[string]bool // realm hosts credentials were withheld from, warned about once
}

// origin is a URL's scheme, host and port, as credentials are scoped.
type origin struct{ scheme, hostPort string }

func originOf(u *url.URL) origin {
	return origin{strings.ToLower(u.Scheme), strings.ToLower(dialAddr(u))}
}

// addrClass is the kind of network an address belongs to.
type addrClass uint8

const (
	classPublic    addrClass = iota
	classPrivate             // RFC 1918, RFC 6598 (carrier-grade NAT), RFC 4193
	classLoopback            // 127.0.0.0/8, ::1
	classLinkLocal           // 169.254.0.0/16 (cloud metadata services), fe80::/10
	classNever               // unspecified, multicast, broadcast: never dialled
)

var classNames = [...]string{classPublic: "public", classPrivate: "private", classLoopback: "loopback",
	classLinkLocal: "link-local", classNever: "unroutable"}

var (
	sharedAddressSpace = netip.MustParsePrefix("100.64.0.0/10")
	limitedBroadcast   = netip.MustParseAddr("255.255.255.255")
)

// classifyAddr returns the class of a.
func classifyAddr(a netip.Addr) addrClass {
	a = a.Unmap()
	switch {
	case a.IsLoopback():
		return classLoopback
	case a.IsLinkLocalUnicast():
		return classLinkLocal
	case a.IsPrivate() || sharedAddressSpace.Contains(a):
		return classPrivate
	case !a.IsValid() || a.IsUnspecified() || a.IsMulticast() || a == limitedBroadcast:
		return classNever
	}
	return classPublic
}

func lookupHost(ctx context.Context, host string) ([]netip.Addr, error) {
	return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
}

// knownRealmHosts are the token realms of well-known registries that are
// not on the registry's own host, by endpoint host.
var knownRealmHosts = map[string][]string{
	"registry-1.docker.io": {"auth.docker.io"},
	"registry.gitlab.com":  {"gitlab.com"},
}

// newTargets returns the policy for an upstream served by endpoints, whose
// requests go through proxy (nil: none). realmHosts and allow extend it
// (see WithTokenRealmHosts, WithRedirectAllow).
func newTargets(log *slog.Logger, endpoints []*url.URL, proxy func(*http.Request) (*url.URL, error),
	realmHosts, allow []string) (*targets, error) {
	t := &targets{log: log, realmHosts: map[string]bool{}, allowHosts: map[string]bool{}, direct: map[string]bool{},
		classify: classifyAddr, resolve: lookupHost, warned: map[string]bool{}}
	probes := []*url.URL{{Scheme: "https", Host: "redirect.invalid"}, {Scheme: "http", Host: "redirect.invalid"}}
	for _, u := range endpoints {
		t.origins = append(t.origins, originOf(u))
		t.direct[strings.ToLower(dialAddr(u))] = true
		for _, h := range knownRealmHosts[strings.ToLower(u.Hostname())] {
			t.realmHosts[h] = true
		}
		probes = append(probes, u)
	}
	// The proxy's address is where connections go when one is set: what
	// lies behind it is the proxy's to reach.
	if proxy != nil {
		for _, u := range probes {
			if p, err := proxy(&http.Request{URL: u}); err == nil && p != nil {
				t.direct[strings.ToLower(dialAddr(p))] = true
			}
		}
	}
	for _, h := range realmHosts {
		t.realmHosts[strings.ToLower(strings.TrimSpace(h))] = true
	}
	for _, a := range allow {
		a = strings.TrimSpace(a)
		if p, err := netip.ParsePrefix(a); err == nil {
			t.allowNets = append(t.allowNets, p.Masked())
		} else if ip, err := netip.ParseAddr(a); err == nil {
			t.allowNets = append(t.allowNets, netip.PrefixFrom(ip, ip.BitLen()))
		} else if a != "" && !strings.ContainsAny(a, "/:@ ") {
			t.allowHosts[strings.ToLower(a)] = true
		} else {
			return nil, fmt.Errorf("redirect_allow entry %q: want a host name, an address or a network (10.0.0.0/8)", a)
		}
	}
	return t, nil
}

// isEndpoint reports whether u is on one of the endpoints' origins.
func (t *targets) isEndpoint(u *url.URL) bool {
	o := originOf(u)
	for _, e := range t.origins {
		if e == o {
			return true
		}
	}
	return false
}

// realmCredentials reports why credentials may not go to a token realm
// named by the challenge of endpoint ep, or nil when they may.
func (t *targets) realmCredentials(realm, ep *url.URL) error {
	switch {
	case originOf(realm) == originOf(ep):
		return nil
	case strings.EqualFold(realm.Scheme, "http") && !strings.EqualFold(ep.Scheme, "http"):
		return fmt.Errorf("token realm %s is plain http while the endpoint is %s", realm.Redacted(), ep.Scheme)
	case t.realmHosts[strings.ToLower(realm.Hostname())]:
		return nil
	}
	return fmt.Errorf("token realm %s is not on the endpoint's origin %s", realm.Host, ep.Host)
}

// withheld logs, once per realm host, that credentials were not sent to it.
func (t *targets) withheld(realm *url.URL, why error) {
	host := strings.ToLower(realm.Host)
	t.warnedMu.Lock()
	first := !t.warned[host]
	t.warned[host] = true
	t.warnedMu.Unlock()
	if first {
		t.log.Warn("credentials withheld from a token realm; asking it for an anonymous token",
			"realm_host", realm.Host, "why", why.Error(),
			"fix", "if this realm is genuinely the registry's, list its host in the upstream's token_realm_hosts")
	}
}

// checkRedirect refuses a redirect from → to that leaves http(s) or goes
// from https down to http, unless the upstream allows its host.
func (t *targets) checkRedirect(from, to *url.URL) error {
	scheme := strings.ToLower(to.Scheme)
	switch {
	case scheme != "http" && scheme != "https":
		return fmt.Errorf("redirect to a %q URL: %w: only http(s) is followed", to.Scheme, errTargetRefused)
	case to.Host == "":
		return fmt.Errorf("redirect to a URL without a host: %w", errTargetRefused)
	case scheme == "http" && strings.EqualFold(from.Scheme, "https") && !t.allowHosts[strings.ToLower(to.Hostname())]:
		return fmt.Errorf("redirect from https down to plain http (%s): %w; "+
			"list the host in the upstream's redirect_allow if that is intended", to.Host, errTargetRefused)
	}
	return nil
}

// clientRedirect is the CheckRedirect of the client that follows redirects
// (manifests, HEADs, tokens): checkRedirect's rules, and no Authorization
// beyond the first request's origin. net/http keeps it on a redirect to
// the same host on another port.
func (t *targets) clientRedirect(req *http.Request, via []*http.Request) error {
	if len(via) >= 10 {
		return fmt.Errorf("stopped after 10 redirects: %w", errTargetRefused)
	}
	if err := t.checkRedirect(via[len(via)-1].URL, req.URL); err != nil {
		return err
	}
	if originOf(req.URL) != originOf(via[0].URL) {
		req.Header.Del("Authorization")
	}
	return nil
}

// guard wraps dial: an endpoint's or a proxy's address is dialled as it
// is, and the class of the address it was reached at noted; any other host
// is resolved here, and dialled at an address whose class is allowed
// (public, a class an endpoint was reached at, or in redirect_allow).
func (t *targets) guard(dial dialFunc) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		if t.direct[strings.ToLower(addr)] {
			c, err := dial(ctx, network, addr)
			if err == nil {
				if ap, perr := netip.ParseAddrPort(c.RemoteAddr().String()); perr == nil {
					t.reached.Or(1 << t.classify(ap.Addr()))
				}
			}
			return c, err
		}
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		var addrs []netip.Addr
		if ip, err := netip.ParseAddr(host); err == nil {
			addrs = []netip.Addr{ip}
		} else if addrs, err = t.resolve(ctx, host); err != nil {
			return nil, err
		}
		// Dialled one after the other, not raced as net.Dialer does: IPv4
		// first, which every object store and CDN answers on, so that a
		// host without an IPv6 route does not wait out a timeout first.
		slices.SortStableFunc(addrs, func(a, b netip.Addr) int { return family(a) - family(b) })
		var refused, last error
		for _, ip := range addrs {
			if err := t.allowedAddr(host, ip); err != nil {
				refused = err
				continue
			}
			c, err := dial(ctx, network, net.JoinHostPort(ip.Unmap().String(), port))
			if err == nil {
				return c, nil
			}
			last = err
		}
		if last != nil {
			return nil, last
		}
		if refused != nil {
			return nil, refused
		}
		return nil, fmt.Errorf("%s has no address", host)
	}
}

// family orders addresses IPv4 first.
func family(a netip.Addr) int {
	if a.Unmap().Is4() {
		return 0
	}
	return 1
}

// errTargetRefused marks a connection refused by policy rather than by the
// network.
var errTargetRefused = errors.New("refused by pullproxy's redirect policy")

// allowedAddr reports why host may not be dialled at ip, or nil.
func (t *targets) allowedAddr(host string, ip netip.Addr) error {
	c := t.classify(ip)
	switch {
	case c == classNever:
	case c == classPublic, t.reached.Load()&(1<<c) != 0, t.allowHosts[strings.ToLower(host)]:
		return nil
	default:
		for _, n := range t.allowNets {
			if n.Contains(ip.Unmap()) {
				return nil
			}
		}
	}
	return fmt.Errorf("%s is at %s, a %s address: %w; "+
		"list the host or its network in the upstream's redirect_allow if the registry is meant to send pullproxy there",
		host, ip, classNames[c], errTargetRefused)
}
