//go:build !linux

package carrier

import (
	"errors"
	"net"
)

// unackedBytes is not implemented here: Reset then does not wait for the
// client to receive the forwarded data (see the package documentation).
func unackedBytes(c *net.TCPConn) (int, error) {
	return 0, errors.ErrUnsupported
}

// unreadBytes is not implemented here: egress then counts only what the
// relay read.
func unreadBytes(c *net.TCPConn) (int, error) {
	return 0, errors.ErrUnsupported
}
