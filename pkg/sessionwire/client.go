package sessionwire

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"connectrpc.com/connect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// Dialer opens the TCP connection of a session, as net.Dialer.DialContext.
type Dialer func(ctx context.Context, network, addr string) (net.Conn, error)

// ClientStream is the daemon's end of one framed Session stream, with the
// methods of Connect's BidiStreamForClient that a daemon uses, so either
// can carry a session. It dials on first use (Send or Receive), as Connect
// sends its request with the first message. Send may be called by one
// goroutine and Receive by another at the same time; CloseRequest and
// CloseResponse from any. Errors are *connect.Error, as Connect's: a
// failed dial or a connection lost mid-stream is Unavailable; what the
// gateway ended the stream with is its code.
type ClientStream struct {
	ctx      context.Context
	dial     Dialer
	addr     string
	cfg      *tls.Config
	maxBytes int

	once    sync.Once
	conn    *tls.Conn // set by connect, nil when it failed
	dialErr error
	stop    func() bool // unregisters the context's AfterFunc

	closeMu sync.Mutex
	closed  bool // CloseResponse ran: a later connect closes at once
}

// errStreamClosed is the error of a stream used after CloseResponse.
var errStreamClosed = connect.NewError(connect.CodeCanceled, errors.New("the session stream was closed"))

// HandshakeTimeout bounds a ClientStream's dial and TLS handshake.
const HandshakeTimeout = 10 * time.Second

// NewClientStream returns the stream of a session to the gateway at addr
// ("host:port"), dialed by dial (net.Dialer's when nil) with TLS
// configuration cfg, whose NextProtos is replaced by ALPN alone (and whose
// ServerName is addr's host when empty). A message
// from the gateway larger than maxBytes ends the stream
// (ResourceExhausted). Cancelling ctx closes the connection.
func NewClientStream(ctx context.Context, dial Dialer, addr string, cfg *tls.Config, maxBytes int) *ClientStream {
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	cfg = cfg.Clone()
	cfg.NextProtos = []string{ALPN}
	if cfg.ServerName == "" {
		// As net/http does for https://HOST:PORT.
		if host, _, err := net.SplitHostPort(addr); err == nil {
			cfg.ServerName = host
		}
	}
	return &ClientStream{ctx: ctx, dial: dial, addr: addr, cfg: cfg, maxBytes: maxBytes}
}

// IsUnsupported reports whether err is a gateway's refusal of the framed
// transport during the handshake (the no_application_protocol alert of
// RFC 7301 §3.2): the gateway serves Sessions over Connect only.
func IsUnsupported(err error) bool {
	// crypto/tls reports an alert from the peer as a net.OpError "remote
	// error" whose Err, of an unexported type, is the alert's text.
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "remote error" && op.Err != nil && op.Err.Error() == "tls: no application protocol"
}

// connect dials once; every caller waits for the first.
func (s *ClientStream) connect() (*tls.Conn, error) {
	s.once.Do(func() {
		s.closeMu.Lock()
		closed := s.closed
		s.closeMu.Unlock()
		if closed {
			s.dialErr = errStreamClosed
			return
		}
		ctx, cancel := context.WithTimeout(s.ctx, HandshakeTimeout)
		defer cancel()
		raw, err := s.dial(ctx, "tcp", s.addr)
		if err != nil {
			s.dialErr = connect.NewError(connect.CodeUnavailable, fmt.Errorf("dial the gateway %s: %w", s.addr, err))
			return
		}
		c := tls.Client(raw, s.cfg)
		if err := c.HandshakeContext(ctx); err != nil {
			_ = raw.Close()
			s.dialErr = connect.NewError(connect.CodeUnavailable, fmt.Errorf("TLS handshake with the gateway %s: %w", s.addr, err))
			return
		}
		s.closeMu.Lock()
		closed = s.closed
		if !closed {
			s.conn = c
			s.stop = context.AfterFunc(s.ctx, func() { _ = c.Close() })
		}
		s.closeMu.Unlock()
		if closed {
			_ = c.Close()
			s.dialErr = errStreamClosed
		}
	})
	return s.conn, s.dialErr
}

// Send sends m. It returns io.EOF when the gateway ended the stream (as
// Connect's Send does), Receive then saying how.
func (s *ClientStream) Send(m *gatewayv1.SessionRequest) error {
	c, err := s.connect()
	if err != nil {
		return err
	}
	if err := WriteMessage(c, m); err != nil {
		return s.lost(err, io.EOF)
	}
	return nil
}

// Receive returns the gateway's next message. It returns io.EOF when the
// gateway ended the stream without error, and the *connect.Error it ended
// it with otherwise.
func (s *ClientStream) Receive() (*gatewayv1.SessionResponse, error) {
	c, err := s.connect()
	if err != nil {
		return nil, err
	}
	m := new(gatewayv1.SessionResponse)
	if err := ReadMessage(c, m, s.maxBytes); err != nil {
		if s.ctx.Err() != nil {
			return nil, connect.NewError(connect.CodeCanceled, s.ctx.Err())
		}
		var cerr *connect.Error
		switch {
		case errors.Is(err, ErrEnd):
			return nil, io.EOF
		case errors.Is(err, io.EOF):
			// The gateway ends every stream with an envelope.
			return nil, s.lost(io.ErrUnexpectedEOF, nil)
		case errors.As(err, &cerr):
			return nil, err
		}
		return nil, s.lost(err, nil)
	}
	return m, nil
}

// lost is the error of a read or write that failed with err: Canceled once
// the stream's context ended, ifClosed (when not nil) once the connection
// was closed on this side, Unavailable "lost the connection" otherwise.
func (s *ClientStream) lost(err, ifClosed error) error {
	switch {
	case s.ctx.Err() != nil:
		return connect.NewError(connect.CodeCanceled, s.ctx.Err())
	case ifClosed != nil && errors.Is(err, net.ErrClosed):
		return ifClosed
	}
	return connect.NewError(connect.CodeUnavailable, fmt.Errorf("lost the connection to the gateway: %w", err))
}

// CloseRequest ends the daemon's direction (TLS close_notify): the gateway
// reads the end, and ends the stream once it handled what came before.
func (s *ClientStream) CloseRequest() error {
	c, err := s.connect()
	if err != nil {
		return err
	}
	return c.CloseWrite()
}

// CloseResponse closes the connection; a Receive waiting returns. A stream
// not dialed yet never dials.
func (s *ClientStream) CloseResponse() error {
	s.closeMu.Lock()
	s.closed = true
	c := s.conn
	s.closeMu.Unlock()
	if c == nil {
		return nil
	}
	s.stop()
	return c.Close()
}
