package gateway

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Errors a stream ends with when the gateway closes it.
var (
	errSuperseded   = connect.NewError(connect.CodeAborted, errors.New("session superseded by a newer session of this node"))
	errSilent       = connect.NewError(connect.CodeDeadlineExceeded, errors.New("no message from the node within the idle timeout"))
	errNoHello      = connect.NewError(connect.CodeDeadlineExceeded, errors.New("no hello within the hello timeout"))
	errShuttingDown = connect.NewError(connect.CodeUnavailable, errors.New("gateway is shutting down; reconnect"))
	errPendingWork  = connect.NewError(connect.CodeUnavailable, errors.New("the gateway could not read the session's pending work; reconnect"))
	errFenced       = connect.NewError(connect.CodeUnavailable, errors.New("the gateway cannot reach its database; reconnect"))
	// errRevoked ends the session of a revoked node or certificate, and
	// refuses its Hello.
	errRevoked = connect.NewError(connect.CodeUnauthenticated, errors.New("certificate revoked"))
	// Refusals of a client certificate, at Hello and for a node's tunnel.
	errNoNodeCert  = connect.NewError(connect.CodeUnauthenticated, errors.New("the client certificate names no node of this trust domain"))
	errUnknownCert = connect.NewError(connect.CodeUnauthenticated, errors.New("the client certificate is not known"))
	errExpiredCert = connect.NewError(connect.CodeUnauthenticated, errors.New("the client certificate has expired"))
)

// sessionCertExpired is what ends a session whose certificate (sessionCert)
// expired at notAfter, and why a renewal on it is refused.
func sessionCertExpired(notAfter time.Time) string {
	return "the session's certificate expired at " + notAfter.UTC().Format(time.RFC3339) +
		": reconnect with a renewed certificate, or join again"
}

// sessionCert is the certificate a session's authority rests on.
type sessionCert struct {
	serial   string    // lower-case hex (pki.SerialHex)
	notAfter time.Time // when the session ends unless renewed
	// cert is the certificate itself, which a renewal forwards to
	// JoinService with the daemon's proof signed by its key.
	cert *x509.Certificate
}

// certRefusal says why st's client certificate may not be used at now,
// given its node_certs row as store.GetSessionCert or LockSessionCert
// returned it (cert, err): unknown, another node's, revoked, expired. It
// returns nil, nil when the certificate may be used, and a database error as
// its second result.
func certRefusal(st *session, cert store.SessionCert, err error, now time.Time) (error, error) {
	switch {
	case errors.Is(err, store.ErrNotFound) || (err == nil && cert.NodeID != st.certID):
		return errUnknownCert, nil
	case err != nil:
		return nil, err
	case cert.RevokedAt != nil:
		return errRevoked, nil
	case !cert.NotAfter.After(now):
		return errExpiredCert, nil
	}
	return nil, nil
}

// Delivery states of a session (session.state). A wake moves idle to
// running (and starts a delivery goroutine) or running to dirty (the
// goroutine runs once more); closed is a bit set when the stream ends.
const (
	stIdle    int32 = 0
	stRunning int32 = 1
	stDirty   int32 = 2
	stClosed  int32 = 4
)

