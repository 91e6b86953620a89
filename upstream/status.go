package upstream

import (
	"slices"
	"strings"
	"time"
)

// Live state: what pullproxy has learned about each endpoint's path, for
// an operator asking why pulls are slow (/debug/upstreams, pullproxy
// status). A snapshot: each part is read under its own lock, never across
// I/O.

// Status is an upstream's live state.
type Status struct {
	Name      string           `json:"name"`
	Endpoints []EndpointStatus `json:"endpoints"`
	// Tokens are the ECR tokens held, by region: their expiry, never the
	// token.
	Tokens []TokenStatus `json:"tokens,omitempty"`
	// Corrupt are the blobs endpoints served corrupt lately, and when
	// each endpoint is asked for its blob again.
	Corrupt []CorruptStatus `json:"corrupt,omitempty"`
}

// EndpointStatus is one endpoint's live state.
type EndpointStatus struct {
	URL    string `json:"url"`
	Region string `json:"region,omitempty"`
	// FailoverOnly: asked for blobs only once the others failed.
	FailoverOnly bool `json:"failover_only,omitempty"`
	// Up is false while the endpoint is left aside after failing, until
	// DownUntil.
	Up        bool      `json:"up"`
	DownUntil time.Time `json:"down_until,omitzero"`
	Failures  int       `json:"failures_in_a_row,omitempty"`
	LastError string    `json:"last_error,omitempty"`
	LastErrAt time.Time `json:"last_error_at,omitzero"`
	// Of the chunks of the last five minutes (at most the last 32): how
	// many there were, and the share cut.
	RecentChunks int `json:"recent_chunks"`
	CutPercent   int `json:"cut_percent"`
	// CutPoints are the bytes recent sessions carried before they were
	// cut (ten minutes), smallest first.
	CutPoints   []int64 `json:"cut_points_bytes,omitempty"`
	BudgetBytes int64   `json:"connection_budget_bytes"`
	// ConnectionsLimit is the adaptive limit of chunk connections, and
	// ConnectionsInFlight those open now.
	ConnectionsLimit    int `json:"connections_limit"`
	ConnectionsInFlight int `json:"connections_in_flight"`
	// GoodputBytesPerSecond is the last measured goodput with the
	// connections saturated; 0: none lately.
	GoodputBytesPerSecond float64 `json:"goodput_bytes_per_second"`
	ReceivedBytes         int64   `json:"received_bytes"`
}

// TokenStatus is a credential's expiry in a region.
type TokenStatus struct {
	Region  string    `json:"region"`
	Expires time.Time `json:"expires"`
}

// Status returns the upstream's live state.
func (r *Registry) Status() Status {
	now := time.Now()
	st := Status{Name: r.name, Corrupt: r.corrupt.list(r.now())}
	for _, ep := range r.endpoints {
		es := EndpointStatus{URL: ep.url.Redacted(), Region: ep.region, FailoverOnly: ep.failoverOnly, BudgetBytes: ep.budget.get()}
		ep.health.mu.Lock()
		es.Up = !now.Before(ep.health.downUntil)
		if !es.Up {
			es.DownUntil = ep.health.downUntil
		}
		es.Failures, es.LastError, es.LastErrAt = ep.health.failures, ep.health.lastErr, ep.health.lastErrAt
		ep.health.mu.Unlock()
		_, es.CutPercent = ep.health.degraded(now)
		es.RecentChunks = ep.health.recent(now)
		ep.budget.mu.Lock()
		for _, p := range ep.budget.points {
			if !p.at.IsZero() && now.Sub(p.at) < cutMemory {
				es.CutPoints = append(es.CutPoints, p.n)
			}
		}
		ep.budget.mu.Unlock()
		slices.Sort(es.CutPoints)
		ep.pipe.mu.Lock()
		es.ConnectionsLimit, es.ConnectionsInFlight = ep.pipe.limit, ep.pipe.inflight
		if now.Sub(ep.pipe.lastAt) < staleRate {
			es.GoodputBytesPerSecond = ep.pipe.lastRate
		}
		ep.pipe.mu.Unlock()
		es.ReceivedBytes = ep.pipe.received.Load()
		st.Endpoints = append(st.Endpoints, es)
	}
	if ecr, ok := r.creds.(*ECRCredentials); ok {
		st.Tokens = ecr.expiries()
	}
	return st
}

// expiries lists the regions' tokens held and when they expire.
func (c *ECRCredentials) expiries() []TokenStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []TokenStatus
	for region, tok := range c.tokens {
		out = append(out, TokenStatus{Region: region, Expires: tok.expires})
	}
	slices.SortFunc(out, func(a, b TokenStatus) int { return strings.Compare(a.Region, b.Region) })
	return out
}
