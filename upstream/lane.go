package upstream

import (
	"net/http"
	"net/http/httptrace"
	"net/url"
	"time"

	"github.com/pullproxy/pullproxy/upstream/plan"
)

// A lane is one of an endpoint's chunk connection slots (see pipe), with an
// HTTP client of its own whose kept-alive connections carry one chunk after
// another until each has used its byte budget.
//
// Chunks and connections are sized apart. A chunk is at most the endpoint's
// chunk target long (see pipe.chunkTarget): 1 MiB, or on a short path
// whose budget has grown cleanly what a connection brings in chunkPace, up
// to 4 MiB. It is the unit a blob arrives in, and a
// client reading the blob in order waits for the chunk at its offset, so
// chunks much larger than a reading pace arrive out of order and the client
// (and the hashing before commit) wait for the last of them at the end. A
// connection carries as many chunks as its budget holds, counted in the
// bytes it received (handshake and headers included, as a carrier counts
// them): on a clean path one session carries megabytes, and its set-up and
// slow start are paid once for them; on a path that cuts sessions at 1.3
// MB, each carries one chunk as large as its budget. The next chunk on a
// connection is sized to what its budget has left, so no session is asked
// to go past it.
//
// A lane sends one request at a time, so its client holds at most one
// connection per host, and the lane knows, from the last answer, which
// connection the next request to that host goes out on and how much it
// carried. It does not follow connections it did not see answer a chunk (a
// registry's connection that only redirected): those carry little.
type lane struct {
	client *http.Client
	conns  map[dialKey]*chunkConn // nil: the caller's own transport, whose connections are not seen
}

// The planner's chunk sizes (see package plan), as the transport sizes
// connections by them.
const (
	minChunkTarget = plan.MinChunkTarget
	maxChunkTarget = plan.MaxChunkTarget
	chunkPace      = plan.ChunkPace
	minChunk       = plan.MinChunk
	severalChunks  = plan.SeveralChunks
)

// chunkPlan is how the next chunk on a lane is to be fetched.
type chunkPlan struct {
	size  int64      // bytes to ask for, at most
	room  int64      // bytes the connection may still carry: a gap's short rest may join the chunk up to this
	probe *probeConn // a probe for the connection the chunk opens, or nil
	last  bool       // the chunk uses up its connection: warm the next one up
	// several: the connection's budget holds several chunks (a clean
	// path's), so a chunk cut shorter near a blob's end costs a request,
	// not a session (see plan.Conn).
	several bool
}

// plan sizes the next chunk to u, an address of ep or its redirect target:
// on the connection the lane holds to it while its budget has room, else
// on a new one, which may be a probe of a larger budget.
func (l *lane) plan(ep *endpoint, u *url.URL) chunkPlan {
	if l.conns == nil {
		b := ep.budget.get()
		return chunkPlan{size: b, room: b, several: b >= severalChunks}
	}
	// Larger chunks only once the budget has grown and no session was cut
	// or stalled lately (renewable): a chunk that stalls holds the rest of
	// its range until it is hedged, so larger chunks on a stalling path
	// (probes included) leave more waiting on each stall, and a path that
	// cuts gains nothing, its budget being below a chunk.
	now := time.Now()
	renewable := ep.budget.renewable(now)
	target := int64(minChunkTarget)
	if renewable {
		target = ep.pipe.chunkTarget(now)
	}
	key := keyOf(u)
	if c := l.conns[key]; c != nil {
		left := c.allowance(ep) - c.read.Load()
		if !c.retired.Load() && left < minChunk && l.spent(c, ep) {
			left = c.allowance(ep) - c.read.Load()
			renewable = true // its renewal says so, the budget perhaps grown by its probe's win
		}
		if !c.retired.Load() {
			size := plan.ChunkSize(left, target)
			last := left-size < minChunk && !renewable
			return chunkPlan{size: size, room: left, last: last, several: c.allowance(ep) >= severalChunks}
		}
		delete(l.conns, key)
	}
	allowance, probe := ep.budget.next(now, ep.pipe.current())
	p := chunkPlan{size: plan.ChunkSize(allowance, target), room: allowance, several: allowance >= severalChunks}
	p.last = allowance-p.size < minChunk
	if probe {
		p.probe = &probeConn{budget: ep.budget, allowance: allowance}
	}
	return p
}

