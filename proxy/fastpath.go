package proxy

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/internal/rawsock"
	"github.com/pullproxy/pullproxy/storage"
)

// A node pulling an image asks for layer after layer on one kept-alive
// connection. Once such a connection has had a stored blob answered whole,
// a loop of its own (fastPath.serve) takes it over from net/http: it reads
// each next request with a strict parser, and answers a GET or HEAD of a
// stored blob, as storedBlobAllowed lets it, with one header write and
// sendfile, in the goroutine that read it. Any other request, or one it
// cannot read with certainty, goes back to net/http with the bytes already
// read, on the same connection.
//
// What this saves is net/http's work around a response (request and header
// maps, its buffered writers, the background read, context). That work is
// the same for every response, and for a small blob, the layers and
// configs most pulls are made of, it rivals the kernel's work of sending
// the blob.

// Serve serves s on ln with hs's settings (timeouts, error log) until hs is
// shut down, and returns what hs.Serve returns. hs.Handler and
// hs.ConnContext are set to s and s.ConnContext when nil. Unlike
// hs.Serve(ln), it serves the stored blobs a kept-alive connection asks for
// on a lean path (see fastPath). Stop it with Shutdown, not hs.Shutdown
// alone: connections on that path are not net/http's to wait for.
func (s *Server) Serve(ln net.Listener, hs *http.Server) error {
	if hs.Handler == nil {
		hs.Handler = s
	}
	if hs.ConnContext == nil {
		hs.ConnContext = s.ConnContext
	}
	hs.ConnState = s.clientConns.trackClosed(hs.ConnState)
	ln = &limitListener{Listener: ln, s: s, cc: s.clientConns}
	blobs, ok := s.blobs.(blobFDOpener)
	if !ok || !s.blobLoop { // a store of another kind, or the loop turned off: net/http serves every request
		return hs.Serve(ln)
	}
	f := &fastPath{
		s:       s,
		blobs:   blobs,
		handoff: newHandoffListener(ln.Addr()),
		idle:    cmp.Or(hs.IdleTimeout, hs.ReadTimeout),
		header:  cmp.Or(hs.ReadHeaderTimeout, hs.ReadTimeout),
		write:   hs.WriteTimeout,
		conns:   map[*fastConn]bool{},
	}
	if !s.fast.CompareAndSwap(nil, f) {
		return errors.New("proxy: Serve called twice")
	}
	hs.RegisterOnShutdown(f.closeIdle)
	go hs.Serve(f.handoff) // returns once hs is shut down
	return hs.Serve(ln)
}

// Shutdown shuts hs down as hs.Shutdown does, and waits as long for the
// connections on the blob path: an idle one is closed at once, a busy one
// once its response is sent. When ctx ends first, those still open are
// closed and its error returned.
func (s *Server) Shutdown(ctx context.Context, hs *http.Server) error {
	err := hs.Shutdown(ctx)
	if f := s.fast.Load(); f != nil {
		f.closeIdle() // in case hs was never served
		if werr := f.wait(ctx); err == nil {
			err = werr
		}
	}
	return err
}

// takeOver hands the connection of r, whose response (a stored blob, whole)
// w has just written, to the blob loop, if it can carry more requests.
func (s *Server) takeOver(w http.ResponseWriter, r *http.Request) {
	f := s.fast.Load()
	ci, _ := r.Context().Value(connKey{}).(*connInfo)
	if f == nil || ci == nil || !loopCanTake(r) {
		return
	}
	// Hijack sends what net/http has buffered of the response's header,
	// but not of its body.
	if http.NewResponseController(w).Flush() != nil {
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		return
	}
	c, brw, err := hj.Hijack()
	if err != nil {
		return
	}
	// What net/http read ahead comes first, then what a connection handed
	// to it had not yet given it.
	pending := make([]byte, brw.Reader.Buffered())
	brw.Reader.Read(pending)
	if bc, ok := c.(*bufferedConn); ok {
		pending = append(pending, bc.pending...)
	}
	f.serve(ci, pending)
}

// loopCanTake reports whether the connection of r can go on to the blob
// loop once r is answered: an HTTP/1.1 request, without a body, that does
// not close it.
func loopCanTake(r *http.Request) bool {
	return r.ProtoMajor == 1 && r.ProtoMinor == 1 && !r.Close && r.ContentLength == 0 && r.TransferEncoding == nil
}

// blobFDOpener is a BlobStore whose blobs are files the loop may send
// with sendfile itself (see storage.Store.OpenBlobFD).
type blobFDOpener interface {
	OpenBlobFD(ctx context.Context, d digest.Digest) (storage.BlobFD, error)
}

