package containerdtest

import "syscall"

// sysProcAttr makes the kernel kill containerd if the process that started
// it dies (for example a test binary killed by -timeout), so that a crashed
// test does not leave a daemon behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
