package api_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/coder/websocket"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/pkg/tunnel"
	"github.com/better-compute/better-compute/services/api/api"
)

// fakeGateway is a gateway's control listener (GatewayControlService over
// h2c): it checks the ticket of each tunnel's start, reports the start,
// echoes data frames ("fail" ends the tunnel with Unavailable, "exit" with
// an exit status, "bye" with the node's Close frame), answers a resize with
// data "size RxC", and reports the Close frame a client sent. refuse, when
// set, is the error every tunnel ends with right after its start.
type fakeGateway struct {
	id     string
	url    string
	pub    ed25519.PublicKey
	starts chan *gatewayv1.TunnelStart
	closes chan string
	refuse error
	srv    *httptest.Server
}

func (g *fakeGateway) Tunnel(ctx context.Context, stream *connect.BidiStream[gatewayv1.TunnelRequest, tunnelv1.Frame]) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	start := first.GetStart()
	if start == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("start first"))
	}
	tk, err := tunnel.Verify(g.pub, start.Ticket, clock.New().Now())
	if err != nil || tk.ID != start.TunnelId {
		return connect.NewError(connect.CodeUnauthenticated, errors.New("ticket refused"))
	}
	g.starts <- start
	if g.refuse != nil {
		return g.refuse
	}
	for {
		req, err := stream.Receive()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		f := req.GetFrame()
		switch x := f.GetFrame().(type) {
		case *tunnelv1.Frame_Data:
			switch string(x.Data) {
			case "fail":
				return connect.NewError(connect.CodeUnavailable, errors.New("gateway shutting down"))
			case "exit":
				if err := stream.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Exit{Exit: &tunnelv1.Exit{Status: 3}}}); err != nil {
					return err
				}
				return nil
			case "bye":
				return stream.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: "the node said bye"}}})
			}
			if err := stream.Send(f); err != nil {
				return err
			}
		case *tunnelv1.Frame_Resize:
			if err := stream.Send(dataFrame("size " + u32(x.Resize.Rows) + "x" + u32(x.Resize.Cols))); err != nil {
				return err
			}
		case *tunnelv1.Frame_Close:
			g.closes <- x.Close.Reason
			return nil
		}
	}
}

// startGateway starts a fake gateway with id, registered with its control
// URL and present for an hour.
func (f *fixture) startGateway(t *testing.T, id string) *fakeGateway {
	t.Helper()
	g := &fakeGateway{id: id, pub: f.ticketKey(t).Public().(ed25519.PublicKey),
		starts: make(chan *gatewayv1.TunnelStart, 10), closes: make(chan string, 10)}
	mux := http.NewServeMux()
	mux.Handle(gatewayv1connect.NewGatewayControlServiceHandler(g))
	g.srv = httptest.NewUnstartedServer(mux)
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	g.srv.Config.Protocols = &protocols
	g.srv.Start()
	t.Cleanup(g.srv.Close)
	g.url = g.srv.URL
	now := f.db.Now()
	require.NoError(t, store.RegisterGateway(t.Context(), f.db.Pool, id, g.url, now))
	require.NoError(t, store.RecordGatewayPresence(t.Context(), f.db.Pool, now, id, time.Hour))
	return g
}

// tunnelServer returns f served by another API server with the fixture's
// PKI directory, tunnel settings cfg (zero: the defaults) and nc.
func (f *fixture) tunnelServer(t *testing.T, cfg api.TunnelConfig, nc *nats.Conn) (*fixture, *api.Server) {
	t.Helper()
	srv, err := api.New(api.Config{PKI: service.PKI{PKIDir: f.pkiDir}, Tunnels: cfg},
		api.Deps{DB: f.db, Logger: telemetry.Discard(), NC: nc})
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(srv.Close)
	t.Cleanup(ts.Close)
	t.Cleanup(srv.StopWatches) // runs first: open tunnels end, Close returns
	g := *f
	g.url = ts.URL
	return &g, srv
}

// liveNode makes an adopted node of acme's whose session is on gateway gw.
func (f *fixture) liveNode(t *testing.T, gw string) string {
	t.Helper()
	return f.node(t, f.acmePool, 1, "H100", storetest.NodeOpts{State: store.NodeAdopted, GatewayID: gw, SessionID: "ses_" + gw,
		Reachable: true})
}