// fastPath serves the connections taken over from net/http.
type fastPath struct {
	s       *Server
	blobs   blobFDOpener
	handoff *handoffListener
	// As net/http applies them: idle is the wait for a request's first
	// byte, header that for the rest of its head, write that for sending
	// the response. Zero: no limit.
	idle, header, write time.Duration

	mu      sync.Mutex
	conns   map[*fastConn]bool // true while sending a response
	closing bool
	wg      sync.WaitGroup
}

// fastConn is a connection on the blob path.
type fastConn struct {
	ci     *connInfo
	remote string
	hdr    []byte // the response header, reused
	// date is the Date field's value for the second dateAt, formatted once
	// a second rather than for every response.
	date   []byte
	dateAt int64
}

// add registers c, unless the server is shutting down.
func (f *fastPath) add(c *fastConn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closing {
		return false
	}
	f.conns[c] = false
	f.wg.Add(1)
	return true
}

func (f *fastPath) remove(c *fastConn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	f.wg.Done()
}

// setBusy marks c as sending a response (or not). It returns false when
// the server is shutting down: c is to be closed instead.
func (f *fastPath) setBusy(c *fastConn, busy bool) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.conns[c] = busy
	return !f.closing
}

// closeIdle starts the shutdown: idle connections are closed, busy ones
// are closed by their loop once their response is sent, and none goes back
// to net/http (hs.Shutdown closes the handoff listener too, unless it was
// not served yet).
func (f *fastPath) closeIdle() {
	f.handoff.Close()
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closing = true
	for c, busy := range f.conns {
		if !busy {
			c.ci.tcp.Close()
		}
	}
}

// wait waits for the connections to close, or for ctx to end: then it
// closes them.
func (f *fastPath) wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		f.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	f.mu.Lock()
	for c := range f.conns {
		c.ci.tcp.Close()
	}
	f.mu.Unlock()
	<-done
	return ctx.Err()
}

// serve runs the loop on a connection taken over from net/http, with the
// bytes already read from it.
func (f *fastPath) serve(ci *connInfo, pending []byte) {
	c := &fastConn{ci: ci, remote: ci.tcp.RemoteAddr().String(), hdr: make([]byte, 0, 512)}
	if !f.add(c) {
		f.close(ci)
		return
	}
	src := &bufferedConn{tcp: ci.tcp, pending: pending}
	src.raw, _ = rawsock.NewReader(ci.tcp) // nil: read as net.Conn
	br := bufio.NewReaderSize(src, maxFastRequest)
	for {
		req, fast, err := f.readRequest(ci.tcp, br)
		if err != nil {
			f.remove(c)
			f.close(ci)
			return
		}
		if !fast || !f.answer(c, req) {
			// Not ours: back to net/http, with what was read.
			f.remove(c)
			rest := make([]byte, br.Buffered(), br.Buffered()+len(src.pending))
			br.Read(rest)
			rest = append(rest, src.pending...)
			ci.tcp.SetDeadline(time.Time{})
			if !f.handoff.hand(&bufferedConn{tcp: ci.tcp, pending: rest}) {
				f.close(ci) // shutting down
			}
			return
		}
		br.Discard(req.size)
		if !f.setBusy(c, false) {
			f.remove(c)
			f.close(ci)
			return
		}
	}
}

// close closes a connection of the loop for good, once: the only way the
// loop lets go of one besides handing it back to net/http.
func (f *fastPath) close(ci *connInfo) {
	ci.tcp.Close()
	f.s.clientConns.closed()
}

// readRequest waits for the head of the next request, as net/http would:
// up to the idle timeout for its first byte, then the header timeout. It
// reports whether the request is one the loop may answer, or an error when
// the connection is to be closed: the client closed it, or a timeout passed
// (net/http then closes without an answer too).
func (f *fastPath) readRequest(tc *net.TCPConn, br *bufio.Reader) (req fastRequest, fast bool, err error) {
	deadline := func(d time.Duration) {
		if d > 0 {
			tc.SetReadDeadline(time.Now().Add(d))
		} else {
			tc.SetReadDeadline(time.Time{})
		}
	}
	if br.Buffered() > 0 {
		deadline(f.header)
	} else {
		deadline(f.idle)
	}
	for started := br.Buffered() > 0; ; {
		b, _ := br.Peek(br.Buffered())
		req, v := parseFastRequest(b)
		if v != fastIncomplete {
			return req, v == fastOK, nil
		}
		if len(b) > 0 && !started {
			started = true
			deadline(f.header)
		}
		if _, err := br.Peek(len(b) + 1); err != nil {
			return fastRequest{}, false, err
		}
	}
}