// session is one Session stream: created by the middleware for each request
// with the peer's identity, then made a node's session by Hello. Its fields
// are kept few: a gateway holds thousands.
type session struct {
	// Set by the middleware, read-only afterwards.
	ctx     context.Context
	w       http.ResponseWriter
	body    io.Closer
	certID  string // node id of the client certificate, "" when none
	certErr error  // why the certificate names no node
	serial  string // certificate serial, lower-case hex
	// client is the client certificate (the TLS connection's).
	client *x509.Certificate
	// stream carries the session: Connect's BidiStream over HTTP/2, or
	// a framedStream.
	stream sessionStream
	// framed is the connection of a framed session (framed.go), nil on
	// Connect, where w and body are the request's; idle is the connection
	// under it, where an idle framed session waits (waitFramed).
	framed *tls.Conn
	idle   *idleConn
	// in is what the handler reads the daemon's messages from, with a
	// read-ahead it waits on (sessionBody.fill) between messages: the
	// request body over Connect, the TLS connection when framed.
	in sessionBody

	// Set at Hello under Server.mu, read-only afterwards.
	nodeID    string
	sessionID string
	epoch     int64
	// counted is set, by the handler's goroutine, when Hello counted the
	// session opened (bc.gateway.sessions.opened): closeSession, on that
	// goroutine too, then counts it closed.
	counted bool

	lastRecv atomic.Int64 // clock time of the last message, Unix ns
	reported atomic.Int64 // greatest generation the daemon reported
	sent     atomic.Int64 // greatest generation sent in this session
	state    atomic.Int32 // stIdle, stRunning, stDirty | stClosed
	// seenWritten is the clock time (Unix ns) of the session's last hearing
	// written to last_seen, by its open or through the last_seen batch, and
	// genWritten the greatest generation written as observed (Hello's, a
	// Report's, a heartbeat's through the batch): lastSeenBatcher.record
	// leaves out the hearings that would add nothing for a while.
	seenWritten atomic.Int64
	genWritten  atomic.Int64

	// cert is the certificate the session's authority rests on: the client
	// certificate's node_certs row from Hello on, then each certificate
	// renewed on the session (issue). Its NotAfter ends the session
	// (expired). A daemon goes on over the connection of its old
	// certificate after a renewal and presents the new one from its next
	// dial (pkg/agent), so a renewal on time extends its session.
	cert atomic.Pointer[sessionCert]

	// renewing is set while a RenewCertificate is being decided (renew).
	renewing atomic.Bool
	// issued is the answer to a RenewCertificate, sent by the next
	// delivery (deliveries send everything after Welcome but heartbeat
	// acknowledgements).
	issued atomic.Pointer[gatewayv1.CertificateIssued]

	// deliverMu is held while delivering; closing takes it to wait for a
	// delivery in flight, so no Send runs after the handler returns.
	deliverMu sync.Mutex
	inFlight  bool // next delivery also resends delivered and running commands
	// sendMu is held by each Send after Welcome: deliveries and heartbeat
	// acknowledgements go out from different goroutines.
	sendMu sync.Mutex

	// abortMu guards aborting against the end of the handler.
	abortMu  sync.Mutex
	done     bool
	abortErr error
}

type sessionKey struct{}

// sessionStream is what a session sends and receives on, whatever carries
// it.
type sessionStream interface {
	Send(*gatewayv1.SessionResponse) error
	Receive() (*gatewayv1.SessionRequest, error)
}

// newSession is the session of a connection whose TLS state is cs: its
// client certificate, and whether that names a node of the trust domain.
func (s *Server) newSession(cs *tls.ConnectionState) *session {
	st := &session{}
	if cs != nil && len(cs.PeerCertificates) > 0 {
		cert := cs.PeerCertificates[0]
		st.client = cert
		st.serial = pki.SerialHex(cert)
		st.certID, st.certErr = pki.NodeIDFromCert(cert, s.cfg.TrustDomain)
	} else {
		st.certErr = errors.New("no client certificate")
	}
	return st
}

// peerMiddleware reads the verified client certificate of each request into a
// session in the request's context (connect.Peer does not carry it), and
// keeps what is needed to abort the stream from another goroutine.
func (s *Server) peerMiddleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := s.newSession(r.TLS)
		st.w, st.body = w, r.Body
		st.ctx = context.WithValue(r.Context(), sessionKey{}, st)
		defer st.finish()
		r = r.WithContext(st.ctx)
		if r.URL.Path == gatewayv1connect.GatewayServiceSessionProcedure {
			st.in.rc = r.Body
			r.Body = &st.in
		}
		next.ServeHTTP(w, r)
	})
}

// sessionBody is a Session stream's request body with a small read-ahead:
// the handler waits for the daemon's next message in fill, before it calls
// Receive, rather than deep inside Connect's Receive. Parked there its
// goroutine uses about 1.5 KiB less of its stack, which lets the runtime
// shrink that stack from 16 KiB to 8 KiB (it halves a stack less than a
// quarter used); and a message that fits in head (a heartbeat, about a
// dozen bytes) is taken from HTTP/2 in one Read instead of two (its prefix,
// then its payload), each of which is a hand-off to the connection's
// goroutine. On a framed session rc is the TLS connection, and
// session.waitFramed fills head before fill, from what crypto/tls holds,
// or waits shallower still. Only the handler's goroutine reads it.
type sessionBody struct {
	rc   io.ReadCloser
	head [64]byte
	r, w uint8 // head[r:w] is read ahead and not yet returned
	err  error // what the read ahead returned, returned once head[r:w] is
}