// ticket asks for a ticket as who.
func (f *fixture) ticket(t *testing.T, who string, req *computev1.CreateTicketRequest) *computev1.CreateTicketResponse {
	t.Helper()
	res, err := createTicket(t, f.as(f.tokens[who]), req)
	require.NoError(t, err)
	return res
}

// dial opens path (with query, "" for none) on f's server as a WebSocket.
// A refusal returns its status and JSON body.
func (f *fixture) dial(t *testing.T, path, query string) (*websocket.Conn, int, map[string]string, http.Header) {
	t.Helper()
	u := "ws" + strings.TrimPrefix(f.url, "http") + path
	if query != "" {
		u += "?" + query
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	ws, resp, err := websocket.Dial(ctx, u, &websocket.DialOptions{Subprotocols: []string{api.TunnelSubprotocol}})
	if err == nil {
		t.Cleanup(func() { _ = ws.CloseNow() })
		// A frame carries up to 64 KiB of data (the default limit is 32 KiB).
		ws.SetReadLimit(66 << 10)
		require.Equal(t, api.TunnelSubprotocol, ws.Subprotocol())
		return ws, http.StatusSwitchingProtocols, nil, resp.Header
	}
	require.NotNil(t, resp, "%v", err)
	defer resp.Body.Close()
	var body map[string]string
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&body))
	return nil, resp.StatusCode, body, resp.Header
}

// open opens the tunnel of ticket res.
func (f *fixture) open(t *testing.T, res *computev1.CreateTicketResponse, query string) *websocket.Conn {
	t.Helper()
	ws, status, body, _ := f.dial(t, res.Path, query)
	require.Equal(t, http.StatusSwitchingProtocols, status, "%v", body)
	return ws
}

// requireRefused checks a refusal's status, code and message.
func (f *fixture) requireRefused(t *testing.T, path, query string, status int, code connect.Code, msg string) http.Header {
	t.Helper()
	ws, got, body, header := f.dial(t, path, query)
	require.Nil(t, ws)
	require.Equal(t, status, got, "%v", body)
	require.Equal(t, code.String(), body["code"])
	require.Contains(t, body["message"], msg)
	return header
}

func dataFrame(s string) *tunnelv1.Frame {
	return &tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: []byte(s)}}
}

func u32(n uint32) string { return u64(uint64(n)) }

func send(t *testing.T, ws *websocket.Conn, f *tunnelv1.Frame) {
	t.Helper()
	b, err := proto.Marshal(f)
	require.NoError(t, err)
	require.NoError(t, ws.Write(t.Context(), websocket.MessageBinary, b))
}

// next reads the next frame of ws.
func next(t *testing.T, ws *websocket.Conn) *tunnelv1.Frame {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	typ, b, err := ws.Read(ctx)
	require.NoError(t, err)
	require.Equal(t, websocket.MessageBinary, typ)
	f := &tunnelv1.Frame{}
	require.NoError(t, proto.Unmarshal(b, f))
	return f
}

