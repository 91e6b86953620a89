package proxy

import (
	"io"
	"net"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sendBlob sends a response on the connection: hdr, then the first size
// bytes of the file fd with sendfile, from an offset of its own (the
// descriptor's is left alone), waiting while the socket's buffer is full.
// The header goes out with MSG_MORE when a body follows, in the segment of
// the body's first bytes, as a cork would send it without a cork's two
// setsockopt calls. A body over maxCorked is sent corked all the same: a
// sendfile that fills the socket's buffer returns with a segment part-way
// filled, which the connection (TCP_NODELAY, as Go sets it) sends at once:
// uncorked, a large body goes out in more segments than it fills, and the
// client pays a receive for each. Corked, only the last one is partial.
//
// Each wait for the client has a write deadline of timeout (0: none) from
// the last time the client took bytes, and none later than until (zero: no
// limit): a client that takes nothing for timeout is dropped, however long
// a slow one takes in all. It returns how many bytes of the body it sent.
func sendBlob(tc *net.TCPConn, raw syscall.RawConn, hdr []byte, fd int, size int64, timeout time.Duration, until time.Time) (int64, error) {
	flags := syscall.MSG_NOSIGNAL
	if size > 0 {
		flags |= syscall.MSG_MORE
	}
	var off int64
	var err error
	var cached residency
	// With a timeout, a wait that follows progress returns to arm the
	// deadline afresh first: one more sendfile, finding the buffer still
	// full, per time the client lets it fill, and none for a response the
	// socket's buffer takes whole.
	rearm, progressed := timeout > 0, false
	wait := func() bool {
		err = nil
		return rearm && progressed // true: out to re-arm; false: wait here
	}
	send := func(s uintptr) bool {
		for len(hdr) > 0 {
			// Raw: the socket is non-blocking (see residency).
			n, _, e := unix.RawSyscall6(unix.SYS_SENDTO, s, uintptr(unsafe.Pointer(&hdr[0])), uintptr(len(hdr)), uintptr(flags), 0, 0)
			switch e {
			case 0:
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return wait()
			default:
				err = e
				return true
			}
			hdr, progressed = hdr[n:], true
		}
		for off < size {
			var n int
			n, err = cached.sendfile(int(s), fd, &off, size)
			switch {
			case err == syscall.EINTR:
				continue
			case err == syscall.EAGAIN:
				return wait()
			case err != nil:
				return true
			case n == 0:
				err = io.ErrUnexpectedEOF // the file is shorter than its size
				return true
			}
			progressed = true
		}
		return true
	}
	if size > maxCorked {
		raw.Control(func(s uintptr) { setCorkRaw(s, 1) })
		defer raw.Control(func(s uintptr) { setCorkRaw(s, 0) })
	}
	for {
		if d := pieceDeadline(timeout, until); !d.IsZero() {
			tc.SetWriteDeadline(d)
		}
		progressed = false
		werr := raw.Write(send)
		if err == nil {
			err = werr
		}
		if err != nil || (len(hdr) == 0 && off >= size) {
			return off, err
		}
	}
}

// residency tracks how much of a file ahead of the send offset is known to
// be in the page cache, and where it was last checked.
//
// A sendfile of a large file to a fast client runs for tens of
// microseconds a call, moving what the socket's buffer takes. Made as an
// ordinary system call, that is long enough for the Go runtime's monitor
// to find the thread still in it and hand its processor to another thread:
// with a few such sends running, the monitor wakes every 20 µs and threads
// are woken and put back to sleep around every call: CPU spent for
// nothing, since the call never blocks and returns on its own.
// A sendfile from pages in the page cache never waits (the socket is
// non-blocking), so such a call is made raw, outside the scheduler's
// view; a page to read from disk could take milliseconds, holding a
// processor the others cannot use, so ranges not wholly cached go through
// the scheduler as before. cachestat (Linux 6.5) says which; where it is
// missing or refused, every call is an ordinary one.
type residency struct {
	checked int64 // the last check covered up to here
	cached  bool  // and found it all in the page cache
}

const (
	// residencyWindow is how far ahead one check looks: a check counts the
	// range's pages in the cache, a few microseconds per 8 MiB.
	residencyWindow = 8 << 20
	// residencyMin: sends with less than this left are short calls, which
	// the monitor rarely finds in progress; not worth a check.
	residencyMin = 1 << 20
)

// sendfile sends up to size-*off bytes of fd from *off on socket s,
// advancing *off.
func (r *residency) sendfile(s, fd int, off *int64, size int64) (int, error) {
	if *off >= r.checked && size-*off >= residencyMin {
		end := min(size, *off+residencyWindow)
		r.checked, r.cached = end, wholeCached(fd, *off, end)
	}
	if r.cached && *off < r.checked {
		n, _, e := syscall.RawSyscall6(syscall.SYS_SENDFILE, uintptr(s), uintptr(fd), uintptr(unsafe.Pointer(off)), uintptr(r.checked-*off), 0, 0)
		if e != 0 {
			return 0, e
		}
		return int(n), nil
	}
	return syscall.Sendfile(s, fd, off, int(min(size-*off, 1<<30)))
}

// wholeCached reports whether every page of fd's bytes [start, end) is in
// the page cache.
func wholeCached(fd int, start, end int64) bool {
	page := int64(os.Getpagesize())
	first := start / page
	pages := (end+page-1)/page - first
	rng := unix.CachestatRange{Off: uint64(first * page), Len: uint64(pages * page)}
	var st unix.Cachestat_t
	// Raw too: it counts pages in the cache's index and never sleeps.
	_, _, e := unix.RawSyscall6(unix.SYS_CACHESTAT, uintptr(fd), uintptr(unsafe.Pointer(&rng)), uintptr(unsafe.Pointer(&st)), 0, 0, 0)
	return e == 0 && int64(st.Cache) >= pages
}

// setCorkRaw sets the socket's TCP_CORK on (1) or off (0), the latter
// sending what it held back, with a raw system call: it never sleeps, and
// an ordinary one would wake the runtime's monitor (see rawsock).
func setCorkRaw(s uintptr, on int32) {
	unix.RawSyscall6(unix.SYS_SETSOCKOPT, s, unix.IPPROTO_TCP, unix.TCP_CORK, uintptr(unsafe.Pointer(&on)), 4, 0)
}
