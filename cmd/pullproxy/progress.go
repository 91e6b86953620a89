package main

import (
	"fmt"
	"io"
	"sync/atomic"
	"time"
)

// progress shows how a long operation goes, until stopped: a line redrawn
// every second on a terminal, a line every ten seconds otherwise (a log
// keeps them all).
type progress struct {
	label string
	// read returns the bytes done so far and in all (0: not known), and
	// what else the line says (blobs done, say).
	read  func() (done, total int64, extra string)
	stop  chan struct{}
	ended chan struct{}
}

// startProgress starts reporting to out.
func startProgress(out io.Writer, terminal bool, label string, read func() (done, total int64, extra string)) *progress {
	p := &progress{label: label, read: read, stop: make(chan struct{}), ended: make(chan struct{})}
	go p.run(out, terminal, time.Now())
	return p
}

// End stops the reports, clearing a redrawn line.
func (p *progress) End() {
	close(p.stop)
	<-p.ended
}

func (p *progress) run(out io.Writer, terminal bool, start time.Time) {
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

func (p *progress) line(start time.Time) string {
	got, total, extra := p.read()
	rate := float64(got) / max(time.Since(start).Seconds(), 1e-3)
	of, eta := "", ""
	if total > 0 {
		of = " of " + humanBytes(total)
		eta = ", ETA ?"
		if rate > 0 && total > got {
			eta = ", ETA " + (time.Duration(float64(total-got)/rate) * time.Second).Round(time.Second).String()
		}
	}
	line := fmt.Sprintf("%s: %s%s, %s/s%s", p.label, humanBytes(got), of, humanBytes(int64(rate)), eta)
	if extra != "" {
		line += ", " + extra
	}
	return line
}

// countingReader counts what is read through it into n.
type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c countingReader) Read(b []byte) (int, error) {
	k, err := c.r.Read(b)
	c.n.Add(int64(k))
	return k, err
}
