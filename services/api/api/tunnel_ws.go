package api

// The tunnels' client end (docs/architecture.md, "Tunnels"): GET
// TunnelsPath{ticket} as a WebSocket, relayed to GatewayControlService.Tunnel
// on the gateway holding the node's session, authorized again while open.

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"buf.build/go/protovalidate"
	"connectrpc.com/connect"
	"github.com/coder/websocket"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// TunnelSubprotocol is the WebSocket subprotocol of tunnels: the API
// selects it when the client offers it (offering none works the same).
const TunnelSubprotocol = "bc.tunnel.v1"

// Bounds of a tunnel.
const (
	// maxCloseReason is the most a Close frame's reason holds (bytes;
	// tunnelv1.Close).
	maxCloseReason = 1024
	// maxWSCloseReason is the most a WebSocket close message's reason
	// holds (bytes; RFC 6455 section 5.5).
	maxWSCloseReason = 123
	// tunnelRetryAfter is the Retry-After of a tunnel refused by a limit.
	tunnelRetryAfter = 5 * time.Second
	// tunnelWriteTimeout bounds one write to the client: a client that
	// reads nothing for this long is gone.
	tunnelWriteTimeout = 30 * time.Second
	// gatewayDrain is how long a tunnel that ended waits for the gateway
	// to end its stream after it closed its side, before it cancels it.
	gatewayDrain = 2 * time.Second
	// closeRecordTimeout bounds writing a tunnel's close.
	closeRecordTimeout = 5 * time.Second
	// keyTunnelID is the slog key of a tunnel's id (its ticket's).
	keyTunnelID = "tunnel.id"
)

// TunnelConfig tunes the tunnels (docs/architecture.md, "Tunnels";
// tunnel_ws.go).
type TunnelConfig struct {
	// LimitPerNode is how many tunnels may be open to one node at once,
	// counted over every API replica (store.ConsumeTunnelTicket); one more
	// is refused with 429.
	LimitPerNode int `env:"TUNNEL_LIMIT_PER_NODE,positive" default:"16"`
	// LimitPerToken is how many tunnels one API token may hold open at
	// once, counted like LimitPerNode.
	LimitPerToken int `env:"TUNNEL_LIMIT_PER_TOKEN,positive" default:"8"`
	// ReauthInterval is how often an open tunnel is authorized again (its
	// token valid, its role enough, its node adopted and not revoked, a
	// sandbox's reservation active) and closed with the reason when that
	// fails; a token revoked through any API replica is checked at once.
	// Below 2 min (store.TunnelStale), else the API does not start.
	ReauthInterval time.Duration `env:"TUNNEL_REAUTH_INTERVAL,positive" default:"60s"`
	// IdleTimeout closes a tunnel through which no frame passed, either
	// way, for this long.
	IdleTimeout time.Duration `env:"TUNNEL_IDLE_TIMEOUT,positive" default:"30m"`
}

// check refuses settings the tunnels cannot run with.
func (c TunnelConfig) check() error {
	switch {
	case c.LimitPerNode <= 0 || c.LimitPerToken <= 0:
		return errors.New("tunnel limits must be positive")
	case c.ReauthInterval <= 0 || c.ReauthInterval >= store.TunnelStale:
		return fmt.Errorf("the tunnel re-authorization interval must be positive and below %s (store.TunnelStale), got %s",
			store.TunnelStale, c.ReauthInterval)
	case c.IdleTimeout <= 0:
		return errors.New("the tunnel idle timeout must be positive")
	}
	return nil
}

// newGatewayClient returns the HTTP client of the gateways' control
// listeners: HTTP/2 only (bidirectional streams need it), cleartext (h2c)
// for http:// URLs, TLS verified with tlsConfig for https:// ones; pings
// find a dead gateway within about 30 s.
func newGatewayClient(tlsConfig *tls.Config) *http.Client {
	var protocols http.Protocols
	protocols.SetHTTP2(true)
	protocols.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{
		Protocols:           &protocols,
		TLSClientConfig:     tlsConfig.Clone(),
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: 5 * time.Second,
		HTTP2:               &http.HTTP2Config{SendPingTimeout: 15 * time.Second, PingTimeout: 15 * time.Second},
	}}
}

// tunnelRefusal is why a tunnel may not open, or stay open: the HTTP
// status and Connect code of the refusal before the WebSocket, and the
// message (the Close reason after it).
type tunnelRefusal struct {
	status int
	code   connect.Code
	msg    string
}

