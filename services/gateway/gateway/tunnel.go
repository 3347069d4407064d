package gateway

// Tunnels (docs/architecture.md, "Tunnels"). The API opens
// GatewayControlService.Tunnel on the control server with an exec ticket;
// the gateway checks it, registers the tunnel as pending for the ticket's
// node and has the node's session deliver OpenTunnel; the daemon dials
// GatewayService.Tunnel with its node certificate, naming the tunnel, and
// the two streams are spliced. Each handler forwards the frames its own
// stream receives to the other stream (so a tunnel costs no goroutine of
// its own), and before it returns sends its stream the Close frame the
// gateway owes it, if any: when the other end went away without one, the
// node's session ended, or the gateway is shutting down.
//
// Locks: Server.mu guards the registry (tunnels, ofNode, tickets) and each
// tunnel's announced flag; tunnel.mu its state; tunnelEnd.mu each Send on a
// stream. Server.mu is never taken while holding a tunnel's mutex.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	ticket "github.com/better-compute/better-compute/pkg/tunnel"
)

// keyTunnelID is the slog key of a tunnel's id (its ticket's, "tkt_…").
const keyTunnelID = "tunnel.id"

// Reasons of the Close frames the gateway sends (Close.reason).
const (
	reasonShuttingDown = "gateway shutting down"
	reasonSessionEnded = "the node's session ended"
	reasonNodeClosed   = "node closed the tunnel"
	reasonNodeLost     = "the node's tunnel stream broke"
	reasonClientClosed = "the client closed the tunnel"
	reasonClientLost   = "the client's tunnel stream broke"
)

// tunnelOptions are the Connect options of both Tunnel handlers: messages
// bounded to one frame (service.ReadLimit of ticket.MaxMessageBytes),
// checked by protovalidate (frame sizes, terminal sizes, exit statuses,
// close reasons), and no compression, which tunnel bytes (SSH's are
// encrypted) do not repay.
func tunnelOptions() []connect.HandlerOption {
	return []connect.HandlerOption{
		service.ReadLimit(ticket.MaxMessageBytes),
		connect.WithInterceptors(service.Validation()...),
		connect.WithCompression("gzip", nil, nil),
	}
}

// tuneControl gives the control server's HTTP/2 connections a receive
// window per stream and one per connection that holds all of their streams
// (HTTPMaxStreams, 256 by default): the API carries many tunnels on one
// connection, and HTTP/2 returns a connection's flow-control credit only as
// handlers read, so a tunnel whose node stopped reading must not take the
// credit of the others.
func tuneControl(srv *http.Server) {
	const window = 128 << 10
	srv.HTTP2.MaxReceiveBufferPerStream = window
	srv.HTTP2.MaxReceiveBufferPerConnection = srv.HTTP2.MaxConcurrentStreams * window
}

// httpStream is the HTTP side of a control server stream, which a tunnel
// needs to end it from another goroutine.
type httpStream struct {
	w    http.ResponseWriter
	body io.Closer
}

type httpStreamKey struct{}

// streamMiddleware keeps each request's writer and body in its context for
// the control server's handlers.
func streamMiddleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := context.WithValue(r.Context(), httpStreamKey{}, &httpStream{w: w, body: r.Body})
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// tunnelEnd is one of a tunnel's two streams as the gateway writes to it:
// the other end's frames, forwarded by the other end's handler, then the
// Close the gateway may owe it, sent by its own handler as it returns.
type tunnelEnd struct {
	stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]
	http   httpStream

	mu     sync.Mutex // held by each Send
	closed bool       // its handler is returning: nothing more is sent
	final  bool       // a Close or Exit frame was sent: no Close is owed

	// amu guards aborting against the end of the handler, after which
	// its writer must not be touched.
	amu      sync.Mutex
	returned bool
}

// errTunnelEnded is what sending to a tunnel end whose handler returned
// fails with.
var errTunnelEnded = errors.New("tunnel ended")