// fill waits until the daemon sent more of the stream, or ended it, unless
// bytes or an error are already waiting.
func (b *sessionBody) fill() {
	if b.rc == nil || b.r < b.w || b.err != nil {
		return
	}
	n, err := b.rc.Read(b.head[:])
	b.r, b.w, b.err = 0, uint8(n), err
}

// Read returns the bytes read ahead, then what the read ahead returned,
// then reads on.
func (b *sessionBody) Read(p []byte) (int, error) {
	if b.r < b.w {
		n := copy(p, b.head[b.r:b.w])
		b.r += uint8(n)
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	return b.rc.Read(p)
}

// Close closes the request body; a Read waiting on it returns.
func (b *sessionBody) Close() error { return b.rc.Close() }

func sessionFrom(ctx context.Context) *session {
	st, _ := ctx.Value(sessionKey{}).(*session)
	return st
}

// sendGrace is how long a Send in flight may still take once its session is
// closing; then the stream is reset.
const sendGrace = 5 * time.Second

// transportClock sets HTTP/2 write deadlines, which net/http measures in
// real time whatever clock the gateway runs on.
var transportClock = clock.New()

// abort ends the stream from any goroutine: the handler's Receive fails and
// the handler returns err to the daemon; a Send blocked on a daemon that
// stopped reading fails after sendGrace. It does nothing once the handler
// has returned or after the first abort.
func (st *session) abort(err error) {
	st.abortMu.Lock()
	defer st.abortMu.Unlock()
	if st.done || st.abortErr != nil {
		return
	}
	st.abortErr = err
	if st.framed != nil {
		// A Read waiting returns (a timeout leaves the TLS connection
		// writable, for the end of the stream).
		_ = st.framed.SetReadDeadline(time.Unix(1, 0))
	} else {
		_ = st.body.Close()
	}
	st.setWriteDeadline(transportClock.Now().Add(sendGrace))
}

// setWriteDeadline makes a Send still blocked at t fail.
func (st *session) setWriteDeadline(t time.Time) {
	if st.framed != nil {
		_ = st.framed.SetWriteDeadline(t)
		return
	}
	_ = http.NewResponseController(st.w).SetWriteDeadline(t)
}

// send sends m on the stream after Welcome (sendMu).
func (st *session) send(m *gatewayv1.SessionResponse) error {
	st.sendMu.Lock()
	defer st.sendMu.Unlock()
	return st.stream.Send(m)
}

// ackHeartbeat answers the daemon's heartbeat seq (HeartbeatAck)
// from the handler's goroutine. When a delivery is sending at that moment,
// its message is the answer: the handler never waits for a send, so it
// goes on reading. A failed send ends the stream, which the next Receive
// reports.
func (s *Server) ackHeartbeat(st *session, seq int64) {
	if !st.sendMu.TryLock() {
		return
	}
	defer st.sendMu.Unlock()
	a := acks.Get().(*heartbeatAck)
	a.ack.Seq = seq
	err := st.stream.Send(&a.resp)
	acks.Put(a)
	if err != nil {
		s.log.Debug("send heartbeat ack", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
	}
}

// heartbeatAck is a HeartbeatAck message, reused: Send has encoded it
// when it returns, so every heartbeat's answer takes one from acks instead
// of allocating three objects.
type heartbeatAck struct {
	resp gatewayv1.SessionResponse
	msg  gatewayv1.SessionResponse_HeartbeatAck
	ack  gatewayv1.HeartbeatAck
}

var acks = sync.Pool{New: func() any {
	a := &heartbeatAck{}
	a.msg.HeartbeatAck = &a.ack
	a.resp.Msg = &a.msg
	return a
}}

// bound makes a Send that blocks for longer than sendGrace (a daemon that
// stopped reading) fail by resetting the stream then.
func (st *session) bound() {
	st.abortMu.Lock()
	defer st.abortMu.Unlock()
	if !st.done {
		st.setWriteDeadline(transportClock.Now().Add(sendGrace))
	}
}

// finish marks the handler returned; abort is a no-op afterwards.
func (st *session) finish() {
	st.abortMu.Lock()
	st.done = true
	st.abortMu.Unlock()
}

// endErr is what the handler returns when Receive failed with err.
func (st *session) endErr(err error) error {
	st.abortMu.Lock()
	aerr := st.abortErr
	st.abortMu.Unlock()
	if aerr != nil {
		return aerr
	}
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

func (st *session) touch(now time.Time) { st.lastRecv.Store(now.UnixNano()) }

// expired returns the error that ends st when its certificate (cert) is
// expired at now (at or past its NotAfter), and nil otherwise or before
// Hello.
func (st *session) expired(now time.Time) error {
	c := st.cert.Load()
	if c == nil || now.Before(c.notAfter) {
		return nil
	}
	return connect.NewError(connect.CodeUnauthenticated, errors.New(sessionCertExpired(c.notAfter)))
}

// known is the greatest generation the daemon has or was sent.
func (st *session) known() int64 { return max(st.reported.Load(), st.sent.Load()) }

func raise(v *atomic.Int64, n int64) {
	for {
		old := v.Load()
		if n <= old || v.CompareAndSwap(old, n) {
			return
		}
	}
}

// Session implements bc.gateway.v1.GatewayService/Session, over Connect;
// serveFramed serves the same stream over the framed transport.
func (s *Server) Session(ctx context.Context, stream *connect.BidiStream[gatewayv1.SessionRequest, gatewayv1.SessionResponse]) error {
	st := sessionFrom(ctx)
	if st == nil {
		return connect.NewError(connect.CodeUnauthenticated, errors.New("the session needs a client certificate over TLS"))
	}
	st.stream = stream
	// A session is bounded by HelloTimeout and IdleTimeout (resync), not
	// by the server's request timeout.
	service.LongLived(ctx)
	return s.serve(ctx, st)
}

// serve runs session st, whichever transport carries it, until it ends,
// and returns what ends the stream: nil when the daemon ended it, else the
// Connect error to end it with. Its frame, and those of the calls it waits
// in between messages, are kept small (Hello is opened in open): they are
// on the stack of every idle session (waitFramed).
func (s *Server) serve(ctx context.Context, st *session) (err error) {
	if !s.track(st) {
		return errShuttingDown
	}
	defer s.untrack(st)
	welcome, err := s.open(ctx, st)
	if err != nil {
		return err
	}
	defer func() { s.closeSession(st, err) }()
	if err := st.stream.Send(welcome); err != nil {
		return st.endErr(err)
	}
	// The session is registered in state running, so wakes during the
	// first delivery only mark it dirty; run it here, then go idle.
	s.deliverLoop(st)

	for {
		// Wait for the next message here, not in Receive (sessionBody,
		// waitFramed).
		if st.idle != nil {
			st.waitFramed()
		}
		st.in.fill()
		req, err := s.receive(st)
		if err != nil {
			return st.endErr(err)
		}
		now := s.clk.Now()
		st.touch(now)
		if err := s.handle(ctx, st, req); err != nil {
			return err
		}
		s.seen.record(st, now)
	}
}

// open reads st's Hello and opens the session (hello), and returns the
// Welcome to send; its error ends the stream.
func (s *Server) open(ctx context.Context, st *session) (*gatewayv1.SessionResponse, error) {
	st.touch(s.clk.Now())
	req, err := s.receive(st)
	if err != nil {
		return nil, st.endErr(err)
	}
	st.touch(s.clk.Now())
	hello := req.GetHello()
	if hello == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the first message of a session must be hello"))
	}
	return s.hello(ctx, st, hello)
}

// receive reads st's next message and checks it against gateway.proto's
// rules (protovalidate): the Session handler runs without the validating
// interceptor (see New), so every message is checked here. Its error is
// Receive's (io.EOF when the daemon closed the stream), or InvalidArgument
// naming the field of a message that breaks a rule; the handler ends the
// stream with st.endErr of it, which ends only this session.
func (s *Server) receive(st *session) (*gatewayv1.SessionRequest, error) {
	req, err := st.stream.Receive()
	if err != nil {
		return nil, err
	}
	if err := checkMessage(req); err != nil {
		s.log.WarnContext(st.ctx, "invalid session message", telemetry.KeyNodeID, cmp.Or(st.nodeID, st.certID),
			telemetry.KeyError, err)
		return nil, err
	}
	return req, nil
}

// track adds a new stream unless the gateway is shutting down.
func (s *Server) track(st *session) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return false
	}
	s.streams[st] = struct{}{}
	s.handlers.Add(1)
	return true
}

