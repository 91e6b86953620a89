//go:build !linux

package storage

import "os"

// startWriteback is a no-op where the kernel offers no way to start
// writeback early: the next sync does all the work.
func startWriteback(*os.File) {}