// requireClosed reads ws until the tunnel's Close frame, checks its reason,
// then the WebSocket close that follows and its status.
func requireClosed(t *testing.T, ws *websocket.Conn, reason string, status websocket.StatusCode) {
	t.Helper()
	for {
		f := next(t, ws)
		if c := f.GetClose(); c != nil {
			require.Equal(t, reason, c.Reason)
			break
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, _, err := ws.Read(ctx)
	require.Equal(t, status, websocket.CloseStatus(err), "%v", err)
}

// requireRowClosed waits for tunnel id's row to record its close with
// reason.
func (f *fixture) requireRowClosed(t *testing.T, id, reason string) {
	t.Helper()
	require.Eventually(t, func() bool {
		row, err := store.GetTunnelTicket(t.Context(), f.db.Pool, id)
		require.NoError(t, err)
		return row.ClosedAt != nil
	}, 10*time.Second, 10*time.Millisecond)
	row, err := store.GetTunnelTicket(t.Context(), f.db.Pool, id)
	require.NoError(t, err)
	require.Equal(t, reason, row.CloseReason)
}

func TestTunnelRelays(t *testing.T) {
	t.Parallel()
	f := setup(t)
	gw := f.startGateway(t, "gw-relay")
	node := f.liveNode(t, gw.id)

	res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	ws := f.open(t, res, "node="+node+"&rows=24&cols=80")
	start := <-gw.starts
	require.Equal(t, res.TicketId, start.TunnelId)
	require.Equal(t, res.Ticket, start.Ticket)
	require.EqualValues(t, 24, start.Size.GetRows())
	require.EqualValues(t, 80, start.Size.GetCols())
	row, err := store.GetTunnelTicket(t.Context(), f.db.Pool, res.TicketId)
	require.NoError(t, err)
	require.NotNil(t, row.ConsumedAt, "the ticket is spent")
	require.Nil(t, row.ClosedAt)

	// Both ways: data echoed, a resize answered.
	send(t, ws, dataFrame("hello"))
	require.Equal(t, "hello", string(next(t, ws).GetData()))
	send(t, ws, &tunnelv1.Frame{Frame: &tunnelv1.Frame_Resize{Resize: &tunnelv1.TerminalSize{Rows: 50, Cols: 132}}})
	require.Equal(t, "size 50x132", string(next(t, ws).GetData()))
	big := strings.Repeat("x", 64<<10)
	send(t, ws, dataFrame(big))
	require.Equal(t, big, string(next(t, ws).GetData()), "a frame of 64 KiB")

	// The client's Close frame reaches the node; the tunnel is recorded
	// closed.
	send(t, ws, &tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: "done"}}})
	require.Equal(t, "done", <-gw.closes)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	_, _, err = ws.Read(ctx)
	require.Equal(t, websocket.StatusNormalClosure, websocket.CloseStatus(err), "%v", err)
	f.requireRowClosed(t, res.TicketId, "closed by the client: done")

	// The node's end: its exit status, then the end of the stream.
	res = f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	ws = f.open(t, res, "")
	require.Nil(t, (<-gw.starts).Size, "no size asked")
	send(t, ws, dataFrame("exit"))
	require.EqualValues(t, 3, next(t, ws).GetExit().GetStatus())
	requireClosed(t, ws, "the tunnel ended", websocket.StatusNormalClosure)
	f.requireRowClosed(t, res.TicketId, "the tunnel ended")

	// The node's Close frame reaches the client as it is.
	res = f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	ws = f.open(t, res, "")
	<-gw.starts
	send(t, ws, dataFrame("bye"))
	requireClosed(t, ws, "the node said bye", websocket.StatusNormalClosure)
	f.requireRowClosed(t, res.TicketId, "the node said bye")

	// The client's WebSocket close tells the node.
	res = f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "ssh"})
	ws = f.open(t, res, "")
	<-gw.starts
	require.NoError(t, ws.Close(websocket.StatusNormalClosure, ""))
	require.Equal(t, "the client closed the tunnel", <-gw.closes)
	f.requireRowClosed(t, res.TicketId, "the client closed the tunnel")

	// A sandbox of another tenant's reservation on acme's machine.
	sb := f.newSandbox(t, time.Time{}, "", gw.id)
	res = f.ticket(t, "other-member", &computev1.CreateTicketRequest{NodeId: sb.node, Purpose: "ssh", ReservationId: sb.reservation})
	ws = f.open(t, res, "")
	<-gw.starts
	send(t, ws, dataFrame("SSH-2.0-x"))
	require.Equal(t, "SSH-2.0-x", string(next(t, ws).GetData()))
}

func TestTunnelBadFrames(t *testing.T) {
	t.Parallel()
	f := setup(t)
	gw := f.startGateway(t, "gw-bad")
	node := f.liveNode(t, gw.id)
	for _, tc := range []struct {
		name   string
		write  func(ws *websocket.Conn)
		reason string
		status websocket.StatusCode
	}{
		{"text", func(ws *websocket.Conn) {
			require.NoError(t, ws.Write(t.Context(), websocket.MessageText, []byte("hi")))
		},
			"a tunnel's messages are binary, each one protobuf bc.tunnel.v1.Frame; got a text message", websocket.StatusUnsupportedData},
		{"not a frame", func(ws *websocket.Conn) {
			require.NoError(t, ws.Write(t.Context(), websocket.MessageBinary, []byte{0xff, 0xff}))
		}, "a message is not a bc.tunnel.v1.Frame", websocket.StatusInvalidFramePayloadData},
		{"an empty frame", func(ws *websocket.Conn) { send(t, ws, &tunnelv1.Frame{}) },
			"invalid frame: frame: exactly one field is required in oneof", websocket.StatusInvalidFramePayloadData},
		{"an exit", func(ws *websocket.Conn) {
			send(t, ws, &tunnelv1.Frame{Frame: &tunnelv1.Frame_Exit{Exit: &tunnelv1.Exit{}}})
		}, "a client sends no exit frame (the node does)", websocket.StatusInvalidFramePayloadData},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
			ws := f.open(t, res, "")
			<-gw.starts
			tc.write(ws)
			requireClosed(t, ws, tc.reason, tc.status)
			require.Equal(t, tc.reason, <-gw.closes, "the node is told")
			f.requireRowClosed(t, res.TicketId, tc.reason)
		})
	}
}