func (r *tunnelRefusal) write(w http.ResponseWriter) {
	if r.status == http.StatusTooManyRequests {
		w.Header().Set("Retry-After", strconv.Itoa(int(tunnelRetryAfter/time.Second)))
	}
	writeHTTPError(w, r.status, r.code, r.msg)
}

func refuse(status int, code connect.Code, msg string) *tunnelRefusal {
	return &tunnelRefusal{status: status, code: code, msg: msg}
}

// serveTunnel serves GET TunnelsPath{ticket}: it opens the tunnel the exec
// ticket grants, as a WebSocket, and relays it to the gateway holding the
// node's session. Query: node (optional: the node the client means; a
// ticket for another is refused), rows and cols (optional, together: the
// terminal's size at the start).
//
// Before the WebSocket, refusals are JSON {"code", "message"}: 404 (the API
// has no PKI directory), 400 (a query parameter, named; not a WebSocket
// request), 401 (the ticket is forged, malformed, expired, unknown, used
// already or for another node; the token was revoked or expired), 429 with
// Retry-After (a limit of open tunnels; the ticket stays unused), 403 (the
// token's role no longer reaches the node), 409 (the node is revoked or not
// adopted, the reservation is no longer active, or the node has no live
// session), 503 (shutting down; the database unreachable), 500. A ticket
// refused after it was consumed is spent (its tunnel is recorded closed
// with the reason).
//
// Then each binary WebSocket message is one bc.tunnel.v1.Frame in protobuf
// form, both ways, and the tunnel ends with a Close frame saying why (the
// node's or the client's close, the gateway's error, a failed
// re-authorization, the idle timeout, the API's shutdown), followed by a
// WebSocket close (1000; 1001 at shutdown; 1003 or 1007 after a message
// that is not a valid frame).
func (s *Server) serveTunnel(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	keys := s.keys
	if keys == nil {
		writeHTTPError(w, http.StatusNotFound, connect.CodeFailedPrecondition, errTunnelsOff.Error())
		return
	}
	q := r.URL.Query()
	size, refusal := parseTerminalSize(q.Get("rows"), q.Get("cols"))
	if refusal != nil {
		refusal.write(w)
		return
	}
	if !strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
		writeHTTPError(w, http.StatusBadRequest, connect.CodeInvalidArgument,
			"a tunnel is a WebSocket: GET with Upgrade: websocket (each binary message one bc.tunnel.v1.Frame)")
		return
	}
	t, err := tunnel.Verify(keys.ticketPub, r.PathValue("ticket"), s.db.Now())
	if err != nil {
		writeHTTPError(w, http.StatusUnauthorized, connect.CodeUnauthenticated, err.Error())
		return
	}
	if node := q.Get("node"); node != "" && node != t.NodeID {
		writeHTTPError(w, http.StatusUnauthorized, connect.CodeUnauthenticated, "ticket is for another node")
		return
	}
	if s.stopping() {
		writeHTTPError(w, http.StatusServiceUnavailable, connect.CodeUnavailable, "API shutting down")
		return
	}
	var row store.TunnelTicket
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		row, err = store.ConsumeTunnelTicket(ctx, tx, t.ID, s.db.Now(),
			store.TunnelLimits{PerNode: s.cfg.Tunnels.LimitPerNode, PerToken: s.cfg.Tunnels.LimitPerToken})
		return err
	})
	var limit *store.TunnelLimitError
	switch {
	case errors.Is(err, store.ErrNotFound):
		writeHTTPError(w, http.StatusUnauthorized, connect.CodeUnauthenticated, "ticket is not known")
		return
	case errors.Is(err, store.ErrTicketUsed), errors.Is(err, store.ErrTicketExpired):
		writeHTTPError(w, http.StatusUnauthorized, connect.CodeUnauthenticated, err.Error())
		return
	case errors.As(err, &limit):
		refuse(http.StatusTooManyRequests, connect.CodeResourceExhausted, limit.Error()).write(w)
		return
	case err != nil:
		s.writeStreamError(w, r, "tunnel", false, err)
		return
	}
	// From here the row is an open tunnel: a refusal closes it.
	log := s.logger.With(keyTunnelID, row.ID, telemetry.KeyNodeID, row.NodeID, "api_token.id", row.TokenID)
	if row.NodeID != t.NodeID || row.TokenID != t.TokenID || row.TenantID != t.TenantID || row.Purpose != t.Purpose ||
		row.ReservationID != t.ReservationID {
		s.recordClose(ctx, log, row.ID, "ticket does not match its record")
		writeHTTPError(w, http.StatusUnauthorized, connect.CodeUnauthenticated, "ticket does not match its record")
		return
	}
	grant, refusal, err := s.authorizeTunnel(ctx, row)
	if err == nil && refusal == nil {
		grant.route, refusal, err = s.routeTunnel(ctx, row.NodeID)
	}
	if err != nil {
		s.recordClose(ctx, log, row.ID, "the API failed to authorize the tunnel")
		s.writeStreamError(w, r, "tunnel", false, err)
		return
	}
	if refusal != nil {
		s.recordClose(ctx, log, row.ID, refusal.msg)
		refusal.write(w)
		return
	}
	// The upgrade takes the connection from the server, which lifts its
	// request deadlines (net/http's Hijack); the tunnel bounds itself
	// (tunnelWriteTimeout, IdleTimeout).
	ws, err := websocket.Accept(w, r, &websocket.AcceptOptions{Subprotocols: []string{TunnelSubprotocol}})
	if err != nil { // Accept answered the client
		s.recordClose(ctx, log, row.ID, "the WebSocket upgrade failed")
		log.InfoContext(ctx, "tunnel: websocket upgrade failed", telemetry.KeyError, err)
		return
	}
	ws.SetReadLimit(tunnel.MaxMessageBytes)
	ot := &openTunnel{s: s, row: row, ticket: r.PathValue("ticket"), size: size, grant: grant, ws: ws, log: log,
		recheck: make(chan struct{}, 1), ended: make(chan struct{}), gwDone: make(chan struct{}),
		clientDone: make(chan struct{})}
	if !s.tunnels.add(ot) {
		ot.endWith(endByServer, "API shutting down", websocket.StatusGoingAway)
		ot.finish(ctx)
		return
	}
	defer s.tunnels.remove(ot)
	ot.run(ctx)
}