func (s *Server) untrack(st *session) {
	s.mu.Lock()
	delete(s.streams, st)
	s.mu.Unlock()
	s.handlers.Done()
}

// hello checks the client certificate against hello and the database, makes
// st the node's live session and returns the Welcome to send. The check and
// the open are one statement (store.OpenSessions), in a transaction the
// Hellos that arrive together share (the opens batcher).
func (s *Server) hello(ctx context.Context, st *session, h *gatewayv1.Hello) (*gatewayv1.SessionResponse, error) {
	h, err := decodeHello(h)
	if err != nil {
		return nil, err
	}
	if st.certErr != nil {
		return nil, errNoNodeCert
	}
	if st.certID != h.GetNodeId() {
		s.log.WarnContext(ctx, "hello names another node than the certificate", telemetry.KeyNodeID, h.GetNodeId(), "cert_node_id", st.certID)
		return nil, connect.NewError(connect.CodePermissionDenied, errors.New("hello.node_id does not match the client certificate"))
	}
	now := s.db.Now()
	sessionID := ids.New(ids.Session, now)
	// DoSettled, not Do: an open that a flush took is waited for even when
	// the stream ends meanwhile, so that a session it opened is closed by
	// Session's deferred closeSession rather than left open, held by this
	// live gateway, on a machine that is gone.
	res, err := s.batch.opens.DoSettled(ctx, store.OpenSessionRequest{Serial: st.serial, OpenSessionParams: store.OpenSessionParams{
		NodeID:             st.certID,
		GatewayID:          s.cfg.GatewayID,
		SessionID:          sessionID,
		BootID:             h.GetBootId(),
		AgentVersion:       h.GetAgentVersion(),
		ObservedGeneration: h.GetObservedGeneration(),
		Now:                now,
	}})
	if err != nil {
		s.log.ErrorContext(ctx, "open session", telemetry.KeyNodeID, st.certID, telemetry.KeyError, err)
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("the gateway could not open the session; retry"))
	}
	var certErr error
	if !res.CertFound {
		certErr = store.ErrNotFound
	}
	// certErr is nil or ErrNotFound, so certRefusal reports no database
	// error.
	refusal, _ := certRefusal(st, res.Cert, certErr, now)
	if refusal == nil && !res.Opened {
		refusal = connect.NewError(connect.CodeNotFound, errors.New("hello.node_id names no node"))
	}
	if refusal != nil {
		s.log.WarnContext(ctx, "session refused", telemetry.KeyNodeID, st.certID, "cert_serial", st.serial, telemetry.KeyError, refusal)
		return nil, refusal
	}
	opened, notAfter := res.Session, res.Cert.NotAfter

	st.cert.Store(&sessionCert{serial: st.serial, notAfter: notAfter, cert: st.client})
	st.reported.Store(h.GetObservedGeneration())
	// The open wrote last_seen and the observed generation.
	st.seenWritten.Store(now.UnixNano())
	st.genWritten.Store(h.GetObservedGeneration())
	st.inFlight = true
	st.state.Store(stRunning)
	var older *session
	s.mu.Lock()
	st.nodeID, st.sessionID, st.epoch = st.certID, sessionID, opened.Epoch
	if cur := s.byNode[st.nodeID]; cur == nil || cur.epoch < st.epoch {
		older = cur
		s.byNode[st.nodeID] = st
	} else {
		// A newer session of this node registered first.
		older = st
	}
	s.mu.Unlock()
	if older == st {
		st.state.Store(stClosed) // no delivery ever ran
		s.closeSession(st, errSuperseded)
		return nil, errSuperseded
	}
	if older != nil {
		older.abort(errSuperseded)
	}
	st.counted = true
	s.metrics.opened.Add(ctx, 1, s.metrics.gwAdd...)
	s.log.InfoContext(ctx, "session opened", telemetry.KeyNodeID, st.nodeID, telemetry.KeySessionID, sessionID,
		"session_epoch", opened.Epoch, "boot_id", h.GetBootId(), "observed_generation", h.GetObservedGeneration(),
		"journal_entries", len(h.GetJournal()))
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Welcome{Welcome: &gatewayv1.Welcome{
		SessionId:         sessionID,
		GatewayId:         s.cfg.GatewayID,
		HeartbeatInterval: durationpb.New(s.cfg.HeartbeatInterval),
		SessionEpoch:      opened.Epoch,
	}}}, nil
}

