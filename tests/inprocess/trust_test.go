package inprocess_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// shortCertTTL makes node certificates due for renewal 8 s after they are
// received: the daemon renews at two thirds of the lifetime counted from
// receipt (pki.IssueNode backdates NotBefore by only a tenth of the TTL, and
// the daemon counts from the later of NotBefore and receipt). Renewals then
// repeat every 8 s.
const shortCertTTL = 12 * time.Second

// adoptedMachine joins one simulated machine and waits until its node is
// adopted with generation 1 applied and the machine holds a session.
func (f *fixture) adoptedMachine(t *testing.T) (*agent.Machine, string) {
	t.Helper()
	ids := f.join(t, devstack.JoinOptions{Variant: fakehw.VariantHGXH100}, store.NodeAdopted)
	daemons := f.stack.Daemons()
	m := daemons[len(daemons)-1]
	require.Equal(t, ids[0], m.NodeID())
	require.Eventually(t, func() bool { return m.Status().SessionID != "" }, joinWithin, 100*time.Millisecond,
		"machine %d holds a session", m.Index())
	return m, ids[0]
}

func (f *fixture) liveSession(t *testing.T, nodeID string) string {
	t.Helper()
	var sid *string
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT session_id FROM nodes WHERE id = $1`, nodeID).Scan(&sid))
	if sid == nil {
		return ""
	}
	return *sid
}

// TestRenewalKeepsSessionAndRevocationEndsIt runs the real services and a
// simulated machine with short certificates:
//   - the certificate is renewed over the session without dropping it (same
//     session id before and after, also past the first certificate's
//     expiry), the new one is in node_certs, and the next dial presents it (revoking only the first certificate closes the
//     session, and the machine is back at once on a new one);
//   - revoking the node through the API closes its session within seconds,
//     and its reconnects are refused.
func TestRenewalKeepsSessionAndRevocationEndsIt(t *testing.T) {
	f := setupWith(t, devstack.Options{NodeCertTTL: shortCertTTL, ResyncInterval: time.Second})
	m, nodeID := f.adoptedMachine(t)
	ctx := t.Context()
	st := m.Status()
	require.Zero(t, st.Renewals)
	session, sessions := st.SessionID, st.Sessions
	require.Equal(t, session, f.liveSession(t, nodeID))
	var firstSerial string
	var firstNotAfter time.Time
	require.NoError(t, f.stack.DB.Pool.QueryRow(ctx, `SELECT serial, not_after FROM node_certs WHERE node_id = $1`, nodeID).
		Scan(&firstSerial, &firstNotAfter))

	require.Eventually(t, func() bool { return m.Status().Renewals >= 1 }, 30*time.Second, 50*time.Millisecond,
		"the certificate is renewed")
	st = m.Status()
	require.Equal(t, session, st.SessionID, "the renewal kept the session")
	require.Equal(t, sessions, st.Sessions, "no new session")
	require.Equal(t, session, f.liveSession(t, nodeID))
	var certs int
	var newest time.Time
	require.NoError(t, f.stack.DB.Pool.QueryRow(ctx, `SELECT count(*), max(not_after) FROM node_certs
		WHERE node_id = $1 AND revoked_at IS NULL`, nodeID).Scan(&certs, &newest))
	require.GreaterOrEqual(t, certs, 2, "the renewed certificate is in node_certs")
	require.False(t, newest.Before(st.CertNotAfter), "the machine's certificate is the newest one recorded")
	var onDisk agent.Identity
	b, err := os.ReadFile(filepath.Join(m.Dir(), agent.NodeFile))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &onDisk))
	require.True(t, onDisk.NotAfter.Equal(st.CertNotAfter) || onDisk.NotAfter.After(st.CertNotAfter),
		"the identity on disk holds the renewed certificate")

	// The session outlives the certificate it was opened with: the gateway
	// ends a session when the certificate renewed on it expires, not the
	// connection's (two resyncs past the first one's expiry here).
	require.Never(t, func() bool { return m.Status().SessionID != session },
		firstNotAfter.Sub(realClock.Now())+2*time.Second, 100*time.Millisecond,
		"the session renewed on goes on past the first certificate's expiry")
	require.Equal(t, session, f.liveSession(t, nodeID))

	// Only the first certificate is revoked: the session opened with it ends,
	// and the next dial, with the renewed certificate, is accepted. Raw SQL:
	// no store function revokes one certificate of a node alone.
	_, err = f.stack.DB.Pool.Exec(ctx, `UPDATE node_certs SET revoked_at = now() WHERE serial = $1`, firstSerial)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		s := m.Status()
		return s.State == daemon.StateEstablished && s.SessionID != "" && s.SessionID != session
	}, 20*time.Second, 50*time.Millisecond, "back on a new session with the renewed certificate")
	second := m.Status().SessionID
	require.Eventually(t, func() bool { return f.liveSession(t, nodeID) == second }, 10*time.Second, 50*time.Millisecond)

	// Revocation through the API.
	revokedAt := realClock.Now()
	res, err := f.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: nodeID, Reason: "test"}))
	require.NoError(t, err)
	require.GreaterOrEqual(t, res.Msg.GetCertificatesRevoked(), int32(1))
	require.Eventually(t, func() bool { return f.liveSession(t, nodeID) == "" && m.Status().SessionID == "" },
		5*time.Second, 20*time.Millisecond, "the revoked node's session is closed within seconds")
	t.Logf("session closed %s after the revocation", realClock.Now().Sub(revokedAt))
	// The condition runs on its own goroutine, which may still be querying
	// when Never returns: it must not touch t (nor the test's context).
	require.Never(t, func() bool {
		var sid *string
		err := f.stack.DB.Pool.QueryRow(context.Background(), `SELECT session_id FROM nodes WHERE id = $1`, nodeID).Scan(&sid)
		return (err == nil && sid != nil) || m.Status().SessionID != ""
	},
		3*time.Second, 50*time.Millisecond, "its reconnects are refused")
	// The refusal is terminal: the machine stopped for good and says so.
	require.Equal(t, daemon.StateStopped, m.Status().State)
	require.Contains(t, m.Status().Stopped, "was revoked")
	require.Contains(t, m.Status().Stopped, "must join again")
	n, err := f.getNode(ctx, nodeID)
	require.NoError(t, err)
	require.NotNil(t, n.GetRevokedAt())
}

// TestGatewayRenewsWithoutTheNodeCAKey: the gateways run on exactly their
// files of the PKI (pki.Layout), which hold no node CA key, and a machine's
// certificate is renewed all the same, twice (the second renewal resting on
// the first one's certificate, whose key signs its proof): JoinService
// signs renewals, through its NodeCertService, over mutual TLS.
func TestGatewayRenewsWithoutTheNodeCAKey(t *testing.T) {
	f := setupWith(t, devstack.Options{NodeCertTTL: shortCertTTL})
	dir := f.stack.ServicePKIDirs[pki.ServiceGateway]
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var files []string
	for _, e := range entries {
		files = append(files, e.Name())
	}
	want, err := pki.Layout(pki.ServiceGateway)
	require.NoError(t, err)
	require.Equal(t, want, files, "the gateways' PKI directory holds their files only")
	require.NotContains(t, files, pki.NodeCAKey)

	m, nodeID := f.adoptedMachine(t)
	require.Eventually(t, func() bool { return m.Status().Renewals >= 2 }, 40*time.Second, 50*time.Millisecond,
		"the certificate is renewed twice")
	nodeCA, err := pki.LoadCert(filepath.Join(f.stack.PKIDir, pki.NodeCACert))
	require.NoError(t, err)
	var onDisk agent.Identity
	b, err := os.ReadFile(filepath.Join(m.Dir(), agent.NodeFile))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &onDisk))
	cert, err := pki.ParseCertPEM([]byte(onDisk.CertificatePEM))
	require.NoError(t, err)
	require.NoError(t, cert.CheckSignatureFrom(nodeCA), "the renewed certificate is the node CA's")
	td, err := pki.ReadTrustDomain(f.stack.PKIDir)
	require.NoError(t, err)
	id, err := pki.NodeIDFromCert(cert, td)
	require.NoError(t, err)
	require.Equal(t, nodeID, id)
	var certs int
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT count(*) FROM node_certs WHERE node_id = $1`, nodeID).Scan(&certs))
	require.GreaterOrEqual(t, certs, 3, "the join's and two renewals' certificates are recorded")
}