// send sends f on e unless its handler is returning.
func (e *tunnelEnd) send(f *tunnelv1.Frame) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return errTunnelEnded
	}
	if err := e.stream.Send(f); err != nil {
		return err
	}
	switch f.GetFrame().(type) {
	case *tunnelv1.Frame_Close, *tunnelv1.Frame_Exit:
		e.final = true
	}
	return nil
}

// abort makes e's handler's Receive fail, and a Send on e that blocks (its
// peer stopped reading) fail after sendGrace. It does nothing once e's
// handler returned.
func (e *tunnelEnd) abort() {
	e.amu.Lock()
	defer e.amu.Unlock()
	if e.returned {
		return
	}
	_ = e.http.body.Close()
	_ = http.NewResponseController(e.http.w).SetWriteDeadline(transportClock.Now().Add(sendGrace))
}

// exit is the end of e's handler: it sends the Close owed ("" for none)
// unless e has had its last frame, and stops every later send.
func (e *tunnelEnd) exit(owed string) error {
	e.mu.Lock()
	var err error
	if owed != "" && !e.final {
		err = e.stream.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: owed}}})
		e.final = true
	}
	e.closed = true
	e.mu.Unlock()
	e.amu.Lock()
	e.returned = true
	e.amu.Unlock()
	return err
}

// tunnel is one tunnel through this gateway: pending from the API's start
// until the node's stream attaches, then open until either end or the
// gateway ends it.
type tunnel struct {
	id, nodeID, purpose, tenantID string
	size                          *tunnelv1.TerminalSize
	// st is the node's session that carries OpenTunnel; the tunnel ends
	// with it.
	st  *session
	api *tunnelEnd
	// announced is set once OpenTunnel was handed to a delivery of st
	// (Server.mu).
	announced bool

	attached chan struct{} // closed when the node's stream attached
	done     chan struct{} // closed when the tunnel ended

	mu            sync.Mutex
	node          *tunnelEnd // nil until attached
	ended         bool
	why           string // why it ended, for the log
	toAPI, toNode string // the reasons of the Close frames owed to each end
}

// owed returns the reason of the Close owed to the API's end (api) or the
// node's.
func (t *tunnel) owed(api bool) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if api {
		return t.toAPI
	}
	return t.toNode
}

// endTunnel ends t once: toAPI and toNode are the reasons of the Close
// frames owed to each end ("" for none), both handlers' Receives fail and
// their Sends are bounded, and t leaves the registry. With pendingOnly it
// ends t only while the node's stream has not attached. It reports whether
// this call ended t.
func (s *Server) endTunnel(t *tunnel, pendingOnly bool, why, toAPI, toNode string) bool {
	t.mu.Lock()
	if t.ended || (pendingOnly && t.node != nil) {
		t.mu.Unlock()
		return false
	}
	t.ended, t.why, t.toAPI, t.toNode = true, why, toAPI, toNode
	node := t.node
	close(t.done)
	t.mu.Unlock()
	t.api.abort()
	if node != nil {
		node.abort()
	}
	s.mu.Lock()
	delete(s.tunnels, t.id)
	if m := s.ofNode[t.nodeID]; m != nil {
		delete(m, t)
		if len(m) == 0 {
			delete(s.ofNode, t.nodeID)
		}
	}
	s.mu.Unlock()
	s.log.Info("tunnel closed", keyTunnelID, t.id, telemetry.KeyNodeID, t.nodeID, "attached", node != nil, "reason", why)
	return true
}

// trackTunnel counts a Tunnel handler in, unless the gateway is shutting
// down.
func (s *Server) trackTunnel() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.tunnelsClosing {
		return false
	}
	s.tunnelHandlers.Add(1)
	return true
}

