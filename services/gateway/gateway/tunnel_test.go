package gateway_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/api/gen/bc/gateway/v1/gatewayv1connect"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/tunnel"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

// ticketOpts tune a test ticket.
type ticketOpts struct {
	purpose string             // shell when empty
	expires time.Time          // TicketTTL from now when zero
	key     ed25519.PrivateKey // the deployment's tunnel-ticket key when nil
}

// ticket returns an exec ticket for nodeID, as the API issues them, and its
// id.
func (e *env) ticket(nodeID string, o ticketOpts) (string, string) {
	e.t.Helper()
	key := o.key
	if key == nil {
		var err error
		key, err = pki.LoadSigningKey(filepath.Join(e.pkiDir, pki.TunnelTicketKey))
		require.NoError(e.t, err)
	}
	now := realClock.Now()
	t := tunnel.Ticket{ID: ids.New(ids.Ticket, now), NodeID: nodeID, Purpose: o.purpose, TenantID: e.tenantID, TokenID: "tok_test",
		ExpiresAt: o.expires}
	if t.Purpose == "" {
		t.Purpose = tunnel.PurposeShell
	}
	if t.ExpiresAt.IsZero() {
		t.ExpiresAt = now.Add(tunnel.TicketTTL)
	}
	s, err := tunnel.Sign(key, t)
	require.NoError(e.t, err)
	return s, t.ID
}

// in returns e for subtest t: what its helpers create is cleaned up, and
// what they check fails, in t.
func (e *env) in(t testing.TB) *env {
	c := *e
	c.t = t
	return &c
}

// tstream is the client side of a tunnel stream: the API's on the control
// server, or a daemon's on the Session server.
type tstream struct {
	t      testing.TB
	conns  *conns // the connections of its client
	stream *connect.BidiStreamForClient[gatewayv1.TunnelRequest, tunnelv1.Frame]
	frames chan *tunnelv1.Frame
	err    chan error // the Receive error that ended the stream
	cancel context.CancelFunc
	done   chan struct{}
}

func newTstream(t testing.TB, c *conns, open func(context.Context) *connect.BidiStreamForClient[gatewayv1.TunnelRequest, tunnelv1.Frame],
	start *gatewayv1.TunnelStart) *tstream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ts := &tstream{t: t, conns: c, stream: open(ctx), frames: make(chan *tunnelv1.Frame, 1024), err: make(chan error, 1), cancel: cancel,
		done: make(chan struct{})}
	t.Cleanup(ts.close)
	if start != nil {
		require.NoError(t, ts.stream.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Start{Start: start}}))
	} else {
		require.NoError(t, ts.stream.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: dataFrame([]byte("x"))}}))
	}
	go func() {
		defer close(ts.done)
		for {
			f, err := ts.stream.Receive()
			if err != nil {
				ts.err <- err
				return
			}
			ts.frames <- f
		}
	}()
	return ts
}

// conns records the connections a client dials, to cut them.
type conns struct {
	mu  sync.Mutex
	all []net.Conn
}

func (c *conns) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err == nil {
		c.mu.Lock()
		c.all = append(c.all, conn)
		c.mu.Unlock()
	}
	return conn, err
}

// cut closes every connection dialed: the peer is gone.
func (c *conns) cut() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.all {
		_ = conn.Close()
	}
}

// controlClient returns a GatewayControlService client of g over h2c, as
// the API dials it, on connections of its own.
func (e *env) controlClient(g *gw) (gatewayv1connect.GatewayControlServiceClient, *conns) {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	c := &conns{}
	tr := &http.Transport{Protocols: &p, DialContext: c.dial}
	e.t.Cleanup(tr.CloseIdleConnections)
	return gatewayv1connect.NewGatewayControlServiceClient(&http.Client{Transport: tr}, g.controlURL), c
}

// openAPI opens the API's stream of a tunnel on g with start (with nil, a
// data frame first).
func (e *env) openAPI(g *gw, start *gatewayv1.TunnelStart) *tstream {
	e.t.Helper()
	client, c := e.controlClient(g)
	return newTstream(e.t, c, client.Tunnel, start)
}

// dialNode opens n's stream of tunnel id on g, as its daemon does, on a
// connection of its own.
func (e *env) dialNode(g *gw, n node, id string) *tstream {
	e.t.Helper()
	return e.dialNodeStart(g, n, &gatewayv1.TunnelStart{TunnelId: id})
}