// parseTerminalSize reads the rows and cols query parameters: both or
// neither (nil).
func parseTerminalSize(rows, cols string) (*tunnelv1.TerminalSize, *tunnelRefusal) {
	if rows == "" && cols == "" {
		return nil, nil
	}
	if rows == "" || cols == "" {
		return nil, refuse(http.StatusBadRequest, connect.CodeInvalidArgument, "rows and cols: give both or neither")
	}
	size := &tunnelv1.TerminalSize{}
	for _, p := range []struct {
		name, value string
		dst         *uint32
	}{{"rows", rows, &size.Rows}, {"cols", cols, &size.Cols}} {
		n, err := strconv.ParseUint(p.value, 10, 32)
		if err != nil || n < 1 || n > 10000 {
			return nil, refuse(http.StatusBadRequest, connect.CodeInvalidArgument, p.name+": want a whole number from 1 to 10000")
		}
		*p.dst = uint32(n)
	}
	return size, nil
}

// tunnelGrant is what authorized an open tunnel.
type tunnelGrant struct {
	// tokenExpires is when the tunnel's token expires; nil never.
	tokenExpires *time.Time
	// route is where the tunnel goes (set at open).
	route store.TunnelRoute
}

// authorizeTunnel authorizes the tunnel of row now, from the database
// alone (no cached principal): its token exists in the ticket's tenant and
// is neither revoked nor expired (401), and checkAccess lets its role reach
// the node, and the reservation for a sandbox (403 for the role or a node
// or reservation out of reach, 409 for their state). Other errors are the
// database's.
func (s *Server) authorizeTunnel(ctx context.Context, row store.TunnelTicket) (tunnelGrant, *tunnelRefusal, error) {
	now := s.db.Now()
	tok, err := store.GetAPIToken(ctx, s.db.Pool, store.TenantScope(row.TenantID), row.TokenID)
	switch {
	case errors.Is(err, store.ErrNotFound):
		return tunnelGrant{}, refuse(http.StatusUnauthorized, connect.CodeUnauthenticated, "api token is not valid"), nil
	case err != nil:
		return tunnelGrant{}, nil, err
	case tok.RevokedAt != nil:
		return tunnelGrant{}, refuse(http.StatusUnauthorized, connect.CodeUnauthenticated, "api token was revoked"), nil
	case tok.ExpiresAt != nil && !tok.ExpiresAt.After(now):
		return tunnelGrant{}, refuse(http.StatusUnauthorized, connect.CodeUnauthenticated,
			"api token expired at "+tok.ExpiresAt.UTC().Format(time.RFC3339)), nil
	}
	p := iam.Principal{TokenID: tok.ID, TenantID: tok.TenantID, Role: iam.Role(tok.Role), ExpiresAt: tok.ExpiresAt}
	_, err = checkAccess(ctx, s.db.Pool, p, row.NodeID, row.ReservationID, now)
	var ae *accessError
	switch {
	case errors.As(err, &ae) && ae.code == connect.CodeFailedPrecondition:
		return tunnelGrant{}, refuse(http.StatusConflict, connect.CodeFailedPrecondition, ae.tunnelMsg), nil
	case errors.As(err, &ae):
		return tunnelGrant{}, refuse(http.StatusForbidden, connect.CodePermissionDenied, ae.tunnelMsg), nil
	case err != nil:
		return tunnelGrant{}, nil, err
	}
	return tunnelGrant{tokenExpires: tok.ExpiresAt}, nil, nil
}

