//go:build !linux

package carrier

import (
	"errors"
	"time"
)

// synDelay needs Linux's netfilter queue.
type synDelay struct{}

func startSynDelay(port int, delay func() time.Duration) (*synDelay, error) {
	return nil, errors.New("carrier: a handshake through the path needs Linux (netfilter queue)")
}

func (d *synDelay) close() error { return nil }
