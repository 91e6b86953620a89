package upstream

import (
	"context"
	"sync/atomic"
)

// Background work (a sync fetching images before anyone asks for them)
// yields to what clients wait for: on each endpoint's pipe its chunks get a
// free connection slot only after every foreground chunk waiting, and
// together hold at most FetchConfig.BackgroundShare of the slots (see
// pipe). A fetch is background when its context carries a background
// Priority; one that is promoted (a client came to wait for the same blob)
// is foreground from then on, mid-fetch.

// priorityKey is the context key of a fetch's *Priority.
type priorityKey struct{}

// Priority is how a fetch ranks on the upstream's connections: background
// until promoted, or foreground throughout. It is shared by whoever started
// a fetch and whoever joins it later, so that a joiner who waits can
// promote a fetch already running. A nil *Priority is foreground.
type Priority struct {
	background atomic.Bool
	promoted   chan struct{} // closed on promotion; nil when foreground from the start
}

// NewPriority returns a background Priority, to be promoted once someone
// waits on it, or a foreground one.
func NewPriority(background bool) *Priority {
	p := &Priority{}
	if background {
		p.background.Store(true)
		p.promoted = make(chan struct{})
	}
	return p
}

// Promote makes p foreground for the rest of its life. Safe to call any
// number of times, from any goroutine.
func (p *Priority) Promote() {
	if p != nil && p.background.CompareAndSwap(true, false) {
		close(p.promoted)
	}
}

// Background reports whether p is background: not promoted yet.
func (p *Priority) Background() bool { return p != nil && p.background.Load() }

// promotedChan is closed once p is promoted; nil (never ready) for a
// foreground p, which has nothing to wait for.
func (p *Priority) promotedChan() <-chan struct{} {
	if !p.Background() {
		return nil
	}
	return p.promoted
}

// WithPriority returns ctx carrying p: a blob fetched with it ranks as p
// says, as p says at each moment.
func WithPriority(ctx context.Context, p *Priority) context.Context {
	return context.WithValue(ctx, priorityKey{}, p)
}

// WithBackground returns ctx marked as background work: what is fetched
// with it yields to clients (see IsBackground). A fetch made with it
// directly stays background; a layer that shares one fetch among callers
// (the proxy's downloads) gives the fetch a Priority of its own, which a
// caller that is not background promotes on joining.
func WithBackground(ctx context.Context) context.Context {
	return WithPriority(ctx, NewPriority(true))
}

// IsBackground reports whether ctx is marked as background work, and not
// promoted since.
func IsBackground(ctx context.Context) bool { return priorityOf(ctx).Background() }

// priorityOf returns the Priority ctx carries; nil (foreground) if none.
func priorityOf(ctx context.Context) *Priority {
	p, _ := ctx.Value(priorityKey{}).(*Priority)
	return p
}