// answer answers req if it asks for a blob storedBlobAllowed lets it serve
// from the store without asking the upstream, and reports whether it did.
// It answers nothing else: net/http then reads req again and answers it,
// by the same policy. A response that fails part-way (the client went
// away) ends the connection.
func (f *fastPath) answer(c *fastConn, req fastRequest) bool {
	s := f.s
	ns := queryValue(req.query, "ns")
	rt, err := s.resolve(req.method, req.path, ns)
	if err != nil || rt.kind != kindBlob {
		return false // net/http answers, or refuses
	}
	start := time.Now()
	d := digest.Digest(rt.ref)
	b, err := f.blobs.OpenBlobFD(s.ctx, d)
	defer b.Release() // nothing to release when err is set
	if v, _ := s.storedBlobAllowed(s.ctx, rt, c.remote, req.method == http.MethodHead, err, false); v != blobServe {
		return false // net/http refuses, fetches, or asks the upstream (see storedBlobAllowed)
	}
	fd, size := b.FD, b.Size
	if !f.setBusy(c, true) {
		return true // shutting down: setBusy(false) says so again and the loop ends
	}
	var until time.Time
	if f.write > 0 {
		until = start.Add(f.write)
	}
	if sec := start.Unix(); sec != c.dateAt {
		c.date, c.dateAt = start.UTC().AppendFormat(c.date[:0], http.TimeFormat), sec
	}
	c.hdr = appendBlobHeader(c.hdr[:0], d, size, c.date)
	body := size
	if req.method == http.MethodHead {
		body = 0
	}
	n, err := sendBlob(c.ci.tcp, c.ci.raw, c.hdr, fd, body, s.sendTimeout, until)
	s.count(kindBlob, req.method, http.StatusOK, sourceCache, n)
	s.metrics.observe(kindBlob, sourceCache, time.Since(start))
	s.logRequest(s.ctx, req.method, req.path, ns, c.remote, http.StatusOK, n, start)
	if err != nil {
		c.ci.tcp.Close() // the loop's next read fails and ends it
	}
	return true
}

// appendBlobHeader appends the header of a stored blob's response to b: the
// one net/http sends for it (see serveBlob), field for field.
func appendBlobHeader(b []byte, d digest.Digest, size int64, date []byte) []byte {
	b = append(b, "HTTP/1.1 200 OK\r\n"+
		"Accept-Ranges: bytes\r\n"+
		"Cache-Control: max-age=31536000\r\n"+
		"Content-Length: "...)
	b = strconv.AppendInt(b, size, 10)
	b = append(b, "\r\nContent-Type: application/octet-stream\r\nDocker-Content-Digest: "...)
	b = append(b, d...)
	b = append(b, "\r\nDocker-Distribution-API-Version: registry/2.0\r\nEtag: \""...)
	b = append(b, d...)
	b = append(b, "\"\r\nPullproxy-Source: cache\r\nDate: "...)
	b = append(b, date...)
	return append(b, "\r\n\r\n"...)
}

// bufferedConn is a TCP connection some of whose bytes were already read:
// those are read first. It is how a connection goes back to net/http, and
// what the blob loop reads requests from.
type bufferedConn struct {
	tcp     *net.TCPConn
	pending []byte
	// raw, when set, reads tcp with raw system calls: the blob loop's
	// reads, which with its raw sends (see sendBlob) never wake the
	// runtime's monitor (see rawsock).
	raw *rawsock.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) {
	if len(c.pending) == 0 {
		if c.raw != nil {
			return c.raw.Read(p)
		}
		return c.tcp.Read(p)
	}
	n := copy(p, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

func (c *bufferedConn) Write(p []byte) (int, error)        { return c.tcp.Write(p) }
func (c *bufferedConn) Close() error                       { return c.tcp.Close() }
func (c *bufferedConn) LocalAddr() net.Addr                { return c.tcp.LocalAddr() }
func (c *bufferedConn) RemoteAddr() net.Addr               { return c.tcp.RemoteAddr() }
func (c *bufferedConn) SetDeadline(t time.Time) error      { return c.tcp.SetDeadline(t) }
func (c *bufferedConn) SetReadDeadline(t time.Time) error  { return c.tcp.SetReadDeadline(t) }
func (c *bufferedConn) SetWriteDeadline(t time.Time) error { return c.tcp.SetWriteDeadline(t) }

// ReadFrom lets net/http send files with sendfile on a handed-back connection.
func (c *bufferedConn) ReadFrom(r io.Reader) (int64, error) { return c.tcp.ReadFrom(r) }

// SyscallConn is the TCP connection's.
func (c *bufferedConn) SyscallConn() (syscall.RawConn, error) { return c.tcp.SyscallConn() }

// handoffListener is the listener net/http accepts handed-back connections
// from.
type handoffListener struct {
	addr  net.Addr
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newHandoffListener(addr net.Addr) *handoffListener {
	return &handoffListener{addr: addr, conns: make(chan net.Conn), done: make(chan struct{})}
}

// hand gives c to net/http. It returns false when the listener is closed.
func (l *handoffListener) hand(c net.Conn) bool {
	select {
	case l.conns <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *handoffListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *handoffListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *handoffListener) Addr() net.Addr { return l.addr }
