//go:build !linux

package containerdtest

import "syscall"

// sysProcAttr returns nil: parent-death signals are Linux-only.
func sysProcAttr() *syscall.SysProcAttr { return nil }
