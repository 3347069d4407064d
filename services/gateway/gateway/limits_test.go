package gateway_test

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

// TestSessionMessageLimit sends a message beyond service.MaxMessageBytes on
// one session, plainly and as a gzip bomb (a small compressed message that
// inflates far beyond the limit): each stream ends ResourceExhausted, and
// another session on the same gateway stays up.
func TestSessionMessageLimit(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{})
	bystander, _ := e.connect(g, e.newNode(), nil)

	for _, tc := range []struct {
		name string
		size int
		opts []connect.ClientOption
		// says is what the error must say: the gzip bomb is refused as
		// soon as it inflates beyond the limit, not after it was inflated
		// whole.
		says string
	}{
		{name: "8 MiB", size: 8 << 20, says: "larger than configured max"},
		{name: "gzip bomb", size: 64 << 20, opts: []connect.ClientOption{connect.WithSendGzip()}, says: "inflates beyond"},
	} {
		n := e.newNode()
		d, _ := e.connectWith(e.clientWith(g, n.cert, tc.opts...), &gatewayv1.Hello{NodeId: n.id, BootId: "boot-1"})
		huge := &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{
			CommandId: "cmd_huge", State: gatewayv1.CommandState_COMMAND_STATE_FAILED, Error: strings.Repeat("x", tc.size)}}}
		_ = d.stream.Send(huge) // the gateway may end the stream before it has read it all
		err := d.ended()
		require.Equal(t, connect.CodeResourceExhausted, connectCode(err), "%s: %v", tc.name, err)
		require.Contains(t, err.Error(), tc.says, tc.name)
	}

	bystander.heartbeat(7, 0)
	require.Equal(t, int64(7), bystander.nextAck(), "the other session is up")
	require.Equal(t, 1, g.srv.Sessions())
}

// TestStreamsOutliveRequestTimeout checks that a session and a tunnel,
// long-lived streams, last past several of the servers' HTTPRequestTimeout,
// which bounds the gateway's unary requests only.
func TestStreamsOutliveRequestTimeout(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	f := e.openTunnel(g, nil)
	<-realClock.NewTimer(4 * requestTimeout).C()
	f.daemon.heartbeat(1, 0)
	require.Equal(t, int64(1), f.daemon.nextAck(), "the session is up")
	requireOpen(t, f)
}
