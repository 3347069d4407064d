package gateway_test

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
)

// The harness opens sessions over the framed transport (pkg/sessionwire),
// as daemons do; these tests cover the Connect transport beside it and what
// is the framed transport's own.

// TestSessionOverConnect: a session over Connect (HTTP/2) is served as a
// framed one: Welcome, heartbeats answered, a command delivered and its
// update stored; a framed session of the same node supersedes it, and a
// Connect one supersedes that.
func TestSessionOverConnect(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	hello := &gatewayv1.Hello{NodeId: n.id, BootId: "boot-1", AgentVersion: "test"}
	d, w := e.connectWith(e.client(g, n.cert), hello)
	require.NotEmpty(t, w.GetSessionId())
	d.heartbeat(1, 0)
	require.EqualValues(t, 1, d.nextAck())
	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	require.NoError(t, e.nc.Publish(store.SubjectPokeGatewayPrefix+"gw-test", mustJSON(t, store.Poke{NodeIDs: []string{n.id}})))
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, nil, "")
	eventually(t, func() bool { return e.command(cmdID).State == "succeeded" }, "the update over Connect is stored")

	framed, fw := e.connect(g, n, nil)
	require.Equal(t, connect.CodeAborted, connectCode(d.ended()), "the framed session supersedes the Connect one")
	require.Equal(t, fw.GetSessionId(), *e.nodeRow(n.id).SessionID)
	_, cw := e.connectWith(e.client(g, n.cert), hello)
	require.Equal(t, connect.CodeAborted, connectCode(framed.ended()), "a Connect session supersedes the framed one")
	require.Equal(t, cw.GetSessionId(), *e.nodeRow(n.id).SessionID)
}

// TestFramedMessageOverTheLimitEndsTheSession: a message above the limit
// of every handler (service.MaxMessageBytes) ends its session with
// ResourceExhausted, as on Connect, and clears it.
func TestFramedMessageOverTheLimitEndsTheSession(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	big := strings.Repeat("x", service.MaxMessageBytes)
	// The gateway may end the stream before the whole message is written.
	_ = d.stream.Send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{
		CommandId: "cmd_x", State: gatewayv1.CommandState_COMMAND_STATE_FAILED, Error: big}}})
	err := d.ended()
	require.Equal(t, connect.CodeResourceExhausted, connectCode(err), "%v", err)
	eventually(t, func() bool { return e.nodeRow(n.id).SessionID == nil }, "the session is cleared")
}