// routeTunnel finds the gateway of node id's live session: 409 "node has
// no live session" when it has none, or its gateway is not present or has
// no control URL.
func (s *Server) routeTunnel(ctx context.Context, id string) (store.TunnelRoute, *tunnelRefusal, error) {
	route, err := store.NodeTunnelRoute(ctx, s.db.Pool, id, s.db.Now())
	if err != nil {
		return route, nil, err
	}
	noSession := func(why string) *tunnelRefusal {
		return refuse(http.StatusConflict, connect.CodeFailedPrecondition, "node has no live session"+why)
	}
	switch {
	case route.GatewayID == "":
		return route, noSession(""), nil
	case !route.Present:
		return route, noSession(" (its gateway " + route.GatewayID + " is not present)"), nil
	case route.ControlURL == "":
		return route, noSession(" (its gateway " + route.GatewayID + " has no control URL)"), nil
	}
	return route, nil, nil
}

// recordClose records that tunnel id closed with reason (store.CloseTunnel),
// even when ctx has ended.
func (s *Server) recordClose(ctx context.Context, log *slog.Logger, id, reason string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeRecordTimeout)
	defer cancel()
	if err := store.CloseTunnel(ctx, s.db.Pool, id, s.db.Now(), reason); err != nil {
		log.WarnContext(ctx, "tunnel: record its close", "reason", reason, telemetry.KeyError, err)
	}
}

// endSide is who ended a tunnel.
type endSide int

const (
	// endByClient: the client closed it (a Close frame, a WebSocket close)
	// or went away.
	endByClient endSide = iota
	// endByGateway: the gateway's stream ended (the node's Close frame, an
	// error).
	endByGateway
	// endByServer: the API ended it (re-authorization, idle, shutdown, a
	// bad frame).
	endByServer
)

// tunnelEnd is why a tunnel ended.
type tunnelEnd struct {
	by     endSide
	reason string
	status websocket.StatusCode
	// clientKnows and gatewayKnows: that end has the Close frame already
	// (it sent it, or it was forwarded to it).
	clientKnows, gatewayKnows bool
}

// openTunnel is one tunnel being relayed. Three goroutines run it: run
// (the handler's: re-authorization, idle timeout, shutdown, then finish),
// fromClient and fromGateway. Sends to the gateway are serialized by gwMu,
// writes to the client by wsMu; the first end (endWith) wins.
type openTunnel struct {
	s      *Server
	row    store.TunnelTicket
	ticket string
	size   *tunnelv1.TerminalSize
	grant  tunnelGrant
	ws     *websocket.Conn
	log    *slog.Logger

	gw       *connect.BidiStreamForClient[gatewayv1.TunnelRequest, tunnelv1.Frame]
	cancelGW context.CancelFunc

	// recheck asks run to authorize the tunnel again now.
	recheck chan struct{}
	// lastActive is when a frame last passed (UnixNano, the server's clock).
	lastActive atomic.Int64

	gwMu     sync.Mutex
	gwClosed bool
	wsMu     sync.Mutex
	wsClosed bool

	endOnce sync.Once
	// clientClosing is set once the client's Close frame is on its way to
	// the gateway: the gateway's stream ending after it is that close's
	// consequence, and the end is the client's.
	clientClosing atomic.Bool
	end           tunnelEnd
	// ended is closed once end is set; gwDone and clientDone when
	// fromGateway and fromClient return.
	ended, gwDone, clientDone chan struct{}
}