func (e *env) dialNodeStart(g *gw, n node, start *gatewayv1.TunnelStart) *tstream {
	e.t.Helper()
	c := &conns{}
	return newTstream(e.t, c, e.clientDialing(g, n.cert, c.dial).Tunnel, start)
}

func (ts *tstream) close() {
	_ = ts.stream.CloseRequest()
	ts.cancel()
	<-ts.done
}

func (ts *tstream) send(f *tunnelv1.Frame) {
	ts.t.Helper()
	require.NoError(ts.t, ts.stream.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: f}}))
}

func (ts *tstream) sendData(b []byte) { ts.t.Helper(); ts.send(dataFrame(b)) }

func (ts *tstream) sendClose(reason string) {
	ts.t.Helper()
	ts.send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: reason}}})
}

func dataFrame(b []byte) *tunnelv1.Frame {
	return &tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: b}}
}

// next returns the next frame, failing the test after waitFor or when the
// stream ended with none left.
func (ts *tstream) next() *tunnelv1.Frame {
	ts.t.Helper()
	timer := realClock.NewTimer(waitFor)
	defer timer.Stop()
	select {
	case f := <-ts.frames:
		return f
	case err := <-ts.err:
		ts.err <- err
		select {
		case f := <-ts.frames:
			return f
		default:
		}
		require.FailNow(ts.t, "tunnel stream ended", "%v", err)
	case <-timer.C():
		require.FailNow(ts.t, "no frame from the gateway")
	}
	return nil
}

// readData reads data frames until it has n bytes, failing on any other
// frame.
func (ts *tstream) readData(n int) []byte {
	ts.t.Helper()
	var b []byte
	for len(b) < n {
		f := ts.next()
		require.NotNil(ts.t, f.GetData(), "a data frame, got %v", f)
		b = append(b, f.GetData()...)
	}
	return b
}

// nextClose returns the reason of the next frame, which must be a Close.
func (ts *tstream) nextClose() string {
	ts.t.Helper()
	f := ts.next()
	require.NotNil(ts.t, f.GetClose(), "a close frame, got %v", f)
	return f.GetClose().GetReason()
}

// ended waits for the stream to end after no more frames and returns its
// error, nil when it ended cleanly.
func (ts *tstream) ended() error {
	ts.t.Helper()
	timer := realClock.NewTimer(waitFor)
	defer timer.Stop()
	select {
	case f := <-ts.frames:
		require.FailNow(ts.t, "a frame before the end", "%v", f)
	case err := <-ts.err:
		ts.err <- err
		if errors.Is(err, io.EOF) {
			return nil
		}
		return err
	case <-timer.C():
		require.FailNow(ts.t, "tunnel stream did not end")
	}
	return nil
}

// refused checks that ts ended with code and an error containing msg.
func (ts *tstream) refused(code connect.Code, msg string) {
	ts.t.Helper()
	err := ts.ended()
	require.Equal(ts.t, code, connectCode(err), "%v", err)
	require.Contains(ts.t, err.Error(), msg)
}

// tunnelFixture is a node with a session on a gateway, and a tunnel to it
// open through the control stream.
type tunnelFixture struct {
	n      node
	daemon *daemon
	id     string
	api    *tstream
	node   *tstream
	open   *gatewayv1.OpenTunnel
}

// openTunnel connects a new node to g and opens a tunnel to it: the API
// starts it with a fresh ticket (and size), the daemon answers OpenTunnel
// by dialing back.
func (e *env) openTunnel(g *gw, size *tunnelv1.TerminalSize) *tunnelFixture {
	e.t.Helper()
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	f := e.openTunnelTo(g, n, d, size)
	f.daemon = d
	return f
}

// openTunnelTo opens a tunnel to n, whose session is d.
func (e *env) openTunnelTo(g *gw, n node, d *daemon, size *tunnelv1.TerminalSize) *tunnelFixture {
	e.t.Helper()
	tk, id := e.ticket(n.id, ticketOpts{})
	api := e.openAPI(g, &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk, Size: size})
	ot := d.next().GetOpenTunnel()
	require.NotNil(e.t, ot, "OpenTunnel on the session")
	require.Equal(e.t, id, ot.GetTunnelId())
	f := &tunnelFixture{n: n, daemon: d, id: id, api: api, node: e.dialNode(g, n, id), open: ot}
	// Bytes pass once the node's stream attached: then the tunnel is open.
	requireOpen(e.t, f)
	return f
}