// closeTunnels refuses new tunnels and ends every tunnel, saying "gateway
// shutting down" to both ends. It does not wait for the handlers (it is an
// OnShutdown of the servers).
func (s *Server) closeTunnels() {
	s.mu.Lock()
	s.tunnelsClosing = true
	all := make([]*tunnel, 0, len(s.tunnels))
	for _, t := range s.tunnels {
		all = append(all, t)
	}
	s.mu.Unlock()
	for _, t := range all {
		s.endTunnel(t, false, reasonShuttingDown, reasonShuttingDown, reasonShuttingDown)
	}
}

// endSessionTunnels ends the tunnels that st carried, saying why the
// session ended (err, what its handler returned) to both ends.
func (s *Server) endSessionTunnels(st *session, err error) {
	s.mu.Lock()
	var ts []*tunnel
	for t := range s.ofNode[st.nodeID] {
		if t.st == st {
			ts = append(ts, t)
		}
	}
	s.mu.Unlock()
	if len(ts) == 0 {
		return
	}
	st.abortMu.Lock()
	if st.abortErr != nil {
		err = st.abortErr
	}
	st.abortMu.Unlock()
	reason := reasonSessionEnded
	var ce *connect.Error
	if errors.As(err, &ce) {
		reason += ": " + ce.Message()
	}
	for _, t := range ts {
		s.endTunnel(t, false, reason, reason, reason)
	}
}

// unannounced returns the tunnels whose OpenTunnel st has yet to send, in
// the order they were opened, and marks them announced.
func (s *Server) unannounced(st *session) []*tunnel {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ts []*tunnel
	for t := range s.ofNode[st.nodeID] {
		if t.st == st && !t.announced {
			t.announced = true
			ts = append(ts, t)
		}
	}
	slices.SortFunc(ts, func(a, b *tunnel) int { return strings.Compare(a.id, b.id) })
	return ts
}

// announceTunnels sends st the OpenTunnel of each tunnel it has yet to
// announce (a delivery). It reports whether every send succeeded.
func (s *Server) announceTunnels(st *session) bool {
	for _, t := range s.unannounced(st) {
		msg := &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_OpenTunnel{OpenTunnel: &gatewayv1.OpenTunnel{
			TunnelId: t.id, Purpose: t.purpose, Size: t.size}}}
		if err := st.send(msg); err != nil {
			s.log.Debug("send open tunnel", telemetry.KeyNodeID, st.nodeID, keyTunnelID, t.id, telemetry.KeyError, err)
			return false
		}
		s.log.Info("open tunnel sent", telemetry.KeyNodeID, st.nodeID, keyTunnelID, t.id, "purpose", t.purpose)
	}
	return true
}

// pruneTickets forgets the tickets that expired by now: they verify no more.
func (s *Server) pruneTickets(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, exp := range s.tickets {
		if !now.Before(exp) {
			delete(s.tickets, id)
		}
	}
}

// controlService is GatewayControlService, on the control server.
type controlService struct{ s *Server }