func (f *fixture) getNode(ctx context.Context, id string) (*computev1.Node, error) {
	res, err := f.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: id}))
	if err != nil {
		return nil, err
	}
	return res.Msg.GetNode(), nil
}

// TestSignedIntentFleet runs the stack with signedIntent: a machine joins
// with the command-signing root and is adopted (its acceptance command and
// first NodeSpec verified), and a command written without a signature is
// refused by the daemon and reported failed, never run.
func TestSignedIntentFleet(t *testing.T) {
	f := setupWith(t, devstack.Options{SignedIntent: true})
	m, nodeID := f.adoptedMachine(t)
	ctx := t.Context()

	var onDisk agent.Identity
	b, err := os.ReadFile(filepath.Join(m.Dir(), agent.NodeFile))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &onDisk))
	require.NotEmpty(t, onDisk.CommandSigningRoot, "the machine holds the command-signing root")
	var signed int
	require.NoError(t, f.stack.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM commands WHERE node_id = $1
		AND state = 'succeeded' AND signature IS NOT NULL`, nodeID).Scan(&signed))
	require.Equal(t, 1, signed, "the signed acceptance command ran")

	// A writer that forgot to sign (the factory signs nothing).
	db := f.stack.DB
	cmdID := storetest.Command(t, db, &storetest.CommandOpts{NodeID: nodeID, Kind: store.CommandInventoryRefresh,
		Deadline: db.Now().Add(time.Minute)}).ID
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		return store.PokeNodes(ctx, tx, db.Now(), nodeID)
	}))
	var state, errText string
	require.Eventually(t, func() bool {
		return db.Pool.QueryRow(ctx, `SELECT state, error FROM commands WHERE id = $1`, cmdID).Scan(&state, &errText) == nil &&
			state == "failed"
	}, 20*time.Second, 50*time.Millisecond, "the unsigned command is refused: %s %s", &state, &errText)
	require.Contains(t, errText, "refused: ")
	require.Contains(t, errText, "signature")
}