// requireOpen checks that bytes pass both ways through f.
func requireOpen(t testing.TB, f *tunnelFixture) {
	t.Helper()
	f.api.sendData([]byte("ping"))
	require.Equal(t, "ping", string(f.node.readData(4)))
	f.node.sendData([]byte("pong"))
	require.Equal(t, "pong", string(f.api.readData(4)))
}

func TestTunnelSplicesBothWays(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	f := e.openTunnel(g, &tunnelv1.TerminalSize{Rows: 40, Cols: 120})
	require.Equal(t, tunnel.PurposeShell, f.open.GetPurpose())
	require.EqualValues(t, 40, f.open.GetSize().GetRows())
	require.EqualValues(t, 120, f.open.GetSize().GetCols())

	f.api.sendData([]byte("echo hi\n"))
	require.Equal(t, "echo hi\n", string(f.node.readData(8)))
	f.node.sendData([]byte("hi\n"))
	require.Equal(t, "hi\n", string(f.api.readData(3)))

	f.api.send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Resize{Resize: &tunnelv1.TerminalSize{Rows: 50, Cols: 200}}})
	r := f.node.next().GetResize()
	require.NotNil(t, r, "the resize reaches the node")
	require.EqualValues(t, 50, r.GetRows())
	require.EqualValues(t, 200, r.GetCols())

	// The shell exits: the client gets the status, then the end, and no
	// Close after the node's last frame.
	f.node.send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Exit{Exit: &tunnelv1.Exit{Status: 3}}})
	require.NoError(t, f.node.stream.CloseRequest())
	require.EqualValues(t, 3, f.api.next().GetExit().GetStatus())
	require.NoError(t, f.api.ended())
	require.NoError(t, f.node.ended())

	// The session goes on.
	f.daemon.heartbeat(1, 0)
	require.Equal(t, int64(1), f.daemon.nextAck())
}

func TestTunnelCarriesMiBInOrder(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	f := e.openTunnel(g, nil)
	const size = 6 << 20
	up, down := make([]byte, size), make([]byte, size)
	_, _ = rand.Read(up)
	_, _ = rand.Read(down)
	// Both ways at once, in frames of tunnel.MaxChunk, as tunnel.Conn
	// writes them.
	send := func(ts *tstream, b []byte) <-chan error {
		errc := make(chan error, 1)
		go func() {
			for len(b) > 0 {
				n := min(len(b), tunnel.MaxChunk)
				if err := ts.stream.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: dataFrame(b[:n])}}); err != nil {
					errc <- err
					return
				}
				b = b[n:]
			}
			errc <- nil
		}()
		return errc
	}
	upDone, downDone := send(f.api, up), send(f.node, down)
	require.True(t, bytes.Equal(up, f.node.readData(size)), "the node reads the client's bytes in order")
	require.True(t, bytes.Equal(down, f.api.readData(size)), "the client reads the node's bytes in order")
	require.NoError(t, <-upDone)
	require.NoError(t, <-downDone)
}

// TestTunnelCloseReasons: either end's Close reaches the other; an end that
// goes away without one has the gateway tell the other why.
func TestTunnelCloseReasons(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)

	t.Run("client closes", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		f.api.sendClose("user pressed ~.")
		require.Equal(t, "user pressed ~.", f.node.nextClose())
		require.NoError(t, f.node.ended())
		require.NoError(t, f.api.ended())
	})
	t.Run("node closes", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		f.node.sendClose("the shell was killed")
		require.Equal(t, "the shell was killed", f.api.nextClose())
		require.NoError(t, f.api.ended())
		require.NoError(t, f.node.ended())
	})
	t.Run("node ends its stream", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		require.NoError(t, f.node.stream.CloseRequest())
		require.Equal(t, "node closed the tunnel", f.api.nextClose())
		require.NoError(t, f.api.ended())
	})
	t.Run("client ends its stream", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		require.NoError(t, f.api.stream.CloseRequest())
		require.Equal(t, "the client closed the tunnel", f.node.nextClose())
		require.NoError(t, f.node.ended())
	})
	t.Run("client goes away", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		f.api.conns.cut()
		require.Equal(t, "the client's tunnel stream broke", f.node.nextClose())
		require.NoError(t, f.node.ended())
	})
	t.Run("node goes away", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		f.node.conns.cut()
		require.Equal(t, "the node's tunnel stream broke", f.api.nextClose())
		require.NoError(t, f.api.ended())
	})
	t.Run("oversized frame", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		// Past the message bound: refused before it is decoded.
		_ = f.api.stream.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: dataFrame(make([]byte, 100<<10))}})
		f.api.refused(connect.CodeResourceExhausted, "")
		require.Equal(t, "the client's tunnel stream broke", f.node.nextClose())
	})
	t.Run("invalid frame", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		// 64 KiB and one byte: within the message bound, over the
		// frame's (protovalidate).
		f.node.send(dataFrame(make([]byte, 64<<10+1)))
		f.node.refused(connect.CodeInvalidArgument, "data")
		require.Equal(t, "the node's tunnel stream broke", f.api.nextClose())
	})
}