// Tunnel implements bc.gateway.v1.GatewayControlService/Tunnel: the API's
// end of a tunnel. Refusals: InvalidArgument (no start first, or a start
// whose tunnel_id is not its ticket's), FailedPrecondition ("tunnels are not
// configured: …" without a ticket key; "node <id> has no live session on
// this gateway"), Unauthenticated ("tunnel ticket refused: …" for a forged,
// expired or malformed ticket; "ticket was used already"),
// ResourceExhausted (TunnelsPerNode), DeadlineExceeded ("node <id> did not
// open the tunnel"), Unavailable (shutting down). Once open, the stream ends
// without an error, after a Close frame when the gateway owes one.
func (c controlService) Tunnel(ctx context.Context, stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]) error {
	s := c.s
	hs, _ := ctx.Value(httpStreamKey{}).(*httpStream)
	if hs == nil {
		return connect.NewError(connect.CodeInternal, errors.New("tunnel stream without its HTTP request"))
	}
	start, done, err := s.beginTunnel(ctx, stream)
	if err != nil {
		return err
	}
	defer done()
	tk, err := s.checkTicket(start)
	if err != nil {
		s.log.WarnContext(ctx, "tunnel refused", keyTunnelID, start.GetTunnelId(), telemetry.KeyError, err)
		return err
	}
	t, err := s.addTunnel(tk, start.GetSize(), &tunnelEnd{stream: stream, http: *hs})
	if err != nil {
		s.log.WarnContext(ctx, "tunnel refused", keyTunnelID, tk.ID, telemetry.KeyNodeID, tk.NodeID, telemetry.KeyError, err)
		return err
	}
	s.log.InfoContext(ctx, "tunnel pending", keyTunnelID, t.id, telemetry.KeyNodeID, t.nodeID, "purpose", t.purpose,
		telemetry.KeyTenantID, t.tenantID)
	s.wake(t.st)

	attached, err := s.awaitNode(ctx, t)
	if err != nil {
		_ = t.api.exit("")
		return err
	}
	if attached {
		err = s.pump(t, stream, t.node, true)
	}
	if xerr := t.api.exit(t.owed(true)); xerr != nil {
		s.log.Debug("send tunnel close", keyTunnelID, t.id, telemetry.KeyError, xerr)
	}
	return err
}

// startErr is what a Tunnel handler returns when receiving its start
// failed with err.
func startErr(err error) error {
	if errors.Is(err, io.EOF) {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("the first message of a tunnel must be start"))
	}
	return err
}

// checkTicket checks the ticket of the API's start: signed with the
// tunnel-ticket key, unexpired, naming the tunnel of start.tunnel_id, and
// never seen by this gateway before (it is remembered until it expires).
func (s *Server) checkTicket(start *gatewayv1.TunnelStart) (ticket.Ticket, error) {
	if s.ticketKey == nil {
		return ticket.Ticket{}, connect.NewError(connect.CodeFailedPrecondition,
			fmt.Errorf("tunnels are not configured: %w", s.ticketErr))
	}
	tk, err := ticket.Verify(s.ticketKey, start.GetTicket(), s.clk.Now())
	if err != nil {
		return ticket.Ticket{}, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("tunnel ticket refused: %w", err))
	}
	if start.GetTunnelId() != tk.ID {
		return ticket.Ticket{}, connect.NewError(connect.CodeInvalidArgument,
			errors.New("start.tunnel_id is not the ticket's tunnel"))
	}
	s.mu.Lock()
	_, used := s.tickets[tk.ID]
	if !used {
		s.tickets[tk.ID] = tk.ExpiresAt
	}
	s.mu.Unlock()
	if used {
		return ticket.Ticket{}, connect.NewError(connect.CodeUnauthenticated, store.ErrTicketUsed)
	}
	return tk, nil
}

// addTunnel registers the pending tunnel of ticket tk, whose API end is
// api, on the live session of its node.
func (s *Server) addTunnel(tk ticket.Ticket, size *tunnelv1.TerminalSize, api *tunnelEnd) (*tunnel, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.tunnelsClosing {
		return nil, errShuttingDown
	}
	st := s.byNode[tk.NodeID]
	if st == nil || st.state.Load()&stClosed != 0 {
		return nil, connect.NewError(connect.CodeFailedPrecondition,
			fmt.Errorf("node %s has no live session on this gateway", tk.NodeID))
	}
	if n := len(s.ofNode[tk.NodeID]); n >= s.cfg.TunnelsPerNode {
		return nil, connect.NewError(connect.CodeResourceExhausted,
			fmt.Errorf("node %s has %d tunnels through this gateway, the most allowed", tk.NodeID, n))
	}
	if s.tunnels[tk.ID] != nil {
		// The ticket check makes ids unique; this is a second line.
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("tunnel %s is open already", tk.ID))
	}
	t := &tunnel{id: tk.ID, nodeID: tk.NodeID, purpose: tk.Purpose, tenantID: tk.TenantID, size: size, st: st, api: api,
		attached: make(chan struct{}), done: make(chan struct{})}
	s.tunnels[t.id] = t
	m := s.ofNode[t.nodeID]
	if m == nil {
		m = make(map[*tunnel]struct{})
		s.ofNode[t.nodeID] = m
	}
	m[t] = struct{}{}
	return t, nil
}

