package controllers_test

import (
	"crypto/ed25519"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

// delivered returns what the gateway sends a new session of nodeID (the
// fixture's nodes hold session "ses_<id>"): the open commands and the
// DesiredState, built as the gateway builds them.
func (f *fixture) delivered(t *testing.T, nodeID string) ([]*gatewayv1.Command, *gatewayv1.DesiredState) {
	t.Helper()
	claimed, err := store.ClaimSessionDeliveries(t.Context(), f.db.Pool, f.clk.Now(),
		[]store.ClaimRequest{{NodeID: nodeID, SessionID: "ses_" + nodeID, InFlight: true}})
	require.NoError(t, err)
	d := claimed[0]
	require.True(t, d.Current)
	var cmds []*gatewayv1.Command
	for _, c := range d.Commands {
		cmds = append(cmds, store.CommandMessage(c))
	}
	if d.Spec == nil {
		return cmds, nil
	}
	ds, err := store.DesiredStateMessage(d.SpecGeneration, d.Spec, d.SpecSignature)
	require.NoError(t, err)
	return cmds, ds
}

// TestSignedIntent: with SignedIntent, the acceptance commands (the first
// and the retried ones) and the adopted nodes' first NodeSpecs carry the
// command-signing root's signatures, which verify with the daemon's own
// check on what the gateway delivers, each for its own node only.
func TestSignedIntent(t *testing.T) {
	t.Parallel()
	f := setup(t)
	_, nc := startNATS(t)
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, start)
	require.NoError(t, err)
	pub, _, err := pki.LoadPublicKey(filepath.Join(dir, pki.CommandSigningPub))
	require.NoError(t, err)
	root := pub.(ed25519.PublicKey)

	srv, err := controllers.New(controllers.Config{Intent: service.Intent{SignedIntent: true}, PKI: service.PKI{PKIDir: dir}, Probes: service.Probes{NoHealthServer: true}},
		controllers.Deps{DB: f.db, NC: nc})
	require.NoError(t, err)
	acc := srv.Acceptance()
	acc.Clock = f.clk
	nodes := f.addNodes(t, h100Pool, "hgx-h100", 2)
	late := f.addNodes(t, h100Pool, "hgx-h100", 1)[0]
	res, err := acc.Reconcile(t.Context())
	require.NoError(t, err)
	require.Equal(t, 3, res.Started)

	for i, n := range nodes {
		cmds, _ := f.delivered(t, n)
		require.Len(t, cmds, 1)
		require.NotEmpty(t, cmds[0].GetSignature())
		require.Empty(t, daemon.VerifyCommand(root, n, cmds[0]), "the acceptance command verifies")
		require.Equal(t, daemon.ErrTextCommandBadSignature, daemon.VerifyCommand(root, nodes[1-i], cmds[0]), "for its node only")
	}

	// The late node's command runs out of time (it was delivered once): the
	// fresh one is signed too.
	cmds, _ := f.delivered(t, late)
	require.Len(t, cmds, 1)
	f.clk.Advance(controllers.DefaultAcceptanceTimeout + 1)
	f.succeedPastDeadline(t, "hgx-h100", nodes...)
	res, err = acc.Reconcile(t.Context())
	require.NoError(t, err)
	require.Equal(t, controllers.PassResult{Adopted: 2, Retried: 1}, res)

	retry, _ := f.delivered(t, late)
	require.Len(t, retry, 1)
	require.NotEqual(t, cmds[0].GetCommandId(), retry[0].GetCommandId())
	require.Empty(t, daemon.VerifyCommand(root, late, retry[0]))

	for _, n := range nodes {
		_, ds := f.delivered(t, n)
		require.NotNil(t, ds)
		require.EqualValues(t, 1, ds.GetGeneration())
		require.Equal(t, h100Pool, ds.GetSpec().GetLabels()[controllers.LabelPool])
		require.Empty(t, daemon.VerifySpec(root, n, ds), "the first NodeSpec verifies")
		require.Equal(t, daemon.ErrTextSpecBadSignature, daemon.VerifySpec(root, late, ds))
	}
}

// TestUnsignedIntentByDefault: without SignedIntent nothing is signed, and
// SignedIntent without the key fails at New.
func TestUnsignedIntentByDefault(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, cpuPool, "cpu", 1)[0]
	f.reconcile(t)
	cmds, _ := f.delivered(t, n)
	require.Len(t, cmds, 1)
	require.Empty(t, cmds[0].GetSignature())

	_, nc := startNATS(t)
	_, err := controllers.New(controllers.Config{Intent: service.Intent{SignedIntent: true}, PKI: service.PKI{PKIDir: t.TempDir()}, Probes: service.Probes{NoHealthServer: true}},
		controllers.Deps{DB: f.db, NC: nc})
	require.ErrorContains(t, err, pki.CommandSigningKey)
}