// endWith ends the tunnel (the first call only) with reason and WebSocket
// status; knows marks the ends that have the Close frame already.
func (t *openTunnel) endWith(by endSide, reason string, status websocket.StatusCode, knows ...endSide) {
	t.endOnce.Do(func() {
		t.end = tunnelEnd{by: by, reason: cleanReason(reason, maxCloseReason), status: status}
		for _, k := range knows {
			switch k {
			case endByClient:
				t.end.clientKnows = true
			case endByGateway:
				t.end.gatewayKnows = true
			}
		}
		close(t.ended)
	})
}

func (t *openTunnel) touch() { t.lastActive.Store(t.s.clock.Now().UnixNano()) }

// run relays the tunnel until it ends, then finishes it.
func (t *openTunnel) run(ctx context.Context) {
	t.touch()
	t.log.InfoContext(ctx, "tunnel opened", "purpose", t.row.Purpose, telemetry.KeyReservationID, t.row.ReservationID,
		telemetry.KeyGatewayID, t.grant.route.GatewayID)
	gwCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	t.cancelGW = cancel
	client := gatewayv1connect.NewGatewayControlServiceClient(t.s.gatewayClient, t.grant.route.ControlURL,
		append(service.ClientOptions(t.s.deps.Metrics), connect.WithReadMaxBytes(tunnel.MaxMessageBytes))...)
	t.gw = client.Tunnel(gwCtx)
	err := t.toGateway(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Start{Start: &gatewayv1.TunnelStart{
		TunnelId: t.row.ID, Ticket: t.ticket, Size: t.size}}})
	if err != nil && !errors.Is(err, io.EOF) { // EOF: Receive has the gateway's error
		t.endWith(endByGateway, t.gatewayReason(err), websocket.StatusNormalClosure)
	}
	go t.fromGateway()
	go t.fromClient()
	t.supervise(ctx)
	t.finish(ctx)
}

// supervise waits for the tunnel's end, authorizing it again every
// ReauthInterval, at its token's expiry and when asked (recheck), closing it
// after IdleTimeout without a frame and at shutdown.
func (t *openTunnel) supervise(ctx context.Context) {
	cfg, clk := t.s.cfg.Tunnels, t.s.clock
	reauth := clk.NewTicker(cfg.ReauthInterval)
	defer reauth.Stop()
	idle := clk.NewTimer(cfg.IdleTimeout)
	defer idle.Stop()
	var expiry <-chan time.Time
	if exp := t.grant.tokenExpires; exp != nil {
		timer := clk.NewTimer(max(0, exp.Sub(clk.Now())))
		defer timer.Stop()
		expiry = timer.C()
	}
	for {
		select {
		case <-t.ended:
			return
		case <-t.s.stopWatches:
			t.endWith(endByServer, "API shutting down", websocket.StatusGoingAway)
		case <-reauth.C():
			t.reauthorize(ctx)
		case <-t.recheck:
			t.reauthorize(ctx)
		case <-expiry:
			expiry = nil
			t.reauthorize(ctx)
		case <-idle.C():
			quiet := clock.Since(clk, time.Unix(0, t.lastActive.Load()))
			if quiet >= cfg.IdleTimeout {
				t.endWith(endByServer, "idle for "+cfg.IdleTimeout.String(), websocket.StatusNormalClosure)
				continue
			}
			idle.Reset(cfg.IdleTimeout - quiet)
		}
	}
}

// reauthorize authorizes the tunnel again (authorizeTunnel): a refusal
// ends it with its message; a database error is logged and leaves it open
// until the next check.
func (t *openTunnel) reauthorize(ctx context.Context) {
	_, refusal, err := t.s.authorizeTunnel(ctx, t.row)
	switch {
	case err != nil:
		t.log.WarnContext(ctx, "tunnel: authorize again; retrying at the next check", telemetry.KeyError, err)
	case refusal != nil:
		t.endWith(endByServer, refusal.msg, websocket.StatusNormalClosure)
	default:
		if err := store.TouchTunnel(ctx, t.s.db.Pool, t.row.ID, t.s.db.Now()); err != nil {
			t.log.WarnContext(ctx, "tunnel: record its authorization", telemetry.KeyError, err)
		}
	}
}

