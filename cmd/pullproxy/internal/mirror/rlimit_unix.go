//go:build unix

package mirror

import "syscall"

// defaultMaxClientConnections bounds client connections by the process's
// descriptor limit (which Go raises to the hard limit at start): each
// connection may hold two (its socket and a blob file), and the rest of
// the process needs some (upstream connections, the metadata database).
func defaultMaxClientConnections() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil || lim.Cur > 1<<40 {
		return maxClientConnectionsCap
	}
	return int(min(maxClientConnectionsCap, max(64, (int64(lim.Cur)-1024)/2)))
}