// closeSession ends st as a node's session, which its handler ended with
// err: it waits for a delivery in flight, unregisters st, ends the tunnels
// st carried and clears the node's session in the database if it is still
// st's.
func (s *Server) closeSession(st *session, err error) {
	for {
		old := st.state.Load()
		if st.state.CompareAndSwap(old, old|stClosed) {
			if old&(stRunning|stDirty) != 0 {
				// A delivery is in flight; do not wait for it forever.
				st.bound()
			}
			break
		}
	}
	st.deliverMu.Lock()
	st.deliverMu.Unlock() //nolint:staticcheck // waits for a delivery in flight
	s.mu.Lock()
	if s.byNode[st.nodeID] == st {
		delete(s.byNode, st.nodeID)
	}
	s.mu.Unlock()
	// No tunnel joins st now: addTunnel takes st only from byNode.
	s.endSessionTunnels(st, err)

	ctx, cancel := context.WithTimeout(context.WithoutCancel(st.ctx), 5*time.Second)
	defer cancel()
	var lastSeen time.Time
	if ns := st.lastRecv.Load(); ns > 0 {
		lastSeen = time.Unix(0, ns).UTC().Truncate(time.Microsecond)
	}
	if st.counted {
		s.metrics.sessionClosed(ctx, err)
	}
	cleared, cerr := s.clearSession(ctx, unclosedSession{nodeID: st.nodeID, sessionID: st.sessionID, lastSeen: lastSeen})
	if cerr != nil {
		s.log.Warn("clear session (resync writes it again)", telemetry.KeyNodeID, st.nodeID, telemetry.KeySessionID, st.sessionID, telemetry.KeyError, cerr)
	}
	s.log.Info("session closed", telemetry.KeyNodeID, st.nodeID, telemetry.KeySessionID, st.sessionID, "cleared", cleared)
}

