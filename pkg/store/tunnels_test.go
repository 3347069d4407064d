package store_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func TestConsumeTunnelTicket(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	node := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted}).ID
	other := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted}).ID
	tok := storetest.APIToken(t, db, nil).ID
	tok2 := storetest.APIToken(t, db, nil).ID
	limits := store.TunnelLimits{PerNode: 2, PerToken: 2}
	consume := func(id string) (store.TunnelTicket, error) {
		var got store.TunnelTicket
		err := db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			got, err = store.ConsumeTunnelTicket(ctx, tx, id, clk.Now(), limits)
			return err
		})
		return got, err
	}
	ticket := func(node, token string) string {
		return storetest.TunnelTicket(t, db, &storetest.TunnelTicketOpts{NodeID: node, TokenID: token}).ID
	}

	first := ticket(node, tok)
	got, err := consume(first)
	require.NoError(t, err)
	require.NotNil(t, got.ConsumedAt)
	_, err = consume(first)
	require.ErrorIs(t, err, store.ErrTicketUsed, "a ticket opens one tunnel")
	_, err = consume("tkt_missing")
	require.ErrorIs(t, err, store.ErrNotFound)

	late := ticket(node, tok)
	clk.Advance(time.Minute)
	_, err = consume(late)
	require.ErrorIs(t, err, store.ErrTicketExpired)

	// Two open per token: a third of tok's is refused, on any node.
	_, err = consume(ticket(other, tok))
	require.NoError(t, err)
	_, err = consume(ticket(other, tok))
	require.ErrorIs(t, err, store.ErrTunnelLimit)
	require.ErrorContains(t, err, "the token has 2 open tunnels")
	// Two open on node: another token's third on it is refused.
	_, err = consume(ticket(node, tok2))
	require.NoError(t, err)
	_, err = consume(ticket(node, tok2))
	require.ErrorContains(t, err, "the node has 2 open tunnels")

	// A closed tunnel, or one not authorized for TunnelStale (its API
	// replica died), counts no more.
	require.NoError(t, store.CloseTunnel(ctx, db.Pool, first, clk.Now(), "exit 0"))
	closed, err := store.GetTunnelTicket(ctx, db.Pool, first)
	require.NoError(t, err)
	require.Equal(t, "exit 0", closed.CloseReason)
	_, err = consume(ticket(node, tok2))
	require.NoError(t, err, "the closed tunnel freed its place")
	clk.Advance(store.TunnelStale + time.Second)
	_, err = consume(ticket(node, tok2))
	require.NoError(t, err, "stale tunnels count no more")
}

func TestNodeTunnelRoute(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	now := db.Now()
	node := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted, GatewayID: "gw-a", SessionID: "ses_1"}).ID
	idle := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted}).ID
	r, err := store.NodeTunnelRoute(ctx, db.Pool, node, now)
	require.NoError(t, err)
	require.Equal(t, store.TunnelRoute{GatewayID: "gw-a"}, r, "no control URL, no presence yet")
	require.NoError(t, store.RegisterGateway(ctx, db.Pool, "gw-a", "http://gw-a:8086", now))
	require.NoError(t, store.RecordGatewayPresence(ctx, db.Pool, now, "gw-a", time.Minute))
	r, err = store.NodeTunnelRoute(ctx, db.Pool, node, now)
	require.NoError(t, err)
	require.Equal(t, store.TunnelRoute{GatewayID: "gw-a", ControlURL: "http://gw-a:8086", Present: true}, r)
	r, err = store.NodeTunnelRoute(ctx, db.Pool, node, now.Add(2*time.Minute))
	require.NoError(t, err)
	require.False(t, r.Present, "the gateway's presence expired")
	r, err = store.NodeTunnelRoute(ctx, db.Pool, idle, now)
	require.NoError(t, err)
	require.Equal(t, store.TunnelRoute{}, r)
	_, err = store.NodeTunnelRoute(ctx, db.Pool, "node_missing", now)
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestSetSSHUserCAs(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	now := db.Now()
	adopted := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted, SpecGeneration: 1,
		Spec: `{"labels": {"pool": "p"}}`}).ID
	joining := storetest.Node(t, db, nil).ID
	cas := []*gatewayv1.SshUserCa{{Name: "sandbox", PublicKey: "ssh-ed25519 AAAAsandbox"},
		{Name: "break-glass", PublicKey: "ssh-ed25519 AAAAbreak"}}
	set := func(cas []*gatewayv1.SshUserCa) bool {
		var changed bool
		require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			changed, err = store.SetSSHUserCAs(ctx, tx, nil, now, cas)
			return err
		}))
		return changed
	}
	spec := func(id string) (int64, *gatewayv1.NodeSpec) {
		n, err := store.GetNode(ctx, db.Pool, store.AllTenants, id)
		require.NoError(t, err)
		var raw []byte
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT spec FROM nodes WHERE id = $1`, id).Scan(&raw))
		ns := &gatewayv1.NodeSpec{}
		require.NoError(t, protojson.Unmarshal(raw, ns))
		return n.SpecGeneration, ns
	}

	require.True(t, set(cas))
	gen, ns := spec(adopted)
	require.EqualValues(t, 2, gen, "a new set of CAs is a new generation")
	require.Len(t, ns.SshUserCas, 2)
	require.Equal(t, "break-glass", ns.SshUserCas[0].Name, "by name")
	require.Equal(t, "p", ns.Labels["pool"], "labels are kept")
	gen, _ = spec(joining)
	require.EqualValues(t, 0, gen, "a node not adopted has no spec yet")

	require.False(t, set([]*gatewayv1.SshUserCa{cas[1], cas[0]}), "the same CAs change nothing")
	gen, _ = spec(adopted)
	require.EqualValues(t, 2, gen)

	rotated := []*gatewayv1.SshUserCa{{Name: "break-glass", PublicKey: "ssh-ed25519 AAAAnew"}, cas[0]}
	require.True(t, set(rotated))
	gen, ns = spec(adopted)
	require.EqualValues(t, 3, gen, "a rotation is a new generation")
	require.Equal(t, "ssh-ed25519 AAAAnew", ns.SshUserCas[0].PublicKey)
	got, err := store.SSHUserCAs(ctx, db.Pool)
	require.NoError(t, err)
	require.Len(t, got, 2)
}