// fromClient relays the client's frames to the gateway until the client
// closes or sends what is not a valid frame.
func (t *openTunnel) fromClient() {
	defer close(t.clientDone)
	for {
		// Reading ends when the WebSocket closes (finish closes it).
		typ, b, err := t.ws.Read(context.Background())
		if err != nil {
			switch websocket.CloseStatus(err) {
			case websocket.StatusNormalClosure, websocket.StatusGoingAway:
				t.endWith(endByClient, "the client closed the tunnel", websocket.StatusNormalClosure, endByClient)
			default:
				t.endWith(endByClient, "the client went away", websocket.StatusNormalClosure, endByClient)
			}
			return
		}
		if typ != websocket.MessageBinary {
			t.endWith(endByServer, "a tunnel's messages are binary, each one protobuf bc.tunnel.v1.Frame; got a text message",
				websocket.StatusUnsupportedData)
			return
		}
		f := &tunnelv1.Frame{}
		if err := proto.Unmarshal(b, f); err != nil {
			t.endWith(endByServer, "a message is not a bc.tunnel.v1.Frame", websocket.StatusInvalidFramePayloadData)
			return
		}
		if err := protovalidate.Validate(f); err != nil {
			t.endWith(endByServer, "invalid frame: "+service.ViolationsText(err), websocket.StatusInvalidFramePayloadData)
			return
		}
		t.touch()
		switch x := f.Frame.(type) {
		case *tunnelv1.Frame_Exit:
			t.endWith(endByServer, "a client sends no exit frame (the node does)", websocket.StatusInvalidFramePayloadData)
			return
		case *tunnelv1.Frame_Close:
			t.clientClosing.Store(true)
			_ = t.toGateway(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: f}}) // its end is the gateway's
			reason := "closed by the client"
			if r := x.Close.GetReason(); r != "" {
				reason += ": " + r
			}
			t.endWith(endByClient, reason, websocket.StatusNormalClosure, endByClient, endByGateway)
			return
		}
		// A failed send ends the gateway's stream: fromGateway reports it.
		_ = t.toGateway(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: f}})
	}
}

// fromGateway relays the gateway's frames to the client until the
// gateway's stream ends.
func (t *openTunnel) fromGateway() {
	defer close(t.gwDone)
	for {
		f, err := t.gw.Receive()
		if err != nil && t.clientClosing.Load() {
			return // fromClient ends the tunnel as the client's close
		}
		if errors.Is(err, io.EOF) {
			t.endWith(endByGateway, "the tunnel ended", websocket.StatusNormalClosure, endByGateway)
			return
		}
		if err != nil {
			t.endWith(endByGateway, t.gatewayReason(err), websocket.StatusNormalClosure, endByGateway)
			return
		}
		t.touch()
		if err := t.toClient(f); err != nil {
			t.endWith(endByClient, "the client went away", websocket.StatusNormalClosure, endByClient)
			continue // drain until finish cancels the stream
		}
		if c, ok := f.Frame.(*tunnelv1.Frame_Close); ok {
			reason := c.Close.GetReason()
			if reason == "" {
				reason = "closed by the node"
			}
			t.endWith(endByGateway, reason, websocket.StatusNormalClosure, endByGateway, endByClient)
		}
	}
}

// gatewayReason says why the gateway's stream ended with err, in words
// for the client: the gateway's own answer with its message, or, when it
// could not be reached or the stream broke, that it is gone (the error,
// which may name internal addresses, is logged only).
func (t *openTunnel) gatewayReason(err error) string {
	var cerr *connect.Error
	if errors.As(err, &cerr) && connect.IsWireError(cerr) {
		msg := cerr.Message()
		switch cerr.Code() {
		case connect.CodeUnavailable:
			return "the node's gateway is gone: " + msg
		case connect.CodeUnauthenticated:
			return "the node's gateway refused the ticket: " + msg
		case connect.CodeFailedPrecondition:
			return "node has no live session on its gateway: " + msg
		case connect.CodeDeadlineExceeded:
			return "the node did not answer in time: " + msg
		}
		return "the node's gateway ended the tunnel: " + cerr.Code().String() + ": " + msg
	}
	t.log.Warn("tunnel: gateway stream failed", telemetry.KeyGatewayID, t.grant.route.GatewayID, telemetry.KeyError, err)
	return "the node's gateway is gone: gateway " + t.grant.route.GatewayID + " does not answer"
}

