// Package logbuffer batches a server's log lines into few writes, and
// writes warnings and errors out at once.
package logbuffer

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"time"
)

// Buffer batches log lines for w. A line is copied into a buffer, and the
// buffer is written out every logFlushEvery, or sooner once it holds
// logFlushBytes. Unbuffered, every request's log line is a write(2) made
// under the log handler's lock: at tens of thousands of requests a second
// the requests queue on that lock, and logging costs more CPU than serving
// the blob. Warnings and errors are written at once (see FlushOnWarn),
// and Close writes what is left.
type Buffer struct {
	w    io.Writer
	wake chan struct{}
	stop chan struct{}
	done chan struct{}

	mu  sync.Mutex
	buf []byte

	out   sync.Mutex // held while writing to w, so lines keep their order
	spare []byte     // under out: the buffer last written, reused
}

const (
	logFlushEvery = 100 * time.Millisecond
	logFlushBytes = 64 << 10
)

// New starts batching for w, until Close.
func New(w io.Writer) *Buffer {
	b := &Buffer{w: w, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go b.run()
	return b
}

// Write buffers p: a whole record, as slog handlers write.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	b.buf = append(b.buf, p...)
	full := len(b.buf) >= logFlushBytes
	b.mu.Unlock()
	if full {
		select {
		case b.wake <- struct{}{}:
		default:
		}
	}
	return len(p), nil
}

func (b *Buffer) run() {
	defer close(b.done)
	t := time.NewTicker(logFlushEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-b.wake:
		case <-b.stop:
			b.Flush()
			return
		}
		b.Flush()
	}
}

// Flush writes out what is buffered. A failed write is dropped: there is
// nowhere else to report it.
func (b *Buffer) Flush() {
	b.out.Lock()
	defer b.out.Unlock()
	b.mu.Lock()
	lines := b.buf
	b.buf = b.spare[:0]
	b.mu.Unlock()
	if len(lines) > 0 {
		b.w.Write(lines)
	}
	b.spare = lines
}

// Close writes out what is left and stops the flushing.
func (b *Buffer) Close() {
	close(b.stop)
	<-b.done
}

// FlushOnWarn returns h, writing b out at each record at Warn or above.
func FlushOnWarn(h slog.Handler, b *Buffer) slog.Handler { return flushingHandler{h, b} }

// flushingHandler writes a record at Warn or above out at once, with
// everything logged before it: an operator tailing the log sees a failure
// when it happens, and a crash right after it does not lose it.
type flushingHandler struct {
	slog.Handler
	buf *Buffer
}

func (h flushingHandler) Handle(ctx context.Context, r slog.Record) error {
	err := h.Handler.Handle(ctx, r)
	if r.Level >= slog.LevelWarn {
		h.buf.Flush()
	}
	return err
}

func (h flushingHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return flushingHandler{h.Handler.WithAttrs(attrs), h.buf}
}

func (h flushingHandler) WithGroup(name string) slog.Handler {
	return flushingHandler{h.Handler.WithGroup(name), h.buf}
}
