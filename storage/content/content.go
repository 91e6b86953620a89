// Package content says what a download of a blob is to the code around
// it: the fetchers that fill it (the upstream client, the shared bucket)
// write through a Writer; the requests that serve it while it fills read
// through a Reader; whoever owns the download holds both, a Download.
// storage.Partial is the implementation.
//
// It is containerd's content.Writer split along the line its clients
// follow: bytes go in at any offset, from several goroutines; the owner
// verifies them against the expected digest and commits them (that is
// storage's, not part of these interfaces); readers follow the bytes as
// they land, and are kept from the last of them until the digest matched.
//
// The package imports nothing of this module, so that upstream can write
// into a download without depending on storage.
package content

import (
	"context"
	"io"
	"os"

	"github.com/opencontainers/go-digest"
)

// Writer is the write side of a download: what a fetcher fills it
// through. Every method is safe to call from several goroutines at once.
type Writer interface {
	// WriteAt writes b at off, in any order relative to other writes. A
	// byte is written once: bytes already written, or being written by a
	// concurrent call, are left as they are, whatever b holds there. It
	// returns len(b) once every byte of b is in or claimed by another
	// call; bytes beyond a known size are refused with an error. A write
	// whose call fails leaves its bytes missing (see Missing) to be
	// written again.
	io.WriterAt
	// Size returns the blob's size, or -1 while it is not known.
	Size() int64
	// SetSize fixes the blob's size once learned. Setting the size already
	// known is a no-op; a different one, or a negative one, is an error,
	// as is a size the store has no room for.
	SetSize(n int64) error
	// Missing returns the first range at or after off not yet written, as
	// [start, end); start == end when nothing is missing there or the size
	// is not known. Bytes a WriteAt is still writing count as missing.
	Missing(off int64) (start, end int64)
	// Wanted returns the offsets readers are waiting at (see
	// Reader.WaitAvailable), ascending, without duplicates: a fetcher
	// gets the bytes there first. Nil when nobody waits. The slice is the
	// caller's.
	Wanted() []int64
}

// Reader is the read side of a download: what a request serving the blob
// while it is fetched follows. Every method is safe to call from several
// goroutines at once, and every wait ends with its context.
//
// No byte is handed out untrusted: until every byte is in and the digest
// matched, the last bytes of the blob (storage.HoldBack of them) are held
// back, so that a reader of a download that fails verification sees a
// short blob, never a complete-looking wrong one.
type Reader interface {
	// Digest returns the digest the download must match.
	Digest() digest.Digest
	// WaitSize blocks until the blob's size is known and returns it. It
	// returns the download's error if the download fails first, or ctx's.
	WaitSize(ctx context.Context) (int64, error)
	// WaitStarted blocks until the upstream has started sending (a
	// WriteAt put its bytes in, or found them all there already: bytes a
	// resumed download found on disk do not count by themselves), or the
	// blob was committed. It returns the blob's size, waiting for that
	// too: a response's status is decided only then. It returns the
	// download's error if the download fails first, or ctx's.
	WaitStarted(ctx context.Context) (int64, error)
	// WaitAvailable blocks until bytes from off on may be read, and
	// returns how many may be read from off: the written run starting
	// there, less the held-back tail until the download is verified. It
	// returns io.EOF for an offset at or past the end, the download's
	// error if it fails first, or ctx's error. While it waits, off is
	// among the offsets Writer.Wanted reports.
	WaitAvailable(ctx context.Context, off int64) (int64, error)
	// Open returns a read-only handle on the download's bytes, valid
	// across the commit and after it; the caller closes it. Read only
	// what WaitAvailable made available: the rest may not be written, or
	// not yet verified.
	Open() (*os.File, error)
}

// Download is a download whole, both its sides: what its owner holds,
// and hands to the fetchers and the readers as a Writer and a Reader.
type Download interface {
	Writer
	Reader
}
