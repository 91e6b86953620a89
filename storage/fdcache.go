package storage

import (
	"sync"
	"syscall"

	"github.com/opencontainers/go-digest"
)

// fdCache keeps the descriptors of the blobs served lately open, so that a
// blob asked for again is sent without an open, a close and building its
// path, as nginx's open_file_cache does: for a small blob, a sizeable share
// of the CPU a response takes. A descriptor is shared by every reader of the
// blob at once; each reader holds a reference (see BlobFD), and the cache
// holds one while the blob is in it. The last reference closes it.
//
// A cached descriptor stays valid when the blob's file is removed or
// replaced: it reads the bytes that were committed under the digest, and
// the space is freed once it is closed. So each change to a blob's file by
// the store (eviction, quarantine, a new commit) drops the blob from the
// cache first (forget), and its size is checked on every use, as an open
// would check it, so that a file truncated or grown in place is found.
type fdCache struct {
	mu   sync.Mutex
	fds  map[digest.Digest]*sharedFD
	tick uint64 // counts uses, to find the least recently used
}

// sharedFD is a blob's descriptor and who holds it.
type sharedFD struct {
	fd     int
	refs   int    // readers holding it, plus one while cached
	used   uint64 // the cache's tick at its last use
	cached bool
}

// fdCacheSize is how many blobs' descriptors are kept open: what a node's
// pull of a few images asks for again and again, and few next to the open
// file limit Serve raises.
const fdCacheSize = 256

func newFDCache() *fdCache {
	return &fdCache{fds: map[digest.Digest]*sharedFD{}}
}

// get returns d's cached descriptor with a reference for the caller, or nil.
func (c *fdCache) get(d digest.Digest) *sharedFD {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.fds[d]
	if s != nil {
		s.refs++
		c.tick++
		s.used = c.tick
	}
	return s
}

// add caches fd, just opened for d, and returns it with a reference for the
// caller. When another reader cached d meanwhile, fd is returned uncached,
// closed when the caller lets it go.
func (c *fdCache) add(d digest.Digest, fd int) *sharedFD {
	s := &sharedFD{fd: fd, refs: 1}
	var evicted *sharedFD
	c.mu.Lock()
	if _, ok := c.fds[d]; !ok {
		if len(c.fds) >= fdCacheSize {
			evicted = c.evictLocked()
		}
		c.tick++
		s.refs, s.used, s.cached = 2, c.tick, true
		c.fds[d] = s
	}
	c.mu.Unlock()
	if evicted != nil {
		syscall.Close(evicted.fd)
	}
	return s
}

// evictLocked drops the least recently used blob from the cache, and
// returns its descriptor when nobody holds it any more, for the caller to
// close outside the lock.
func (c *fdCache) evictLocked() *sharedFD {
	var oldest digest.Digest
	var o *sharedFD
	for d, s := range c.fds {
		if o == nil || s.used < o.used {
			oldest, o = d, s
		}
	}
	if o == nil {
		return nil
	}
	return c.dropLocked(oldest, o)
}

// dropLocked takes s, cached for d, out of the cache, and returns it when
// that was its last reference.
func (c *fdCache) dropLocked(d digest.Digest, s *sharedFD) *sharedFD {
	delete(c.fds, d)
	s.cached = false
	if s.refs--; s.refs == 0 {
		return s
	}
	return nil
}

// release lets the caller's reference to s go.
func (c *fdCache) release(s *sharedFD) {
	c.mu.Lock()
	s.refs--
	last := s.refs == 0
	c.mu.Unlock()
	if last {
		syscall.Close(s.fd)
	}
}

// forget drops d from the cache: its file is about to change. Readers
// holding its descriptor keep reading what it had.
func (c *fdCache) forget(d digest.Digest) {
	c.mu.Lock()
	var last *sharedFD
	if s := c.fds[d]; s != nil {
		last = c.dropLocked(d, s)
	}
	c.mu.Unlock()
	if last != nil {
		syscall.Close(last.fd)
	}
}

// idleFDs returns the descriptors of cached blobs nobody reads now: open
// only for the cache.
func (c *fdCache) idleFDs() map[int]bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[int]bool, len(c.fds))
	for _, s := range c.fds {
		if s.refs == 1 {
			out[s.fd] = true
		}
	}
	return out
}

// close drops every blob from the cache.
func (c *fdCache) close() {
	c.mu.Lock()
	var last []int
	for d, s := range c.fds {
		if l := c.dropLocked(d, s); l != nil {
			last = append(last, l.fd)
		}
	}
	c.mu.Unlock()
	for _, fd := range last {
		syscall.Close(fd)
	}
}

// BlobFD is an open descriptor on a stored blob, and its size, from
// Store.OpenBlobFD. The descriptor may be shared with other readers: read
// it at offsets of your own (pread, sendfile with an offset), and Release
// it when done, never close it.
type BlobFD struct {
	FD   int
	Size int64
	c    *fdCache
	s    *sharedFD
}

// Release lets the descriptor go: the last reader of a blob no longer
// cached closes it.
func (b BlobFD) Release() {
	if b.s != nil {
		b.c.release(b.s)
	}
}