func TestTunnelRefusals(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	gw := f.startGateway(t, "gw-refusals")
	node := f.liveNode(t, gw.id)
	shell := &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"}
	key := f.ticketKey(t)
	adminTok := tokenID(t, f.db, f.tokens["acme-admin"])
	unauth, conflict := connect.CodeUnauthenticated, connect.CodeFailedPrecondition

	// Signed tickets that were never issued, or are past their minute.
	signed := func(t *testing.T, row bool, expires time.Time) string {
		t.Helper()
		now := f.db.Now()
		tk := tunnel.Ticket{ID: ids.New(ids.Ticket, now), NodeID: node, Purpose: "shell", TenantID: f.acme, TokenID: adminTok,
			ExpiresAt: expires.Truncate(time.Second)}
		if row {
			storetest.TunnelTicket(t, f.db, &storetest.TunnelTicketOpts{ID: tk.ID, NodeID: node, TokenID: adminTok,
				ExpiresAt: tk.ExpiresAt})
		}
		s, err := tunnel.Sign(key, tk)
		require.NoError(t, err)
		return s
	}
	_, otherKey, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	forged, err := tunnel.Sign(otherKey, tunnel.Ticket{ID: "tkt_x", NodeID: node, Purpose: "shell", TenantID: f.acme,
		TokenID: adminTok, ExpiresAt: f.db.Now().Add(time.Minute)})
	require.NoError(t, err)

	t.Run("forged", func(t *testing.T) {
		f.requireRefused(t, api.TunnelsPath+forged, "", http.StatusUnauthorized, unauth, "ticket signature is not valid")
	})
	t.Run("malformed", func(t *testing.T) {
		f.requireRefused(t, api.TunnelsPath+"bctk_nonsense", "", http.StatusUnauthorized, unauth, "ticket is malformed")
	})
	t.Run("expired", func(t *testing.T) {
		f.requireRefused(t, api.TunnelsPath+signed(t, true, f.db.Now().Add(-time.Second)), "", http.StatusUnauthorized, unauth,
			"ticket expired at ")
	})
	t.Run("unknown", func(t *testing.T) {
		f.requireRefused(t, api.TunnelsPath+signed(t, false, f.db.Now().Add(time.Minute)), "", http.StatusUnauthorized, unauth,
			"ticket is not known")
	})
	t.Run("reused", func(t *testing.T) {
		res := f.ticket(t, "acme-admin", shell)
		ws := f.open(t, res, "")
		<-gw.starts
		f.requireRefused(t, res.Path, "", http.StatusUnauthorized, unauth, "ticket was used already")
		require.NoError(t, ws.Close(websocket.StatusNormalClosure, ""))
		<-gw.closes
		f.requireRefused(t, res.Path, "", http.StatusUnauthorized, unauth, "ticket was used already")
	})
	t.Run("other-node", func(t *testing.T) {
		res := f.ticket(t, "acme-admin", shell)
		f.requireRefused(t, res.Path, "node=node_other", http.StatusUnauthorized, unauth, "ticket is for another node")
		// Not spent: it opens for its own node.
		f.open(t, res, "node="+node)
		<-gw.starts
	})
	t.Run("bad-size", func(t *testing.T) {
		res := f.ticket(t, "acme-admin", shell)
		f.requireRefused(t, res.Path, "rows=24", http.StatusBadRequest, connect.CodeInvalidArgument, "rows and cols: give both or neither")
		f.requireRefused(t, res.Path, "rows=0&cols=80", http.StatusBadRequest, connect.CodeInvalidArgument,
			"rows: want a whole number from 1 to 10000")
		f.requireRefused(t, res.Path, "rows=24&cols=x", http.StatusBadRequest, connect.CodeInvalidArgument,
			"cols: want a whole number from 1 to 10000")
	})
	t.Run("not-a-websocket", func(t *testing.T) {
		res := f.ticket(t, "acme-admin", shell)
		resp, err := http.Get(f.url + res.Path)
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusBadRequest, resp.StatusCode)
		row, err := store.GetTunnelTicket(ctx, f.db.Pool, res.TicketId)
		require.NoError(t, err)
		require.Nil(t, row.ConsumedAt, "a plain GET spends no ticket")
	})
	t.Run("no-live-session", func(t *testing.T) {
		alone := f.node(t, f.acmePool, 1, "H100", adopted)
		res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: alone, Purpose: "shell"})
		f.requireRefused(t, res.Path, "", http.StatusConflict, conflict, "node has no live session")
		f.requireRowClosed(t, res.TicketId, "node has no live session")
	})
	t.Run("gateway-not-present", func(t *testing.T) {
		require.NoError(t, store.RegisterGateway(ctx, f.db.Pool, "gw-dead", gw.url, f.db.Now()))
		require.NoError(t, store.RecordGatewayPresence(ctx, f.db.Pool, f.db.Now().Add(-time.Hour), "gw-dead", time.Minute))
		dead := f.liveNode(t, "gw-dead")
		res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: dead, Purpose: "shell"})
		f.requireRefused(t, res.Path, "", http.StatusConflict, conflict, "node has no live session (its gateway gw-dead is not present)")
	})
	t.Run("token-revoked", func(t *testing.T) {
		secret := f.newAdminToken(t)
		res, err := createTicket(t, f.as(secret), shell)
		require.NoError(t, err)
		f.revoke(t, secret)
		f.requireRefused(t, res.Path, "", http.StatusUnauthorized, unauth, "api token was revoked")
		f.requireRowClosed(t, res.TicketId, "api token was revoked")
	})
	t.Run("node-revoked", func(t *testing.T) {
		n := f.liveNode(t, gw.id)
		res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: n, Purpose: "shell"})
		f.revokeNode(t, n)
		f.requireRefused(t, res.Path, "", http.StatusConflict, conflict, "node was revoked: stolen")
	})
	t.Run("reservation-ended", func(t *testing.T) {
		sb := f.newSandbox(t, time.Time{}, "", gw.id)
		res := f.ticket(t, "other-member", &computev1.CreateTicketRequest{NodeId: sb.node, Purpose: "ssh",
			ReservationId: sb.reservation})
		_, err := f.as(f.tokens["other-member"]).res.ReleaseReservation(ctx, connect.NewRequest(
			&computev1.ReleaseReservationRequest{ReservationId: sb.reservation}))
		require.NoError(t, err)
		f.requireRefused(t, res.Path, "", http.StatusConflict, conflict, "reservation "+sb.reservation+" is no longer active")
	})
	t.Run("no-pki", func(t *testing.T) {
		res := f.ticket(t, "acme-admin", shell)
		bare := f.replica(t, api.Config{}, nil)
		bare.requireRefused(t, res.Path, "", http.StatusNotFound, conflict, "tunnels are not configured")
	})
}