// TestTunnelTicketRefusals: the control stream's ticket must verify with
// the tunnel-ticket key, be unexpired, unseen, and name the start's tunnel
// and a node whose session this gateway holds.
func TestTunnelTicketRefusals(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	start := func(tk, id string) *gatewayv1.TunnelStart { return &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk} }

	t.Run("forged", func(t *testing.T) {
		e := e.in(t)
		_, other, err := ed25519.GenerateKey(rand.Reader)
		require.NoError(t, err)
		tk, id := e.ticket(n.id, ticketOpts{key: other})
		e.openAPI(g, start(tk, id)).refused(connect.CodeUnauthenticated, "tunnel ticket refused: ticket signature is not valid")
	})
	t.Run("expired", func(t *testing.T) {
		e := e.in(t)
		tk, id := e.ticket(n.id, ticketOpts{expires: realClock.Now().Add(-time.Second)})
		e.openAPI(g, start(tk, id)).refused(connect.CodeUnauthenticated, "tunnel ticket refused: ticket expired")
	})
	t.Run("malformed", func(t *testing.T) {
		e := e.in(t)
		e.openAPI(g, start("bctk_nonsense", "tkt_1")).refused(connect.CodeUnauthenticated, "tunnel ticket refused: ticket is malformed")
	})
	t.Run("another tunnel's id", func(t *testing.T) {
		e := e.in(t)
		tk, _ := e.ticket(n.id, ticketOpts{})
		e.openAPI(g, start(tk, "tkt_other")).refused(connect.CodeInvalidArgument, "start.tunnel_id is not the ticket's tunnel")
	})
	t.Run("used twice", func(t *testing.T) {
		e := e.in(t)
		tk, id := e.ticket(n.id, ticketOpts{})
		first := e.openAPI(g, start(tk, id))
		require.Equal(t, id, d.next().GetOpenTunnel().GetTunnelId())
		e.openAPI(g, start(tk, id)).refused(connect.CodeUnauthenticated, "ticket was used already")
		// The first goes on: it opens once the node dials back.
		f := &tunnelFixture{api: first, node: e.dialNode(g, n, id)}
		requireOpen(t, f)
		// And a ticket is refused again after its tunnel closed.
		f.api.sendClose("done")
		require.Equal(t, "done", f.node.nextClose())
		e.openAPI(g, start(tk, id)).refused(connect.CodeUnauthenticated, "ticket was used already")
	})
	t.Run("node without a session here", func(t *testing.T) {
		e := e.in(t)
		away := e.newNode()
		tk, id := e.ticket(away.id, ticketOpts{})
		e.openAPI(g, start(tk, id)).refused(connect.CodeFailedPrecondition, "node "+away.id+" has no live session on this gateway")
	})
	t.Run("node on another gateway", func(t *testing.T) {
		e := e.in(t)
		other := e.startGateway(gateway.Config{GatewayID: "gw-other", ResyncInterval: time.Hour})
		there := e.newNode()
		e.connect(other, there, nil)
		tk, id := e.ticket(there.id, ticketOpts{})
		e.openAPI(g, start(tk, id)).refused(connect.CodeFailedPrecondition, "node "+there.id+" has no live session on this gateway")
	})
	t.Run("start first", func(t *testing.T) {
		e := e.in(t)
		e.openAPI(g, nil).refused(connect.CodeInvalidArgument, "the first message of a tunnel must be start")
	})
}

