//go:build !linux

package upstream

import (
	"errors"
	"syscall"
)

// lowatSupported: elsewhere a chunk connection's reads go without a mark.
const lowatSupported = false

func setRcvLowat(syscall.RawConn, int) error {
	return errors.New("SO_RCVLOWAT is used on Linux only")
}

func rcvBuf(syscall.RawConn) int { return 0 }

func rcvQueued(syscall.RawConn) int { return 0 }
