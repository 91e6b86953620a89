package benchrun

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// On a virtual machine whose balloon reports free pages to its host, a
// page the guest freed and reported is unmapped on the host, and the next
// write to it takes a fault there. On this project's 2-core benchmark VM,
// writing 1 GiB of new page cache took 0.12 s of system time on pages freed
// a moment before and 0.57 s on reported ones. The guest keeps about 800
// MiB of freed pages unreported and reports what is freed beyond that, a
// few seconds later. Whether a run's bytes landed on fast pages or slow
// ones thus depended on what ran before it: the first run after the
// upstream's image was written found the unreported pages used up, and its
// mirror spent about a CPU-second more on 600 MiB. ResetFreePages, before
// each measured run, refills the unreported pages.
const reportedKiB = "/sys/module/page_reporting/parameters/reported_kib"

// ResetFreePages refills the guest's unreported free pages (see
// reportedKiB) so that a run's first writes of new page cache, up to about
// 800 MiB, land on fast pages, as on a machine without a balloon: it
// writes and removes a file larger than what the guest keeps unreported,
// and waits until the guest has reported the excess. dir is where the file
// is written. On a machine that does not report free pages it does
// nothing.
func ResetFreePages(ctx context.Context, dir string) error {
	if !ReportsFreePages() {
		return nil
	}
	if err := writeScratch(dir, 1152<<20); err != nil {
		return err
	}
	return waitReportingQuiet(ctx)
}

// ReportsFreePages reports whether this machine reports its free pages to
// a host: whether ResetFreePages has anything to do.
func ReportsFreePages() bool {
	_, err := os.Stat(reportedKiB)
	return err == nil
}

// writeScratch writes size bytes to a new file in dir, syncs and removes
// it, freeing its pages.
func writeScratch(dir string, size int64) error {
	path := filepath.Join(dir, "scratch")
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("preparing memory: %w", err)
	}
	defer os.Remove(path)
	defer f.Close()
	buf := make([]byte, 1<<20)
	for n := int64(0); n < size; n += int64(len(buf)) {
		if _, err := f.Write(buf); err != nil {
			return fmt.Errorf("preparing memory: writing %s: %w", path, err)
		}
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("preparing memory: syncing %s: %w", path, err)
	}
	return nil
}

// waitReportingQuiet waits until the guest has reported no page for 5 s
// (it reports in passes 2 s apart), for at most 30 s.
func waitReportingQuiet(ctx context.Context) error {
	deadline := time.Now().Add(30 * time.Second)
	last, err := readReported()
	if err != nil {
		return err
	}
	quiet := 0
	for quiet < 20 && time.Now().Before(deadline) {
		select {
		case <-time.After(250 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		n, err := readReported()
		if err != nil {
			return err
		}
		if n == last {
			quiet++
		} else {
			last, quiet = n, 0
		}
	}
	return nil
}

// readReported returns how much the guest has reported in all, in KiB.
func readReported() (int64, error) {
	b, err := os.ReadFile(reportedKiB)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64)
}