func TestTunnelNotConfigured(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	require.NoError(t, os.Remove(filepath.Join(e.pkiDir, pki.TunnelTicketPub)))
	g := e.startGateway(noResync)
	n := e.newNode()
	e.connect(g, n, nil)
	tk, id := e.ticket(n.id, ticketOpts{})
	e.openAPI(g, &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk}).refused(connect.CodeFailedPrecondition, "tunnels are not configured: ")
}

func TestTunnelNodeNeverDialsBack(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour, TunnelOpenTimeout: 300 * time.Millisecond})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	tk, id := e.ticket(n.id, ticketOpts{})
	api := e.openAPI(g, &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk})
	require.Equal(t, id, d.next().GetOpenTunnel().GetTunnelId())
	api.refused(connect.CodeDeadlineExceeded, "node "+n.id+" did not open the tunnel")
	// Too late: the tunnel is gone.
	e.dialNode(g, n, id).refused(connect.CodeNotFound, "tunnel "+id+" is not pending on this gateway")
}

func TestTunnelsPerNode(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour, TunnelsPerNode: 2})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	first := e.openTunnelTo(g, n, d, nil)
	e.openTunnelTo(g, n, d, nil)
	tk, id := e.ticket(n.id, ticketOpts{})
	e.openAPI(g, &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk}).refused(connect.CodeResourceExhausted,
		"node "+n.id+" has 2 tunnels through this gateway, the most allowed")
	// A closed tunnel makes room.
	first.api.sendClose("done")
	require.Equal(t, "done", first.node.nextClose())
	require.NoError(t, first.api.ended())
	third := e.openTunnelTo(g, n, d, nil)
	requireOpen(t, third)
}

// TestNodeTunnelRefusals: a daemon's tunnel stream names a tunnel pending
// for its own node, with a certificate that could open its session.
func TestNodeTunnelRefusals(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n, other := e.newNode(), e.newNode()
	d, _ := e.connect(g, n, nil)
	e.connect(g, other, nil)
	tk, id := e.ticket(n.id, ticketOpts{})
	api := e.openAPI(g, &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk})
	require.Equal(t, id, d.next().GetOpenTunnel().GetTunnelId())

	t.Run("another node's tunnel", func(t *testing.T) {
		e := e.in(t)
		e.dialNode(g, other, id).refused(connect.CodePermissionDenied, "tunnel "+id+" is another node's")
	})
	t.Run("unknown tunnel", func(t *testing.T) {
		e := e.in(t)
		e.dialNode(g, n, "tkt_unknown").refused(connect.CodeNotFound, "tunnel tkt_unknown is not pending on this gateway")
	})
	t.Run("unknown certificate", func(t *testing.T) {
		e := e.in(t)
		stranger := e.newUnrecordedNode()
		e.dialNode(g, stranger, id).refused(connect.CodeUnauthenticated, "the client certificate is not known")
	})
	t.Run("start first", func(t *testing.T) {
		e := e.in(t)
		e.dialNodeStart(g, n, nil).refused(connect.CodeInvalidArgument, "the first message of a tunnel must be start")
	})
	t.Run("attached twice", func(t *testing.T) {
		e := e.in(t)
		f := &tunnelFixture{api: api, node: e.dialNode(g, n, id)}
		requireOpen(t, f)
		e.dialNode(g, n, id).refused(connect.CodeAlreadyExists, "tunnel "+id+" is open already")
		requireOpen(t, f)
	})
}

// TestSessionEndClosesTunnels: a tunnel lives no longer than the session
// that carried its OpenTunnel, and both ends learn why it closed.
func TestSessionEndClosesTunnels(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	e.relay()
	g := e.startGateway(noResync)

	t.Run("stream end", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		require.NoError(t, f.daemon.stream.CloseRequest())
		require.Equal(t, "the node's session ended", f.api.nextClose())
		require.Equal(t, "the node's session ended", f.node.nextClose())
		require.NoError(t, f.api.ended())
		require.NoError(t, f.node.ended())
	})
	t.Run("revoked", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		e.revoke(f.n.id)
		require.Equal(t, "the node's session ended: certificate revoked", f.api.nextClose())
		require.Equal(t, "the node's session ended: certificate revoked", f.node.nextClose())
	})
	t.Run("superseded", func(t *testing.T) {
		e := e.in(t)
		f := e.openTunnel(g, nil)
		d2, _ := e.connect(g, f.n, &gatewayv1.Hello{NodeId: f.n.id, BootId: "boot-2"})
		want := "the node's session ended: session superseded by a newer session of this node"
		require.Equal(t, want, f.api.nextClose())
		require.Equal(t, want, f.node.nextClose())
		// The new session carries new tunnels.
		requireOpen(t, e.openTunnelTo(g, f.n, d2, nil))
	})
	t.Run("pending", func(t *testing.T) {
		e := e.in(t)
		n := e.newNode()
		d, _ := e.connect(g, n, nil)
		tk, id := e.ticket(n.id, ticketOpts{})
		api := e.openAPI(g, &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk})
		require.Equal(t, id, d.next().GetOpenTunnel().GetTunnelId())
		require.NoError(t, d.stream.CloseRequest())
		require.Equal(t, "the node's session ended", api.nextClose())
		require.NoError(t, api.ended())
		e.dialNode(g, n, id).refused(connect.CodeNotFound, "is not pending on this gateway")
	})
}