// wake asks for a delivery to st without blocking: it starts one delivery
// goroutine when none runs, or makes the running one go round once more.
func (s *Server) wake(st *session) {
	for {
		old := st.state.Load()
		switch {
		case old&stClosed != 0 || old == stDirty:
			return
		case old == stIdle:
			if st.state.CompareAndSwap(stIdle, stRunning) {
				go s.deliverLoop(st)
				return
			}
		case old == stRunning:
			if st.state.CompareAndSwap(stRunning, stDirty) {
				return
			}
		}
	}
}

// deliverLoop delivers until no wake arrived during the last delivery. The
// caller has moved st to running.
func (s *Server) deliverLoop(st *session) {
	st.deliverMu.Lock()
	defer st.deliverMu.Unlock()
	for {
		if st.state.Load()&stClosed != 0 {
			return
		}
		s.deliver(st)
		if st.state.CompareAndSwap(stRunning, stIdle) {
			return
		}
		// Dirty: another wake came in; run again. Closed: stop.
		if !st.state.CompareAndSwap(stDirty, stRunning) {
			return
		}
	}
}

// deliver sends st the work it does not have: a pending CertificateIssued,
// the OpenTunnel of each tunnel pending on it, the commands it claims and the DesiredState when the spec is newer than
// what the daemon has or was sent, each with its stored signature. It ends
// the session of a revoked node, and one whose certificate expired (after
// sending the answer to a renewal, which says so). Failures are logged; the
// periodic re-read retries.
func (s *Server) deliver(st *session) {
	ctx := st.ctx
	if ci := st.issued.Swap(nil); ci != nil {
		msg := &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_CertificateIssued{CertificateIssued: ci}}
		if err := st.send(msg); err != nil {
			s.log.Debug("send certificate", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
			return
		}
	}
	if err := st.expired(s.clk.Now()); err != nil {
		s.log.Warn("closing a session whose certificate expired", telemetry.KeyNodeID, st.nodeID,
			telemetry.KeySessionID, st.sessionID, telemetry.KeyError, err)
		st.abort(err)
		return
	}
	if !s.announceTunnels(st) {
		return
	}
	known := st.known()
	d, err := s.batch.claims.Do(ctx, store.ClaimRequest{NodeID: st.nodeID, SessionID: st.sessionID, Known: known, InFlight: st.inFlight})
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("read pending work", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
		}
		if st.inFlight {
			// The periodic re-read only looks for queued commands: let the
			// daemon reconnect so a new session resends the in-flight ones.
			st.abort(errPendingWork)
		}
		return
	}
	if d.Revoked {
		s.log.Warn("closing the session of a revoked node", telemetry.KeyNodeID, st.nodeID, telemetry.KeySessionID, st.sessionID)
		st.abort(errRevoked)
		return
	}
	if !d.Current {
		st.abort(errSuperseded)
		return
	}
	st.inFlight = false
	for _, c := range d.Commands {
		tp, end := startDelivery(c.Traceparent, c.ID, c.Kind, st.nodeID)
		msg := &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Command{Command: store.CommandMessage(c)},
			Traceparent: tp}
		err := st.send(msg)
		end(err)
		if err != nil {
			s.log.Debug("send command", telemetry.KeyNodeID, st.nodeID, telemetry.KeyCommandID, c.ID, telemetry.KeyError, err)
			return
		}
		s.log.Info("command delivered", telemetry.KeyNodeID, st.nodeID, telemetry.KeyCommandID, c.ID, "kind", c.Kind)
	}
	if d.Spec != nil && d.SpecGeneration > known {
		ds, err := store.DesiredStateMessage(d.SpecGeneration, d.Spec, d.SpecSignature)
		if err != nil {
			s.log.Error("node spec is not a NodeSpec", telemetry.KeyNodeID, st.nodeID, "spec_generation", d.SpecGeneration, telemetry.KeyError, err)
			return
		}
		msg := &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_DesiredState{DesiredState: ds}}
		if err := st.send(msg); err != nil {
			s.log.Debug("send desired state", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
			return
		}
		raise(&st.sent, d.SpecGeneration)
		s.log.Info("desired state sent", telemetry.KeyNodeID, st.nodeID, "spec_generation", d.SpecGeneration)
	}
}

