package benchrun

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
)

// CPUTime is a process's CPU time, all its threads, in seconds.
type CPUTime struct{ User, Sys float64 }

// Total is user plus system time.
func (t CPUTime) Total() float64 { return t.User + t.Sys }

// Sub is t minus u.
func (t CPUTime) Sub(u CPUTime) CPUTime { return CPUTime{t.User - u.User, t.Sys - u.Sys} }

// ReadCPUTime sums utime and stime from /proc/PID/stat over pids.
func ReadCPUTime(pids ...int) (CPUTime, error) {
	hz := clockTicks()
	var t CPUTime
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return CPUTime{}, fmt.Errorf("reading CPU time: %w", err)
		}
		// The command name, in parentheses, may hold spaces: fields count
		// from after it. utime and stime are fields 14 and 15 of the line.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			return CPUTime{}, fmt.Errorf("reading CPU time: unexpected /proc/%d/stat: %q", pid, b)
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 13 {
			return CPUTime{}, fmt.Errorf("reading CPU time: unexpected /proc/%d/stat: %q", pid, b)
		}
		u, err1 := strconv.ParseInt(f[11], 10, 64)
		s, err2 := strconv.ParseInt(f[12], 10, 64)
		if err1 != nil || err2 != nil {
			return CPUTime{}, fmt.Errorf("reading CPU time: unexpected /proc/%d/stat: %q", pid, b)
		}
		t.User += float64(u) / hz
		t.Sys += float64(s) / hz
	}
	return t, nil
}

// ReadMachineCPU returns the CPU time the whole machine spent busy, all
// CPUs, in seconds: /proc/stat's user, nice, system, irq, softirq and steal
// (not idle or iowait). Its difference over a window counts work done for a
// process in kernel threads too, such as writing its dirty pages to disk.
func ReadMachineCPU() (float64, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("reading machine CPU time: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, fmt.Errorf("reading machine CPU time: unexpected /proc/stat line %q", line)
	}
	var ticks int64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system [idle iowait] irq softirq steal
		n, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("reading machine CPU time: unexpected /proc/stat line %q", line)
		}
		ticks += n
	}
	return float64(ticks) / clockTicks(), nil
}

// Children returns the ids of pid's child processes (nginx's workers).
func Children(pid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var kids []int
	for _, e := range entries {
		id, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", id))
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(b, ')')
		if f := strings.Fields(string(b[i+1:])); i >= 0 && len(f) > 1 && f[1] == strconv.Itoa(pid) {
			kids = append(kids, id)
		}
	}
	return kids
}

// clockTicks is the kernel's USER_HZ, the unit of /proc/PID/stat's times:
// 100 on Linux, unless getconf says otherwise.
var clockTicks = sync.OnceValue(func() float64 {
	out, err := exec.Command("getconf", "CLK_TCK").Output()
	if err != nil {
		return 100
	}
	if hz, err := strconv.ParseFloat(strings.TrimSpace(string(out)), 64); err == nil && hz > 0 {
		return hz
	}
	return 100
})

// Activity is what a process did besides spending CPU time, all its threads.
type Activity struct {
	ReadCalls int64 // read system calls (/proc/PID/io syscr): file and socket reads alike
	Switches  int64 // context switches, voluntary and not, of the threads alive
}

// Sub is a minus b.
func (a Activity) Sub(b Activity) Activity {
	return Activity{a.ReadCalls - b.ReadCalls, a.Switches - b.Switches}
}

// ReadActivity reads pid's read system calls from /proc/PID/io and sums its
// threads' context switches from /proc/PID/task/*/status. A thread that
// ended takes its switches with it; a Go process seldom ends one.
func ReadActivity(pid int) (Activity, error) {
	var a Activity
	io, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return a, fmt.Errorf("reading system calls: %w", err)
	}
	if a.ReadCalls, err = procField(io, "syscr:"); err != nil {
		return a, fmt.Errorf("reading /proc/%d/io: %w", pid, err)
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return a, fmt.Errorf("reading threads: %w", err)
	}
	for _, t := range tasks {
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, t.Name()))
		if err != nil {
			continue // the thread ended meanwhile
		}
		for _, key := range []string{"voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"} {
			n, err := procField(st, key)
			if err != nil {
				return a, fmt.Errorf("reading /proc/%d/task/%s/status: %w", pid, t.Name(), err)
			}
			a.Switches += n
		}
	}
	return a, nil
}

// procField returns the number after key at the start of a line of b.
func procField(b []byte, key string) (int64, error) {
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %q", key)
}
