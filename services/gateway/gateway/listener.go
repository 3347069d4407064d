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
	tc := tls.Server(c, l.s.tls)
	_ = c.SetDeadline(transportClock.Now().Add(l.timeout))
	if err := tc.Handshake(); err != nil {
		l.s.log.Debug("TLS handshake of a session connection", "remote_addr", c.RemoteAddr().String(), "error", err)
		_ = c.Close()
		return
	}
	_ = c.SetDeadline(time.Time{})
	if tc.ConnectionState().NegotiatedProtocol == sessionwire.ALPN {
		go l.s.serveFramed(tc)
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