// awaitNode waits for t's node to attach its stream. It reports false,
// with no error, when t ended meanwhile (the gateway's Close is owed to the
// API), and fails with DeadlineExceeded after TunnelOpenTimeout.
func (s *Server) awaitNode(ctx context.Context, t *tunnel) (bool, error) {
	timer := s.clk.NewTimer(s.cfg.TunnelOpenTimeout)
	defer timer.Stop()
	select {
	case <-t.attached:
		return true, nil
	case <-t.done:
		return false, nil
	case <-ctx.Done():
		s.endTunnel(t, false, "the client left before the node dialed back", "", "")
		return false, nil
	case <-timer.C():
		err := connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("node %s did not open the tunnel", t.nodeID))
		if s.endTunnel(t, true, err.Message(), "", "") {
			return false, err
		}
		// The node attached at the deadline, or t ended.
		select {
		case <-t.done:
			return false, nil
		default:
			return true, nil
		}
	}
}

// Tunnel implements bc.gateway.v1.GatewayService/Tunnel: the node's end of
// a tunnel, authenticated by its node certificate as a Session is. Its
// start names a tunnel pending for the certificate's node on this gateway.
// Refusals: Unauthenticated (the certificate, as at Hello),
// InvalidArgument (no start first), NotFound ("tunnel <id> is not pending
// on this gateway"), PermissionDenied ("tunnel <id> is another node's"),
// AlreadyExists ("tunnel <id> is open already"). Once open, the stream ends
// without an error, after a Close frame when the gateway owes one.
func (s *Server) Tunnel(ctx context.Context, stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]) error {
	peer := sessionFrom(ctx)
	if peer == nil {
		return connect.NewError(connect.CodeUnauthenticated, errors.New("the tunnel needs a client certificate over TLS"))
	}
	start, done, err := s.beginTunnel(ctx, stream)
	if err != nil {
		return err
	}
	defer done()
	if err := s.checkPeer(ctx, peer); err != nil {
		s.log.WarnContext(ctx, "node tunnel refused", keyTunnelID, start.GetTunnelId(), "cert_node_id", peer.certID,
			"cert_serial", peer.serial, telemetry.KeyError, err)
		return err
	}
	node := &tunnelEnd{stream: stream, http: httpStream{w: peer.w, body: peer.body}}
	t, err := s.attach(peer.certID, start.GetTunnelId(), node)
	if err != nil {
		s.log.WarnContext(ctx, "node tunnel refused", keyTunnelID, start.GetTunnelId(), telemetry.KeyNodeID, peer.certID,
			telemetry.KeyError, err)
		return err
	}
	s.log.InfoContext(ctx, "tunnel open", keyTunnelID, t.id, telemetry.KeyNodeID, t.nodeID)
	err = s.pump(t, stream, t.api, false)
	if xerr := node.exit(t.owed(false)); xerr != nil {
		s.log.Debug("send tunnel close", keyTunnelID, t.id, telemetry.KeyError, xerr)
	}
	return err
}

// checkPeer refuses a client certificate that may not open a session (as
// at Hello): none of a node, unknown, revoked or expired.
func (s *Server) checkPeer(ctx context.Context, peer *session) error {
	if peer.certErr != nil {
		return errNoNodeCert
	}
	cert, err := store.GetSessionCert(ctx, s.db.Pool, peer.serial)
	refusal, err := certRefusal(peer, cert, err, s.db.Now())
	if err != nil {
		if ctx.Err() == nil {
			s.log.ErrorContext(ctx, "check tunnel certificate", telemetry.KeyNodeID, peer.certID, telemetry.KeyError, err)
		}
		return connect.NewError(connect.CodeUnavailable, errors.New("the gateway could not check the client certificate; retry"))
	}
	return refusal
}

