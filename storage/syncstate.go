package storage

import (
	"context"
	"encoding/json"
	"fmt"
)

// syncPrefix keys what each sync rule keeps cached (sync/<rule id>), so
// that a restart pins it at once, before the rule's first round, and
// fetches nothing again that did not move.
const syncPrefix = "sync/"

// SyncState returns the state a sync rule last recorded, or ErrNotFound.
// The store keeps it as given: its shape is the rule runner's.
func (s *Store) SyncState(ctx context.Context, rule string) (json.RawMessage, error) {
	var state json.RawMessage
	if err := s.get([]byte(syncPrefix+rule), &state); err != nil {
		return nil, fmt.Errorf("reading the state of sync rule %s: %w", rule, err)
	}
	return state, nil
}

// PutSyncState records a sync rule's state.
func (s *Store) PutSyncState(ctx context.Context, rule string, state json.RawMessage) error {
	if err := s.put([]byte(syncPrefix+rule), state); err != nil {
		return fmt.Errorf("recording the state of sync rule %s: %w", rule, err)
	}
	return nil
}