// newAdminToken mints a tenant-admin token of acme for one test.
func (f *fixture) newAdminToken(t *testing.T) string {
	t.Helper()
	secret, _, err := iam.MintAPIToken(t.Context(), f.db.Pool, f.db.Now(), f.acme, "tunnels", iam.RoleTenantAdmin, nil)
	require.NoError(t, err)
	return secret
}

// revoke revokes the token of secret through f's server.
func (f *fixture) revoke(t *testing.T, secret string) {
	t.Helper()
	_, err := f.as(f.tokens["acme-admin"]).apiTokens.RevokeToken(t.Context(), connect.NewRequest(
		&computev1.RevokeTokenRequest{TokenId: tokenID(t, f.db, secret)}))
	require.NoError(t, err)
}

// revokeNode revokes acme's node id, reason "stolen".
func (f *fixture) revokeNode(t *testing.T, id string) {
	t.Helper()
	_, err := f.as(f.tokens["acme-admin"]).nodes.RevokeNode(t.Context(), connect.NewRequest(
		&computev1.RevokeNodeRequest{NodeId: id, Reason: "stolen"}))
	require.NoError(t, err)
}

func TestTunnelLimits(t *testing.T) {
	t.Parallel()
	base := setup(t)
	f, _ := base.tunnelServer(t, api.TunnelConfig{LimitPerNode: 1, LimitPerToken: 2}, nil)
	gw := f.startGateway(t, "gw-limits")
	node, node2, node3 := f.liveNode(t, gw.id), f.liveNode(t, gw.id), f.liveNode(t, gw.id)

	first := f.open(t, f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"}), "")
	<-gw.starts
	res := f.ticket(t, "root", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	header := f.requireRefused(t, res.Path, "", http.StatusTooManyRequests, connect.CodeResourceExhausted,
		"the node has 1 open tunnels, the most allowed")
	require.Equal(t, "5", header.Get("Retry-After"))

	f.open(t, f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node2, Purpose: "shell"}), "")
	<-gw.starts
	third := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node3, Purpose: "shell"})
	f.requireRefused(t, third.Path, "", http.StatusTooManyRequests, connect.CodeResourceExhausted,
		"the token has 2 open tunnels, the most allowed")

	// A refusal by a limit leaves the ticket unspent: once a tunnel
	// closes, it opens.
	require.NoError(t, first.Close(websocket.StatusNormalClosure, ""))
	<-gw.closes
	require.Eventually(t, func() bool {
		ws, status, _, _ := f.dial(t, res.Path, "")
		if ws != nil {
			_ = ws.CloseNow()
		}
		return status == http.StatusSwitchingProtocols
	}, 10*time.Second, 20*time.Millisecond)
}