// toGateway sends m on the gateway's stream, unless its side is closed.
func (t *openTunnel) toGateway(m *gatewayv1.TunnelRequest) error {
	t.gwMu.Lock()
	defer t.gwMu.Unlock()
	if t.gwClosed {
		return io.EOF
	}
	return t.gw.Send(m)
}

// closeGateway sends a Close frame with reason first, unless the gateway
// has one, and ends the sending side of its stream.
func (t *openTunnel) closeGateway(reason string, send bool) {
	t.gwMu.Lock()
	defer t.gwMu.Unlock()
	if t.gwClosed || t.gw == nil {
		return
	}
	if send {
		_ = t.gw.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: closeFrame(reason)}})
	}
	_ = t.gw.CloseRequest()
	t.gwClosed = true
}

// toClient writes f to the client as one binary message, unless the
// WebSocket is closing.
func (t *openTunnel) toClient(f *tunnelv1.Frame) error {
	b, err := proto.Marshal(f)
	if err != nil {
		return err
	}
	t.wsMu.Lock()
	defer t.wsMu.Unlock()
	if t.wsClosed {
		return net.ErrClosed
	}
	ctx, cancel := context.WithTimeout(context.Background(), tunnelWriteTimeout)
	defer cancel()
	return t.ws.Write(ctx, websocket.MessageBinary, b)
}

// finish tells both ends why the tunnel ended (a Close frame to each that
// does not know), closes the WebSocket, ends the gateway's stream (after
// gatewayDrain at most), waits for the relays and records the close.
func (t *openTunnel) finish(ctx context.Context) {
	<-t.ended
	e := t.end
	t.closeGateway(e.reason, !e.gatewayKnows)
	if !e.clientKnows {
		_ = t.toClient(closeFrame(e.reason)) // a client gone is gone
	}
	t.wsMu.Lock()
	t.wsClosed = true
	t.wsMu.Unlock()
	_ = t.ws.Close(e.status, cleanReason(e.reason, maxWSCloseReason)) // fails only when the client is gone
	if t.gw != nil {
		drain := t.s.clock.NewTimer(gatewayDrain)
		select {
		case <-t.gwDone:
		case <-drain.C():
		}
		drain.Stop()
		t.cancelGW()
		<-t.gwDone
		_ = t.gw.CloseResponse()
		<-t.clientDone
	}
	t.s.recordClose(ctx, t.log, t.row.ID, e.reason)
	t.log.InfoContext(ctx, "tunnel closed", "reason", e.reason)
}

func closeFrame(reason string) *tunnelv1.Frame {
	return &tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: cleanReason(reason, maxCloseReason)}}}
}

// cleanReason makes reason fit a Close frame or a WebSocket close: valid
// UTF-8, control characters as spaces, at most n bytes (cut on a rune
// boundary, marked with "…").
func cleanReason(reason string, n int) string {
	reason = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(reason, "\uFFFD"))
	if len(reason) <= n {
		return reason
	}
	cut := n - len("…")
	for cut > 0 && !utf8.RuneStart(reason[cut]) {
		cut--
	}
	return reason[:cut] + "…"
}

// tunnelRegistry is the tunnels open on this server, for the checks a
// token's revocation asks for and for the wait at shutdown.
type tunnelRegistry struct {
	mu     sync.Mutex
	open   map[*openTunnel]struct{}
	closed bool
	wg     sync.WaitGroup
}

// add registers t; false once the registry is closed (shutting down).
func (r *tunnelRegistry) add(t *openTunnel) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	if r.open == nil {
		r.open = make(map[*openTunnel]struct{})
	}
	r.open[t] = struct{}{}
	r.wg.Add(1)
	return true
}

func (r *tunnelRegistry) remove(t *openTunnel) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.open, t)
	r.wg.Done()
}

// recheck asks the tunnels of API token tokenID ("": every tunnel) to
// authorize again now.
func (r *tunnelRegistry) recheck(tokenID string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for t := range r.open {
		if tokenID == "" || t.row.TokenID == tokenID {
			select {
			case t.recheck <- struct{}{}:
			default:
			}
		}
	}
}

// closeAndWait refuses new tunnels and waits for the open ones to end
// (StopWatches ends them).
func (r *tunnelRegistry) closeAndWait() {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	r.wg.Wait()
}