// retire closes c, which has used its budget: a probe it carried won.
func (l *lane) retire(c *chunkConn) {
	c.retired.Store(true)
	if p := c.probe.Load(); p != nil {
		p.won(c.read.Load())
	}
	c.Close()
}

// spent settles c, which has used its allowance cleanly (a probe it
// carried won), and either renews it or retires it. It reports whether c
// was renewed.
//
// Renewed, c carries on with another budget's worth (see
// budget.renewal): on a path that has cut no session lately and let the
// budget grow, closing a connection that works only to open one in slow
// start costs the pull its round trips (at 100 ms a new connection's first
// MiB takes about nine) and both ends a handshake, and gains no evidence
// the probes do not already gather. Renewed, it is held to what it was
// granted, as a regular connection: a cut is recorded as any other.
func (l *lane) spent(c *chunkConn, ep *endpoint) bool {
	carried := c.read.Load()
	if p := c.probe.Swap(nil); p != nil {
		p.won(carried) // first: its win may grow the budget, which allows the renewal
	}
	if next, ok := ep.budget.renewal(time.Now(), carried); ok {
		c.granted.Store(next)
		return true
	}
	l.retire(c)
	return false
}

// probing reports whether one of l's connections carries a probe not yet
// settled.
func (l *lane) probing() bool {
	for _, c := range l.conns {
		if p := c.probe.Load(); p != nil && !p.settled.Load() && !c.retired.Load() {
			return true
		}
	}
	return false
}

// close closes l's connections, which are idle: a probe on one settles as
// failed (see chunkConn.Close).
func (l *lane) close() {
	for _, c := range l.conns {
		c.Close()
	}
	clear(l.conns)
	l.client.CloseIdleConnections()
}

// answered notes the connection that carried the answer to req.
func (l *lane) answered(req *http.Request, c *chunkConn) {
	if l.conns == nil || c == nil || req == nil {
		return
	}
	l.conns[keyOf(req.URL)] = c
}

// allowance is how many bytes c may carry: what a renewal granted it, its
// probe's allowance, or its endpoint's budget now.
func (c *chunkConn) allowance(ep *endpoint) int64 {
	if g := c.granted.Load(); g > 0 {
		return g
	}
	if p := c.probe.Load(); p != nil {
		return p.allowance
	}
	return ep.budget.get()
}

func keyOf(u *url.URL) dialKey {
	return dialKey{secure: u.Scheme == "https", addr: hostPort(u.Scheme, u.Host)}
}

// chunkTrace remembers the chunk connections a request went out on: net/http
// may send it on more than one when a reused connection fails before a byte
// of the request is written, and a redirect's second request goes on
// another. The last is the one that carried the answer. Each is marked in
// use until done.
type chunkTrace struct {
	conn *chunkConn
	used []*chunkConn
	got  func(*chunkConn) // called with each chunk connection the request goes out on; nil: none
	// firstByte, when its paths is set, times each request (a redirect's
	// too) to its answer's first byte.
	firstByte firstByteClock
}

// trace returns the hooks that record the connections. The context a chunk
// is fetched under also carries the requests made for it on other clients
// (a token, an ECR credential), some from goroutines of their own: their
// connections are not chunk connections, and are left alone.
func (t *chunkTrace) trace() *httptrace.ClientTrace {
	ct := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
		c := asChunkConn(info.Conn)
		if c == nil {
			return
		}
		c.inUse.Store(true)
		t.conn = c
		t.used = append(t.used, c)
		if t.got != nil {
			t.got(c)
		}
	}}
	if t.firstByte.paths != nil {
		ct.WroteRequest, ct.GotFirstResponseByte = t.firstByte.wroteRequest, t.firstByte.gotFirstByte
	}
	return ct
}

// done ends the request on every connection it used.
func (t *chunkTrace) done() {
	for _, c := range t.used {
		c.done()
	}
}