func TestTunnelReauthorization(t *testing.T) {
	t.Parallel()
	base := setup(t)
	nc := natsConn(t)
	// Re-authorization every 100 ms; the token tests would pass within 2 s
	// with the default minute too (TestTunnelTokenRevokedAtOnce).
	f, _ := base.tunnelServer(t, api.TunnelConfig{ReauthInterval: 100 * time.Millisecond}, nc)
	gw := f.startGateway(t, "gw-reauth")

	t.Run("node-revoked", func(t *testing.T) {
		node := f.liveNode(t, gw.id)
		res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
		ws := f.open(t, res, "")
		<-gw.starts
		f.revokeNode(t, node)
		requireClosed(t, ws, "node was revoked: stolen", websocket.StatusNormalClosure)
		require.Equal(t, "node was revoked: stolen", <-gw.closes)
		f.requireRowClosed(t, res.TicketId, "node was revoked: stolen")
	})
	t.Run("reservation-released", func(t *testing.T) {
		sb := f.newSandbox(t, time.Time{}, "", gw.id)
		res := f.ticket(t, "other-member", &computev1.CreateTicketRequest{NodeId: sb.node, Purpose: "ssh",
			ReservationId: sb.reservation})
		ws := f.open(t, res, "")
		<-gw.starts
		_, err := f.as(f.tokens["other-member"]).res.ReleaseReservation(t.Context(), connect.NewRequest(
			&computev1.ReleaseReservationRequest{ReservationId: sb.reservation}))
		require.NoError(t, err)
		requireClosed(t, ws, "reservation "+sb.reservation+" is no longer active", websocket.StatusNormalClosure)
		<-gw.closes
	})
	t.Run("touched", func(t *testing.T) {
		node := f.liveNode(t, gw.id)
		res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
		f.open(t, res, "")
		<-gw.starts
		opened, err := store.GetTunnelTicket(t.Context(), f.db.Pool, res.TicketId)
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			row, err := store.GetTunnelTicket(t.Context(), f.db.Pool, res.TicketId)
			require.NoError(t, err)
			return row.AuthorizedAt.After(*opened.AuthorizedAt)
		}, 10*time.Second, 20*time.Millisecond, "each re-authorization is recorded (store.TouchTunnel)")
	})
	t.Run("token-revoked-elsewhere", func(t *testing.T) {
		// Another replica revokes the token: its NATS message (here
		// published as the outbox relay would) re-checks at once.
		secret := f.newAdminToken(t)
		node := f.liveNode(t, gw.id)
		res, err := createTicket(t, f.as(secret), &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
		require.NoError(t, err)
		ws := f.open(t, res, "")
		<-gw.starts
		id := tokenID(t, f.db, secret)
		f.revokedBehind(t, id)
		msg, err := json.Marshal(store.APITokenRevoked{TokenID: id})
		require.NoError(t, err)
		require.NoError(t, nc.Publish(store.SubjectAPITokenRevoked, msg))
		requireClosed(t, ws, "api token was revoked", websocket.StatusNormalClosure)
	})
}

