package api_test

import (
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// TestRevokeNode: a tenant admin revokes its tenant's node (certificates,
// node, poke of the gateway holding its session); the node shows
// revoked_at and cert_not_after; revoking again changes nothing; callers
// without fleet.manage, and another tenant's admin, cannot.
func TestRevokeNode(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	now := f.db.Now()
	acmeNode := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{GatewayID: "gw-a", SessionID: "ses_1"})
	otherNode := f.node(t, f.otherPool, 0, "", storetest.NodeOpts{})
	for i, notAfter := range []time.Time{now.Add(time.Hour), now.Add(3 * time.Hour)} {
		storetest.NodeCert(t, f.db, &storetest.NodeCertOpts{NodeID: acmeNode, Serial: acmeNode + "-" + string(rune('a'+i)),
			NotBefore: now, NotAfter: notAfter, CreatedAt: now})
	}
	revoke := func(who, id string) (*computev1.RevokeNodeResponse, error) {
		res, err := f.as(f.tokens[who]).nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: id, Reason: "stolen"}))
		if err != nil {
			return nil, err
		}
		return res.Msg, nil
	}

	got, err := f.as(f.tokens["acme-viewer"]).nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: acmeNode}))
	require.NoError(t, err)
	require.Nil(t, got.Msg.GetNode().GetRevokedAt())
	require.True(t, got.Msg.GetNode().GetCertNotAfter().AsTime().Equal(now.Add(3*time.Hour)), "the newest certificate")

	for _, who := range []string{"acme-viewer", "acme-member"} {
		_, err := revoke(who, acmeNode)
		requireCode(t, err, connect.CodePermissionDenied, "RevokeNode")
	}
	_, err = revoke("acme-admin", otherNode)
	requireCode(t, err, connect.CodeNotFound, "node "+otherNode+" not found")
	_, err = revoke("acme-admin", "node_missing")
	requireCode(t, err, connect.CodeNotFound, "node node_missing not found")
	_, err = revoke("acme-admin", "")
	requireCode(t, err, connect.CodeInvalidArgument, "node_id")
	_, err = f.as("").nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: acmeNode}))
	requireCode(t, err, connect.CodeUnauthenticated, "")
	var revokedCerts int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM node_certs WHERE revoked_at IS NOT NULL`).Scan(&revokedCerts))
	require.Zero(t, revokedCerts, "refused calls revoked nothing")

	res, err := revoke("acme-admin", acmeNode)
	require.NoError(t, err)
	require.EqualValues(t, 2, res.GetCertificatesRevoked())
	require.NotNil(t, res.GetNode().GetRevokedAt())
	require.Equal(t, acmeNode, res.GetNode().GetId())
	require.NotNil(t, res.GetNode().GetCertNotAfter())
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM node_certs WHERE node_id = $1 AND revoked_at IS NOT NULL`,
		acmeNode).Scan(&revokedCerts))
	require.Equal(t, 2, revokedCerts)
	var pokes int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE subject = $1`,
		store.SubjectPokeGatewayPrefix+"gw-a").Scan(&pokes))
	require.Equal(t, 1, pokes, "the gateway holding the session is poked")

	again, err := revoke("acme-admin", acmeNode)
	require.NoError(t, err)
	require.Zero(t, again.GetCertificatesRevoked())
	require.True(t, again.GetNode().GetRevokedAt().AsTime().Equal(res.GetNode().GetRevokedAt().AsTime()))

	got, err = f.as(f.tokens["acme-viewer"]).nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: acmeNode}))
	require.NoError(t, err)
	require.True(t, got.Msg.GetNode().GetRevokedAt().AsTime().Equal(res.GetNode().GetRevokedAt().AsTime()))

	// Root revokes any tenant's node.
	res, err = revoke("root", otherNode)
	require.NoError(t, err)
	require.NotNil(t, res.GetNode().GetRevokedAt())
	require.Zero(t, res.GetCertificatesRevoked(), "it had no certificate")
}

// TestCordonAnswers: CordonNode says whether the node was cordoned and with
// which reason, and writes node.cordoned only when the reason changes;
// UncordonNode says whether anything changed; a revoked node is not
// cordoned (FailedPrecondition naming it, no event).
func TestCordonAnswers(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	node := f.node(t, f.acmePool, 8, "H100", adopted)
	cordon := func(reason string) *computev1.CordonNodeResponse {
		res, err := admin.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: node, Reason: reason}))
		require.NoError(t, err)
		return res.Msg
	}
	uncordon := func() *computev1.UncordonNodeResponse {
		res, err := admin.nodes.UncordonNode(ctx, connect.NewRequest(&computev1.UncordonNodeRequest{NodeId: node}))
		require.NoError(t, err)
		return res.Msg
	}
	events := func() int {
		var n int
		require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM events WHERE subject_id = $1`, node).Scan(&n))
		return n
	}

	res := cordon("fan noise")
	require.True(t, res.GetChanged())
	require.False(t, res.GetAlreadyCordoned())
	require.Empty(t, res.GetPreviousReason())
	res = cordon("fan noise")
	require.False(t, res.GetChanged())
	require.True(t, res.GetAlreadyCordoned())
	require.Equal(t, "fan noise", res.GetPreviousReason())
	require.Equal(t, 1, events(), "the same reason writes no event")
	res = cordon("fan replaced")
	require.True(t, res.GetChanged())
	require.True(t, res.GetAlreadyCordoned())
	require.Equal(t, "fan noise", res.GetPreviousReason())
	require.Equal(t, "fan replaced", res.GetNode().GetCordonReason())
	require.Equal(t, 2, events())

	require.True(t, uncordon().GetChanged())
	require.False(t, uncordon().GetChanged())
	require.Equal(t, 3, events())

	_, err := admin.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: node}))
	require.NoError(t, err)
	before := events()
	_, err = admin.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: node, Reason: "x"}))
	requireCode(t, err, connect.CodeFailedPrecondition, "node "+node+" is revoked")
	require.Equal(t, before, events(), "no node.cordoned")
	got, err := admin.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: node}))
	require.NoError(t, err)
	require.False(t, got.Msg.GetNode().GetCordoned())
}
