// Package progress is how pullproxy's long commands (seed, import,
// export) report how they go: a line redrawn in place on a terminal, a
// line now and then otherwise, and byte counts in binary units.
package progress

import (
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"time"
)

// Reporter shows how a long operation goes, until ended: a line redrawn
// every second on a terminal, a line every ten seconds otherwise (a log
// keeps them all).
type Reporter struct {
	label string
	// read returns the bytes done so far and in all (0: not known), and
	// what else the line says (blobs done, say).
	read  func() (done, total int64, extra string)
	stop  chan struct{}
	ended chan struct{}
}

// Start starts reporting to out; terminal redraws the line in place.
func Start(out io.Writer, terminal bool, label string, read func() (done, total int64, extra string)) *Reporter {
	p := &Reporter{label: label, read: read, stop: make(chan struct{}), ended: make(chan struct{})}
	go p.run(out, terminal, time.Now())
	return p
}

// End stops the reports, clearing a redrawn line.
func (p *Reporter) End() {
	close(p.stop)
	<-p.ended
}

func (p *Reporter) run(out io.Writer, terminal bool, start time.Time) {
	defer close(p.ended)
	every := 10 * time.Second
	if terminal {
		every = time.Second
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			if terminal {
				fmt.Fprint(out, "\r\033[K")
			}
			return
		case <-t.C:
		}
		if terminal {
			fmt.Fprint(out, "\r\033[K"+p.line(start))
		} else {
			fmt.Fprintln(out, p.line(start))
		}
	}
}

func (p *Reporter) line(start time.Time) string {
	got, total, extra := p.read()
	rate := float64(got) / max(time.Since(start).Seconds(), 1e-3)
	of, eta := "", ""
	if total > 0 {
		of = " of " + Bytes(total)
		eta = ", ETA ?"
		if rate > 0 && total > got {
			eta = ", ETA " + (time.Duration(float64(total-got)/rate) * time.Second).Round(time.Second).String()
		}
	}
	line := fmt.Sprintf("%s: %s%s, %s/s%s", p.label, Bytes(got), of, Bytes(int64(rate)), eta)
	if extra != "" {
		line += ", " + extra
	}
	return line
}

// CountingReader counts what is read through R into N.
type CountingReader struct {
	R io.Reader
	N *atomic.Int64
}

func (c CountingReader) Read(b []byte) (int, error) {
	k, err := c.R.Read(b)
	c.N.Add(int64(k))
	return k, err
}

// IsTerminal tells whether w is a terminal, where a line is redrawn in
// place rather than repeated.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// Bytes writes n in binary units: 512 B, 1.5 KiB, 3.2 GiB.
func Bytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
