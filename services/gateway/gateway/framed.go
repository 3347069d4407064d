package gateway

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"runtime/debug"

	"connectrpc.com/connect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/sessionwire"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// framedStream is a Session stream over the framed transport
// (pkg/sessionwire): Connect envelopes straight on the session's TLS
// connection. Only the handler's goroutine receives; sends hold the
// session's sendMu, as on Connect.
type framedStream struct {
	c *tls.Conn
	// in reads c with the session's read-ahead (session.in), which the
	// handler waits on between messages.
	in *sessionBody
}

// Send writes m as one envelope.
func (f framedStream) Send(m *gatewayv1.SessionResponse) error {
	return sessionwire.WriteMessage(f.c, m)
}

// Receive reads the daemon's next message, with the message limit of
// every handler (service.MaxMessageBytes). It returns io.EOF when the
// daemon ended its direction (close_notify).
func (f framedStream) Receive() (*gatewayv1.SessionRequest, error) {
	m := new(gatewayv1.SessionRequest)
	if err := sessionwire.ReadMessage(f.in, m, service.MaxMessageBytes); err != nil {
		return nil, err
	}
	return m, nil
}

// serveFramed serves the session of a connection that negotiated
// sessionwire.ALPN, its handshake done with the client certificate verified
// (sessionListener). The session runs on the connection's own goroutine:
// it reads each message itself, with no hand-off. When the session ends it
// writes the end of the stream, with the error that ended it, and closes
// the connection.
func (s *Server) serveFramed(c *tls.Conn) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	defer func() { _ = c.Close() }()
	cs := c.ConnectionState()
	st := s.newSession(&cs)
	st.ctx, st.framed, st.in.rc = ctx, c, c
	st.stream = framedStream{c: c, in: &st.in}
	err := s.serveRecovered(ctx, st)
	st.finish()
	st.sendMu.Lock()
	defer st.sendMu.Unlock()
	st.setWriteDeadline(transportClock.Now().Add(sendGrace))
	if werr := sessionwire.WriteEnd(c, err); werr != nil {
		s.log.Debug("end a framed session", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, werr)
	}
}

// serveRecovered is serve, a panic of which ends only its own session (as
// net/http recovers a panicking handler of a Connect session): it is logged
// with its stack, and the daemon gets Internal.
func (s *Server) serveRecovered(ctx context.Context, st *session) (err error) {
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("panic serving a framed session", telemetry.KeyNodeID, cmp.Or(st.nodeID, st.certID),
				"panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			err = connect.NewError(connect.CodeInternal, errors.New("internal error"))
		}
	}()
	return s.serve(ctx, st)
}
