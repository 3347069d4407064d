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

// serveFramed serves session st (newSession) of connection c, which
// negotiated sessionwire.ALPN, its handshake done over ic with the client
// certificate verified (sessionListener). The session runs on the
// connection's own goroutine: it reads each message itself, with no
// hand-off. A panic serving it ends only this session (as net/http
// recovers a panicking handler of a Connect session): it is logged with
// its stack, and the daemon gets Internal. When the session ends it writes
// the end of the stream, with the error that ended it, and closes the
// connection (endFramed). Its frame is kept small, as serve's: it is on
// the stack of the idle session (waitFramed).
func (s *Server) serveFramed(c *tls.Conn, ic *idleConn, st *session) {
	ctx, cancel := context.WithCancel(context.Background())
	st.ctx, st.framed, st.idle, st.in.rc = ctx, c, ic, c
	st.stream = framedStream{c: c, in: &st.in}
	var err error
	defer func() {
		if p := recover(); p != nil {
			err = s.framedPanic(st, p)
		}
		cancel()
		s.endFramed(st, err)
	}()
	err = s.serve(ctx, st)
}

// framedPanic logs panic p of framed session st with its stack and returns
// the error that ends the session.
func (s *Server) framedPanic(st *session, p any) error {
	s.log.Error("panic serving a framed session", telemetry.KeyNodeID, cmp.Or(st.nodeID, st.certID),
		"panic", fmt.Sprint(p), "stack", string(debug.Stack()))
	return connect.NewError(connect.CodeInternal, errors.New("internal error"))
}

// endFramed ends framed session st, which err ended: it writes the end of
// the stream and closes the connection.
func (s *Server) endFramed(st *session, err error) {
	defer func() { _ = st.framed.Close() }()
	st.finish()
	st.sendMu.Lock()
	defer st.sendMu.Unlock()
	st.setWriteDeadline(transportClock.Now().Add(sendGrace))
	if werr := sessionwire.WriteEnd(st.framed, err); werr != nil {
		s.log.Debug("end a framed session", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, werr)
	}
}

// waitFramed waits until the daemon's next bytes arrived, or its stream
// ended or failed, at a shallow frame (idleConn.wait) when crypto/tls holds
// none of them: it first takes what crypto/tls holds already (the rest of a
// record, or records read together with the last one) into st.in, reading
// with the connection under it refusing to wait (idleConn.nowait).
func (st *session) waitFramed() {
	b := &st.in
	if b.r < b.w || b.err != nil {
		return
	}
	st.idle.nowait = true
	n, err := st.framed.Read(b.head[:])
	st.idle.nowait = false
	if n > 0 || (err != nil && !errors.Is(err, errWouldWait)) {
		b.r, b.w, b.err = 0, uint8(n), err
		return
	}
	st.idle.wait()
}
