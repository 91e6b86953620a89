//go:build !linux

package proxy

// Only Linux has TCP_CORK; elsewhere a blob's header goes out on its own.
func setCork(uintptr)   {}
func clearCork(uintptr) {}
