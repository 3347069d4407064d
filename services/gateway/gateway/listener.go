package gateway

import (
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/better-compute/better-compute/pkg/sessionwire"
)

// sessionListener is the Session server's listener: it does the TLS
// handshake of each connection itself (with the server's configuration,
// client certificate verified), serves one that negotiated sessionwire.ALPN
// as a framed session on a goroutine of its own (serveFramed), and hands
// the others, handshake done, to the http.Server through Accept, which
// serves them as HTTP/2. The goroutine that ran a handshake ends with it:
// certificate verification grows a stack to 32 KiB, and the runtime halves
// an idle goroutine's stack only while less than a quarter is used, so a
// session run on it would keep 16 KiB where its own goroutine keeps 8 KiB
// (BenchmarkIdleSessionMemory).
type sessionListener struct {
	net.Listener // the TCP listener, under the connection cap
	s            *Server
	timeout      time.Duration // of each handshake

	conns     chan net.Conn // handshaken connections for Accept
	acceptErr chan error    // the TCP listener's Accept error, once
	done      chan struct{} // closed by Close
	closeOnce sync.Once
	// started starts the accept loop at the first Accept: when the server
	// serves, after the gateway's Start (service.Run), not when it listens.
	started sync.Once
}

// listen wraps ln, the Session server's TCP listener
// (service.HTTPServer.WrapListener).
func (s *Server) listen(ln net.Listener) net.Listener {
	l := &sessionListener{Listener: ln, s: s, timeout: s.cfg.HTTPReadHeaderTimeout,
		conns: make(chan net.Conn), acceptErr: make(chan error, 1), done: make(chan struct{})}
	if l.timeout <= 0 {
		l.timeout = 10 * time.Second
	}
	return l
}

func (l *sessionListener) acceptLoop() {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			l.acceptErr <- err
			return
		}
		go l.handshake(c)
	}
}

// handshake does c's TLS handshake within the timeout, then serves it or
// hands it to Accept.
func (l *sessionListener) handshake(c net.Conn) {
	ic := &idleConn{Conn: c}
	tc := tls.Server(ic, l.s.tls)
	_ = c.SetDeadline(transportClock.Now().Add(l.timeout))
	if err := tc.Handshake(); err != nil {
		l.s.log.Debug("TLS handshake of a session connection", "remote_addr", c.RemoteAddr().String(), "error", err)
		_ = c.Close()
		return
	}
	_ = c.SetDeadline(time.Time{})
	if cs := tc.ConnectionState(); cs.NegotiatedProtocol == sessionwire.ALPN {
		// The session is made here, so that the connection state (about
		// 600 bytes) is on this goroutine's stack, not on the session's.
		go l.s.serveFramed(tc, ic, l.s.newSession(&cs))
		return
	}
	select {
	case l.conns <- tc:
	case <-l.done:
		_ = tc.Close()
	}
}

// Accept returns the next connection that is not a framed session's, its
// handshake done.
func (l *sessionListener) Accept() (net.Conn, error) {
	l.started.Do(func() { go l.acceptLoop() })
	select {
	case c := <-l.conns:
		return c, nil
	case err := <-l.acceptErr:
		l.acceptErr <- err
		return nil, err
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting: the TCP listener closes, and connections whose
// handshake ends afterwards are closed.
func (l *sessionListener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		close(l.done)
		err = l.Listener.Close()
	})
	return err
}

// idleConn is a session connection under crypto/tls, which lets an idle
// framed session wait for the daemon's next bytes in wait, at a shallow
// frame of its goroutine, instead of inside crypto/tls's Read: parked
// there, the goroutine uses about 1 KiB of its stack, which lets the
// runtime shrink that stack to 4 KiB (it halves a stack of which less than
// a quarter is used, counting 800 bytes for the runtime's own calls), where
// a wait in crypto/tls keeps 8 KiB. wait reads into buf, which Read returns
// first; a heartbeat's record (about 50 bytes) fits. Only the session's
// goroutine reads (crypto/tls's Read, or wait when crypto/tls holds none of
// the daemon's bytes: session.waitFramed).
type idleConn struct {
	net.Conn
	buf  [64]byte
	r, w uint8 // buf[r:w] is read and not yet returned
	// nowait makes Read return errWouldWait rather than read the
	// connection: crypto/tls then returns what it holds, or that error.
	nowait bool
	err    error // what wait's read returned, returned once buf[r:w] is
}

// errWouldWait is what an idleConn's Read returns in nowait when reading
// the connection would wait. It is temporary (net.Error), as a read
// deadline's timeout is, which crypto/tls returns without failing the
// connection.
var errWouldWait net.Error = wouldWait{}

type wouldWait struct{}

func (wouldWait) Error() string   { return "reading the connection would wait" }
func (wouldWait) Timeout() bool   { return true }
func (wouldWait) Temporary() bool { return true }

// wait waits until the daemon sent more, or the connection ended or
// failed (a read deadline passed among others: session.abort), unless
// bytes or an error are waiting already.
func (c *idleConn) wait() {
	if c.r < c.w || c.err != nil {
		return
	}
	n, err := c.Conn.Read(c.buf[:])
	c.r, c.w, c.err = 0, uint8(n), err
}

// Read returns the bytes wait read, then its error (once), then reads on;
// in nowait it returns errWouldWait instead of reading.
func (c *idleConn) Read(p []byte) (int, error) {
	if c.r < c.w {
		n := copy(p, c.buf[c.r:c.w])
		c.r += uint8(n)
		return n, nil
	}
	if err := c.err; err != nil {
		c.err = nil
		return 0, err
	}
	if c.nowait {
		return 0, errWouldWait
	}
	return c.Conn.Read(p)
}