// commandStates maps the states a daemon reports to commands.state.
var commandStates = map[gatewayv1.CommandState]string{
	gatewayv1.CommandState_COMMAND_STATE_DELIVERED: "delivered",
	gatewayv1.CommandState_COMMAND_STATE_RUNNING:   "running",
	gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED: "succeeded",
	gatewayv1.CommandState_COMMAND_STATE_FAILED:    "failed",
}

// errRecord ends a session whose update could not be stored: the daemon
// reconnects, the gateway redelivers the open commands and the daemon
// answers from its journal, so nothing is lost.
var errRecord = connect.NewError(connect.CodeUnavailable, errors.New("the gateway could not record the message; reconnect"))

// handle processes one daemon message after Hello. A returned error ends the
// session.
func (s *Server) handle(ctx context.Context, st *session, req *gatewayv1.SessionRequest) error {
	switch m := req.GetMsg().(type) {
	case *gatewayv1.SessionRequest_Heartbeat:
		raise(&st.reported, m.Heartbeat.GetObservedGeneration())
		s.ackHeartbeat(st, m.Heartbeat.GetSeq())
		s.metrics.heartbeats.Add(ctx, 1, s.metrics.gwAdd...)
		return nil
	case *gatewayv1.SessionRequest_CommandUpdate:
		return s.commandUpdate(ctx, st, m.CommandUpdate)
	case *gatewayv1.SessionRequest_Report:
		return s.report(ctx, st, m.Report)
	case *gatewayv1.SessionRequest_RenewCertificate:
		s.renew(st, m.RenewCertificate)
		return nil
	case *gatewayv1.SessionRequest_Hello:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("hello may only be the first message of a session"))
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("session message is empty"))
	}
}

// commandUpdate stores a command's new state, forward only, through the
// update batcher (store.ApplySessionCommandUpdates), and waits for it: the
// terminal update of a user command writes its event, and that of an
// acceptance check wakes the controllers, in the batch's transaction. A
// terminal update after the command's deadline records it expired.
func (s *Server) commandUpdate(ctx context.Context, st *session, u *gatewayv1.CommandUpdate) error {
	upd, err := decodeCommandUpdate(st.nodeID, u)
	if err != nil {
		return err
	}
	state := upd.State
	out, err := s.batch.updates.Do(ctx, upd)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("record command update", telemetry.KeyNodeID, st.nodeID, telemetry.KeyCommandID, u.GetCommandId(), telemetry.KeyError, err)
		}
		return errRecord
	}
	if !out.Applied {
		s.log.Debug("command update ignored: unknown command or not forward", telemetry.KeyNodeID, st.nodeID,
			telemetry.KeyCommandID, u.GetCommandId(), "state", state)
		return nil
	}
	if state == "failed" && strings.HasPrefix(upd.Error, refusedPrefix) {
		s.log.Warn("the daemon refused a command", telemetry.KeyNodeID, st.nodeID, telemetry.KeyCommandID, u.GetCommandId(),
			"reason", upd.Error)
	}
	if out.Terminal {
		s.metrics.commandFinished(ctx, out.Kind, out.State, s.clk.Now().Sub(out.CreatedAt))
	}
	// out.State is expired for a terminal report after the deadline.
	s.log.Info("command updated", telemetry.KeyNodeID, st.nodeID, telemetry.KeyCommandID, u.GetCommandId(),
		"state", out.State, "reported", state)
	return nil
}

