package api_test

import (
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
)

// blanks are free texts with nothing in them but spaces (ASCII, no-break,
// ideographic), and the empty string.
var blanks = []string{"", " ", "   ", "\u00a0", " \u3000 "}

// TestCordonReasonNotBlank: a cordon reason of spaces only is
// InvalidArgument naming reason, and leaves the node uncordoned; a reason
// with spaces around it is stored without them.
func TestCordonReasonNotBlank(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	node := f.node(t, f.acmePool, 1, "H100", adopted)
	for _, reason := range blanks {
		_, err := admin.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: node, Reason: reason}))
		requireCode(t, err, connect.CodeInvalidArgument, "reason: must not be empty or only spaces")
	}
	got, err := admin.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: node}))
	require.NoError(t, err)
	require.False(t, got.Msg.Node.Cordoned)

	res, err := admin.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: node, Reason: "  fan noise \u00a0"}))
	require.NoError(t, err)
	require.True(t, res.Msg.Node.Cordoned)
	require.Equal(t, "fan noise", res.Msg.Node.CordonReason)
	var detail string
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT detail FROM audit WHERE target = $1 AND outcome = 'ok'`, node).Scan(&detail))
	require.Equal(t, "cordoned: fan noise", detail)
}

// TestRevokeReasonTrimmed: the optional reason of RevokeNode is trimmed, so
// one of spaces only is no reason (not ": " and blanks in the audit log and
// the failed reservations' reason).
func TestRevokeReasonTrimmed(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	blank := f.node(t, f.acmePool, 1, "H100", adopted)
	spaced := f.node(t, f.acmePool, 1, "H100", adopted)
	_, err := admin.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: blank, Reason: "   "}))
	require.NoError(t, err)
	_, err = admin.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: spaced, Reason: " stolen  "}))
	require.NoError(t, err)
	detail := func(node string) string {
		var d string
		require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT detail FROM audit WHERE target = $1 AND outcome = 'ok'`, node).Scan(&d))
		return d
	}
	require.Equal(t, "revoked 0 certificate(s), failed 0 reservation(s)", detail(blank))
	require.Equal(t, "revoked 0 certificate(s), failed 0 reservation(s): stolen", detail(spaced))
}

// TestTokenNameNotBlank: an API token's name of spaces only is
// InvalidArgument naming name, and mints nothing; a name with spaces around
// it is stored without them.
func TestTokenNameNotBlank(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	for _, name := range blanks {
		_, err := admin.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: name, Role: "viewer",
			TtlSeconds: 3600}))
		requireCode(t, err, connect.CodeInvalidArgument, "name: must not be empty or only spaces")
	}
	res, err := admin.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: " ci ", Role: "viewer",
		TtlSeconds: 3600}))
	require.NoError(t, err)
	require.Equal(t, "ci", res.Msg.Token.Name)
	list, err := admin.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{}))
	require.NoError(t, err)
	var names []string
	for _, tok := range list.Msg.Tokens {
		names = append(names, tok.Name)
	}
	require.Contains(t, names, "ci")
	for _, b := range blanks {
		require.NotContains(t, names, b)
	}
}
