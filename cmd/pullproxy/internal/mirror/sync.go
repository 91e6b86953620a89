package mirror

import (
	"context"
	"errors"
	"log/slog"
	"os"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/config"
	"github.com/pullproxy/pullproxy/proxy/imagesync"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/upstream"
)

// newSyncer builds the runner of cfg's sync rules over m's store, shared
// bucket and upstreams, with what each rule kept when last run here; nil
// when cfg has none. A server runs it (see Open); a command only pins
// what it keeps.
func newSyncer(ctx context.Context, cfg config.File, m *Mirror, log *slog.Logger) (*imagesync.Syncer, error) {
	rules := cfg.SyncRules()
	if len(rules) == 0 {
		return nil, nil
	}
	metrics, err := imagesync.NewMetrics(m.reg)
	if err != nil {
		return nil, err
	}
	opts := []imagesync.Option{imagesync.WithLogger(log), imagesync.WithStateStore(m.Store), imagesync.WithMetrics(metrics),
		imagesync.WithFetchContext(upstream.WithBackground), imagesync.WithFetchGuard(imagesync.PullsLeftGuard(m.pullsLeft))}
	replica, _ := os.Hostname()
	if m.Bucket != nil {
		opts = append(opts, imagesync.WithTurns(bucketTurns{m.Bucket}))
		replica = m.Bucket.Replica()
	}
	return imagesync.New(ctx, rules, replica, opts...)
}

// pullsLeft is what upstreamName's rate-limit window had left at its last
// answer (Docker Hub's headers), if it said.
func (m *Mirror) pullsLeft(upstreamName string) (left, limit int64, known bool) {
	for _, r := range m.Upstreams {
		if r.Name() == upstreamName {
			return r.PullsLeft()
		}
	}
	return 0, 0, false
}

// bucketTurns has replicas sharing a bucket take turns at each rule, with
// the bucket's turns.
type bucketTurns struct{ b *bucket.Bucket }

func (t bucketTurns) TakeTurn(ctx context.Context, name string, want func(state []byte) bool) (imagesync.Turn, error) {
	turn, err := t.b.TakeTurn(ctx, name, want)
	switch {
	case errors.Is(err, bucket.ErrTurnTaken):
		return nil, imagesync.ErrTurnTaken
	case errors.Is(err, bucket.ErrTurnNotWanted):
		return nil, imagesync.ErrTurnNotWanted
	case err != nil:
		return nil, err
	}
	return turn, nil
}