// report stores what a daemon reports: observed_generation, AllocationBound
// (the reservation turns active, store.ActivateReservation), SpecRefused
// and SshRefused;
// AllocationUnbound is logged (the reservation ended before the spec dropped
// it). Nothing here, nor the end of a session, ends a reservation (I5).
func (s *Server) report(ctx context.Context, st *session, r *gatewayv1.Report) error {
	if err := decodeReport(r); err != nil {
		return err
	}
	switch m := r.GetReport().(type) {
	case *gatewayv1.Report_ObservedGeneration:
		gen := m.ObservedGeneration
		raise(&st.reported, gen)
		if _, err := s.batch.observed.Do(ctx, store.ObservedGeneration{NodeID: st.nodeID, Generation: gen}); err != nil {
			if ctx.Err() == nil {
				s.log.Error("record observed generation", telemetry.KeyNodeID, st.nodeID, telemetry.KeyError, err)
			}
			return errRecord
		}
		raise(&st.genWritten, gen)
		s.log.Info("observed generation", telemetry.KeyNodeID, st.nodeID, "observed_generation", gen)
	case *gatewayv1.Report_SpecRefused:
		return s.specRefused(ctx, st, m.SpecRefused)
	case *gatewayv1.Report_SshRefused:
		return s.sshRefused(ctx, st, m.SshRefused)
	case *gatewayv1.Report_AllocationBound:
		return s.allocationBound(ctx, st, m.AllocationBound)
	case *gatewayv1.Report_AllocationUnbound:
		s.log.Info("allocation unbound", telemetry.KeyNodeID, st.nodeID, telemetry.KeyReservationID, m.AllocationUnbound.GetReservationId(),
			"generation", m.AllocationUnbound.GetGeneration())
	default:
		s.log.Debug("report not recorded by this gateway", telemetry.KeyNodeID, st.nodeID, "report", fmt.Sprintf("%T", m))
	}
	return nil
}

// allocationBound records a daemon's AllocationBound: the reservation turns
// active with the CDI names in binding, when it is binding on this node and
// the report's generation carries it (store.ActivateReservations, batched
// with the other sessions' reports); a stale or foreign report changes
// nothing and is logged.
func (s *Server) allocationBound(ctx context.Context, st *session, b *gatewayv1.AllocationBound) error {
	b, err := decodeAllocationBound(b)
	if err != nil {
		return err
	}
	a, err := s.batch.activations.Do(ctx, store.AllocationBound{NodeID: st.nodeID, ReservationID: b.GetReservationId(),
		Binding: b.GetCdiDevices(), Generation: b.GetGeneration()})
	if err != nil {
		if ctx.Err() == nil {
			s.log.Error("record allocation bound", telemetry.KeyNodeID, st.nodeID, telemetry.KeyReservationID, b.GetReservationId(), telemetry.KeyError, err)
		}
		return errRecord
	}
	if !a.Found {
		s.log.Warn("allocation bound for an unknown reservation", telemetry.KeyNodeID, st.nodeID, telemetry.KeyReservationID, b.GetReservationId())
		return nil
	}
	if !a.Activated {
		s.log.Debug("allocation bound ignored", telemetry.KeyNodeID, st.nodeID, telemetry.KeyReservationID, b.GetReservationId(),
			"state", a.State, "generation", b.GetGeneration())
		return nil
	}
	s.metrics.activation.Record(ctx, s.clk.Now().Sub(a.CreatedAt).Seconds())
	s.log.Info("reservation active", telemetry.KeyNodeID, st.nodeID, telemetry.KeyReservationID, b.GetReservationId(),
		"binding", b.GetCdiDevices(), "generation", b.GetGeneration())
	return nil
}