// TestTunnelTokenRevokedAtOnce checks that revoking a token through the
// API (RevokeToken) closes its tunnels within 2 s, with the default
// re-authorization interval of a minute, and leaves other tokens' open.
func TestTunnelTokenRevokedAtOnce(t *testing.T) {
	t.Parallel()
	f := setup(t)
	gw := f.startGateway(t, "gw-revoke")
	node := f.liveNode(t, gw.id)
	secret := f.newAdminToken(t)
	res, err := createTicket(t, f.as(secret), &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	require.NoError(t, err)
	ws := f.open(t, res, "")
	<-gw.starts
	keep := f.open(t, f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"}), "")
	<-gw.starts

	clk := clock.New()
	start := clk.Now()
	f.revoke(t, secret)
	requireClosed(t, ws, "api token was revoked", websocket.StatusNormalClosure)
	require.Less(t, clock.Since(clk, start), 2*time.Second)
	require.Equal(t, "api token was revoked", <-gw.closes)
	f.requireRowClosed(t, res.TicketId, "api token was revoked")

	send(t, keep, dataFrame("still here"))
	require.Equal(t, "still here", string(next(t, keep).GetData()))
}

func TestTunnelIdleTimeout(t *testing.T) {
	t.Parallel()
	base := setup(t)
	f, _ := base.tunnelServer(t, api.TunnelConfig{IdleTimeout: 300 * time.Millisecond}, nil)
	gw := f.startGateway(t, "gw-idle")
	node := f.liveNode(t, gw.id)
	res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	ws := f.open(t, res, "")
	<-gw.starts
	requireClosed(t, ws, "idle for 300ms", websocket.StatusNormalClosure)
	require.Equal(t, "idle for 300ms", <-gw.closes)
	f.requireRowClosed(t, res.TicketId, "idle for 300ms")
}

func TestTunnelGatewayErrors(t *testing.T) {
	t.Parallel()
	f := setup(t)
	gw := f.startGateway(t, "gw-errors")
	node := f.liveNode(t, gw.id)

	t.Run("during", func(t *testing.T) {
		res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
		ws := f.open(t, res, "")
		<-gw.starts
		send(t, ws, dataFrame("fail"))
		requireClosed(t, ws, "the node's gateway is gone: gateway shutting down", websocket.StatusNormalClosure)
		f.requireRowClosed(t, res.TicketId, "the node's gateway is gone: gateway shutting down")
	})
	t.Run("at-start", func(t *testing.T) {
		refusing := f.startGateway(t, "gw-refusing")
		refusing.refuse = connect.NewError(connect.CodeFailedPrecondition, errors.New("no session of node here"))
		n := f.liveNode(t, refusing.id)
		ws := f.open(t, f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: n, Purpose: "shell"}), "")
		<-refusing.starts
		requireClosed(t, ws, "node has no live session on its gateway: no session of node here", websocket.StatusNormalClosure)
	})
	t.Run("gone", func(t *testing.T) {
		gone := f.startGateway(t, "gw-gone")
		gone.srv.Close()
		n := f.liveNode(t, gone.id)
		ws := f.open(t, f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: n, Purpose: "shell"}), "")
		requireClosed(t, ws, "the node's gateway is gone: gateway gw-gone does not answer", websocket.StatusNormalClosure)
	})
}

func TestTunnelShutdown(t *testing.T) {
	t.Parallel()
	base := setup(t)
	f, srv := base.tunnelServer(t, api.TunnelConfig{}, nil)
	gw := f.startGateway(t, "gw-shutdown")
	node := f.liveNode(t, gw.id)
	res := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	ws := f.open(t, res, "")
	<-gw.starts
	later := f.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})

	srv.StopWatches()
	requireClosed(t, ws, "API shutting down", websocket.StatusGoingAway)
	require.Equal(t, "API shutting down", <-gw.closes)
	f.requireRowClosed(t, res.TicketId, "API shutting down")
	f.requireRefused(t, later.Path, "", http.StatusServiceUnavailable, connect.CodeUnavailable, "API shutting down")
}
