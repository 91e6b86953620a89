package proxy

import (
	"net/netip"
	"strings"

	"github.com/pullproxy/pullproxy/upstream"
)

// clientList is a set of networks clients may come from; empty: any.
type clientList []netip.Prefix

// allows reports whether a client at remote (host:port, as net/http and
// net.Conn give it) belongs to the list.
func (l clientList) allows(remote string) bool {
	if len(l) == 0 {
		return true
	}
	ap, err := netip.ParseAddrPort(remote)
	if err != nil {
		return false
	}
	a := ap.Addr().Unmap()
	for _, p := range l {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// ParseClientList reads networks (10.0.0.0/8, fd00::/8) and single
// addresses (192.0.2.7) as a list of allowed clients.
func ParseClientList(entries []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, e := range entries {
		e = strings.TrimSpace(e)
		if p, err := netip.ParsePrefix(e); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(e)
		if err != nil {
			return nil, &clientListError{entry: e}
		}
		out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
	}
	return out, nil
}

type clientListError struct{ entry string }

func (e *clientListError) Error() string {
	return "client entry " + `"` + e.entry + `"` + ": want an address (192.0.2.7) or a network (10.0.0.0/8)"
}

// pullAllowed reports whether a client at remote may pull through rt's
// upstream, by that upstream's own list of clients.
func (s *Server) pullAllowed(rt route, remote string) bool {
	if len(s.upstreamClients) == 0 {
		return true
	}
	l, ok := s.upstreamClients[upstream.CanonicalName(rt.up.Name())]
	return !ok || l.allows(remote)
}

// clientDenied is the answer to a client an upstream's list leaves out.
func clientDenied(rt route, remote string) *ociError {
	host := remote
	if ap, err := netip.ParseAddrPort(remote); err == nil {
		host = ap.Addr().String()
	}
	return &ociError{status: 403, code: "DENIED",
		message: "clients at " + host + " may not pull through pullproxy from " + rt.up.Name() + " (its allow_clients)"}
}