func TestShutdownClosesTunnels(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	open := e.openTunnel(g, nil)
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	tk, id := e.ticket(n.id, ticketOpts{})
	pending := e.openAPI(g, &gatewayv1.TunnelStart{TunnelId: id, Ticket: tk})
	require.Equal(t, id, d.next().GetOpenTunnel().GetTunnelId())

	g.stop()
	require.Equal(t, "gateway shutting down", open.api.nextClose())
	require.Equal(t, "gateway shutting down", open.node.nextClose())
	require.Equal(t, "gateway shutting down", pending.nextClose())
	require.NoError(t, open.api.ended())
	require.NoError(t, open.node.ended())
	require.NoError(t, pending.ended())
}

func TestGatewayRegistersControlURL(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{GatewayID: "gw-ctl", ResyncInterval: time.Hour})
	route := func() store.TunnelRoute {
		n := e.newNode()
		e.connect(g, n, nil)
		r, err := store.NodeTunnelRoute(t.Context(), e.db.Pool, n.id, e.db.Now())
		require.NoError(t, err)
		return r
	}()
	require.Equal(t, "gw-ctl", route.GatewayID)
	require.Equal(t, g.controlURL, route.ControlURL, "the URL of the control listener, on its IP")
	require.True(t, strings.HasPrefix(route.ControlURL, "http://127.0.0.1:"), route.ControlURL)

	// A URL set in the configuration is recorded as it is.
	e.startGateway(gateway.Config{GatewayID: "gw-url", ControlURL: "http://gw-url.internal:8086", ResyncInterval: time.Hour})
	var url string
	eventually(t, func() bool {
		return e.db.Pool.QueryRow(t.Context(), `SELECT control_url FROM gateways WHERE id = 'gw-url'`).Scan(&url) == nil
	}, "the gateway registered")
	require.Equal(t, "http://gw-url.internal:8086", url)
}

func TestBadControlURL(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	_, err := gateway.New(gateway.Config{PKI: service.PKI{PKIDir: e.pkiDir}, ControlURL: "gw:8086"}, gateway.Deps{DB: e.db, NC: e.nc})
	require.ErrorContains(t, err, "BETTER_COMPUTE_CONTROL_URL")
}

// TestSSHRefusalIsRecorded: an SshRefused report becomes a node.ssh_refused
// event with its strings as sent, at their longest, and the session goes
// on (one that breaks gateway.proto's bounds ends the session:
// TestInvalidSessionMessageEndsOnlyThatSession).
func TestSSHRefusalIsRecorded(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, w := e.connect(g, n, nil)
	reason := "unknown CA " + strings.Repeat("é", 1024-len("unknown CA "))
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
		Report: &gatewayv1.Report_SshRefused{SshRefused: &gatewayv1.SshRefused{Reason: reason, KeyId: "key-1",
			User: "root"}}}}})
	var data []byte
	eventually(t, func() bool {
		return e.db.Pool.QueryRow(t.Context(), `SELECT data FROM events WHERE type = $1 AND subject_id = $2`,
			store.EventNodeSSHRefused, n.id).Scan(&data) == nil
	}, "ssh refusal recorded")
	var got store.NodeSSHRefusedData
	require.NoError(t, json.Unmarshal(data, &got))
	require.Equal(t, n.id, got.NodeID)
	require.Equal(t, "key-1", got.KeyID)
	require.Equal(t, "root", got.User)
	require.Equal(t, reason, got.Reason)
	d.heartbeat(1, 0)
	require.Equal(t, int64(1), d.nextAck())
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID)
}
