package api_test

import (
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/api/api"
)

func TestRunCommand(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	node := f.node(t, f.acmePool, 1, "H100", adopted)
	run := func(c clients, req *computev1.RunCommandRequest) (*computev1.Command, error) {
		res, err := c.commands.RunCommand(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		return res.Msg.Command, nil
	}

	before := clock.New().Now()
	c, err := run(admin, &computev1.RunCommandRequest{NodeId: node, Kind: "node.reboot", RequestId: "reboot-1"})
	require.NoError(t, err)
	require.Equal(t, "queued", c.State)
	require.Equal(t, node, c.NodeId)
	require.False(t, c.RetrySafe)
	require.Equal(t, "reboot-1", c.RequestId)
	deadline := c.Deadline.AsTime()
	require.WithinDuration(t, before.Add(5*time.Minute), deadline, 10*time.Second, "default timeout is 5 min")

	// A retry with the same request id returns the same command.
	again, err := run(admin, &computev1.RunCommandRequest{NodeId: node, Kind: "node.reboot", RequestId: "reboot-1"})
	require.NoError(t, err)
	require.Equal(t, c.Id, again.Id)
	// The same request id for another kind is refused.
	_, err = run(admin, &computev1.RunCommandRequest{NodeId: node, Kind: "diag.nvml", RequestId: "reboot-1"})
	requireCode(t, err, connect.CodeAlreadyExists, "request_id: already used for node.reboot command")

	diag, err := run(f.as(f.tokens["root"]), &computev1.RunCommandRequest{NodeId: node, Kind: "diag.nvml",
		Timeout: durationpb.New(30 * time.Second)})
	require.NoError(t, err)
	require.True(t, diag.RetrySafe)
	require.WithinDuration(t, before.Add(30*time.Second), diag.Deadline.AsTime(), 10*time.Second)

	// An explicit timeout must be 1 s to 24 h: zero is not "the default"
	// (only an unset timeout is), and neither negative nor sub-second ones
	// make sense.
	for _, d := range []time.Duration{25 * time.Hour, 0, -time.Second, 500 * time.Millisecond} {
		_, err = run(admin, &computev1.RunCommandRequest{NodeId: node, Kind: "diag.nvml", Timeout: durationpb.New(d)})
		requireCode(t, err, connect.CodeInvalidArgument, "timeout")
	}

	// Nodes that cannot run commands.
	joining := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})
	_, err = run(admin, &computev1.RunCommandRequest{NodeId: joining, Kind: "diag.nvml"})
	requireCode(t, err, connect.CodeFailedPrecondition, "is not adopted (it is joining)")
	revoked := f.node(t, f.acmePool, 1, "H100", storetest.NodeOpts{State: store.NodeAdopted, RevokedAt: f.db.Now()})
	_, err = run(admin, &computev1.RunCommandRequest{NodeId: revoked, Kind: "diag.nvml"})
	requireCode(t, err, connect.CodeFailedPrecondition, "is revoked")
	otherNode := f.node(t, f.otherPool, 1, "H100", adopted)
	_, err = run(admin, &computev1.RunCommandRequest{NodeId: otherNode, Kind: "diag.nvml"})
	requireCode(t, err, connect.CodeNotFound, "node "+otherNode+" not found")

	// Get and List are scoped to the tenant.
	viewer := f.as(f.tokens["acme-viewer"])
	got, err := viewer.commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{CommandId: c.Id}))
	require.NoError(t, err)
	require.Equal(t, "node.reboot", got.Msg.Command.Kind)
	_, err = f.as(f.tokens["other-viewer"]).commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{CommandId: c.Id}))
	requireCode(t, err, connect.CodeNotFound, "command "+c.Id+" not found")

	page, err := viewer.commands.ListCommands(ctx, connect.NewRequest(&computev1.ListCommandsRequest{PageSize: 1}))
	require.NoError(t, err)
	require.Len(t, page.Msg.Commands, 1)
	require.Equal(t, diag.Id, page.Msg.Commands[0].Id, "newest first")
	require.Equal(t, diag.Id, page.Msg.NextPageToken)
	rest, err := viewer.commands.ListCommands(ctx, connect.NewRequest(&computev1.ListCommandsRequest{PageSize: 5,
		PageToken: page.Msg.NextPageToken}))
	require.NoError(t, err)
	require.Len(t, rest.Msg.Commands, 1)
	require.Equal(t, c.Id, rest.Msg.Commands[0].Id)
	require.Empty(t, rest.Msg.NextPageToken)
	none, err := f.as(f.tokens["other-admin"]).commands.ListCommands(ctx, connect.NewRequest(&computev1.ListCommandsRequest{}))
	require.NoError(t, err)
	require.Empty(t, none.Msg.Commands)

	// One audit row per successful call, naming the command.
	var audited int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM audit WHERE target = $1 AND outcome = 'ok'`,
		c.Id).Scan(&audited))
	require.Equal(t, 2, audited)
	var events int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM events WHERE type = 'command.queued' AND tenant_id = $1`,
		f.acme).Scan(&events))
	require.Equal(t, 2, events, "one command.queued per queued command, none for a retry")
}

// TestRunCommandPokesTheGateway: the gateway holding the node's session is
// poked on NATS as soon as the command is queued, by the API itself (no
// outbox relay runs here), and the outbox keeps its copy for the relay; the
// poke names that row (store.OutboxIDHeader), so that the gateway drops the
// relay's copy.
func TestRunCommandPokesTheGateway(t *testing.T) {
	t.Parallel()
	f := setup(t)
	nc := natsConn(t)
	f = f.withServer(t, api.WatchConfig{}, nc, nil)
	pokes := make(chan *nats.Msg, 4)
	sub, err := nc.ChanSubscribe(store.SubjectPokeGatewayPrefix+">", pokes)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())

	node := f.node(t, f.acmePool, 1, "H100", storetest.NodeOpts{State: store.NodeAdopted, GatewayID: "gw-7", SessionID: "ses_1"})
	res, err := f.as(f.tokens["acme-admin"]).commands.RunCommand(t.Context(),
		connect.NewRequest(&computev1.RunCommandRequest{NodeId: node, Kind: "diag.nvml"}))
	require.NoError(t, err)
	var m *nats.Msg
	require.Eventually(t, func() bool {
		select {
		case m = <-pokes:
			return true
		default:
			return false
		}
	}, 10*time.Second, 5*time.Millisecond, "no poke for the gateway of the node")
	require.Equal(t, store.SubjectPokeGatewayPrefix+"gw-7", m.Subject)
	var p store.Poke
	require.NoError(t, json.Unmarshal(m.Data, &p))
	require.Equal(t, []string{node}, p.NodeIDs)
	var outboxed int
	var row int64
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT count(*), max(id) FROM outbox WHERE subject = $1`,
		store.SubjectPokeGatewayPrefix+"gw-7").Scan(&outboxed, &row))
	require.Equal(t, 1, outboxed, "the relay's copy")
	require.Equal(t, strconv.FormatInt(row, 10), m.Header.Get(store.OutboxIDHeader), "the poke names its outbox row")
	require.NotEmpty(t, res.Msg.Command.Id)
}