// attach makes node the node's end of tunnel id, which must be pending
// for nodeID.
func (s *Server) attach(nodeID, id string, node *tunnelEnd) (*tunnel, error) {
	s.mu.Lock()
	t := s.tunnels[id]
	s.mu.Unlock()
	notPending := connect.NewError(connect.CodeNotFound, fmt.Errorf("tunnel %s is not pending on this gateway", id))
	switch {
	case t == nil:
		return nil, notPending
	case t.nodeID != nodeID:
		return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("tunnel %s is another node's", id))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.ended:
		return nil, notPending
	case t.node != nil:
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("tunnel %s is open already", id))
	}
	t.node = node
	close(t.attached)
	return t, nil
}

// pump forwards the frames that stream (the API's end when fromAPI, else
// the node's) receives to the other end, to, until either ends or t ends,
// and then ends t. A Close frame ends t once forwarded; a stream that ends
// without one, or fails, has the gateway owe the other end a Close saying
// so. It returns the error to end stream's handler with: the Receive error
// that ended t (an invalid or oversized frame), else nil.
func (s *Server) pump(t *tunnel, stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame], to *tunnelEnd, fromAPI bool) error {
	closed, lost, otherLost, by := reasonNodeClosed, reasonNodeLost, reasonClientLost, "the node"
	if fromAPI {
		closed, lost, otherLost, by = reasonClientClosed, reasonClientLost, reasonNodeLost, "the client"
	}
	// end ends t owing a Close with reason to the other end, or with
	// toThis to this one.
	end := func(reason string, toThis bool) bool {
		if fromAPI == toThis {
			return s.endTunnel(t, false, reason, reason, "")
		}
		return s.endTunnel(t, false, reason, "", reason)
	}
	for {
		req, err := stream.Receive()
		switch {
		case errors.Is(err, io.EOF):
			end(closed, false)
			return nil
		case err != nil:
			if end(lost, false) {
				return err
			}
			return nil // t ended first, which aborted the Receive
		}
		f := req.GetFrame()
		if f == nil {
			end(lost, false)
			return connect.NewError(connect.CodeInvalidArgument, errors.New("start may only be the first message of a tunnel"))
		}
		if err := to.send(f); err != nil {
			if !errors.Is(err, errTunnelEnded) {
				end(otherLost, true)
			}
			return nil
		}
		if c := f.GetClose(); c != nil {
			s.endTunnel(t, false, "closed by "+by+": "+c.GetReason(), "", "")
			return nil
		}
	}
}

// beginTunnel is the prologue of both Tunnel handlers (the API's end on the
// control listener, the node's on the session listener): it counts the
// handler in (trackTunnel), reads the stream's start (receiveStart) and
// then exempts the stream from its server's request timeout
// (service.LongLived): the start came within it, and the tunnel is bounded
// by TunnelOpenTimeout, its session and its ends instead. The handler calls
// done when it returns, which counts it out. Errors (the handler returns
// them, without calling done): errShuttingDown (Unavailable), and
// receiveStart's.
func (s *Server) beginTunnel(ctx context.Context, stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]) (
	start *gatewayv1.TunnelStart, done func(), err error,
) {
	if !s.trackTunnel() {
		return nil, nil, errShuttingDown
	}
	if start, err = receiveStart(stream); err != nil {
		s.tunnelHandlers.Done()
		return nil, nil, err
	}
	service.LongLived(ctx)
	return start, s.tunnelHandlers.Done, nil
}

// receiveStart reads a tunnel stream's first message, which must be start.
func receiveStart(stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]) (*gatewayv1.TunnelStart, error) {
	req, err := stream.Receive()
	if err != nil {
		return nil, startErr(err)
	}
	start := req.GetStart()
	if start == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("the first message of a tunnel must be start"))
	}
	return start, nil
}
