package gateway_test

import (
	"crypto/tls"
	"crypto/x509"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

// closedWithin is how soon a revoked node's session must end.
const closedWithin = 5 * time.Second

// revoke revokes node id as the API does.
func (e *env) revoke(id string) {
	e.t.Helper()
	require.NoError(e.t, e.db.InTx(e.t.Context(), func(tx pgx.Tx) error {
		_, err := store.RevokeNode(e.t.Context(), tx, store.AllTenants, e.db.Now(), id, "test")
		return err
	}))
}

// requireRevokedEnd checks that d ends with Unauthenticated "certificate
// revoked" within closedWithin of since.
func requireRevokedEnd(t *testing.T, d *daemon, since time.Time) {
	t.Helper()
	err := d.ended()
	require.Less(t, realClock.Now().Sub(since), closedWithin, "closed within seconds")
	require.Equal(t, connect.CodeUnauthenticated, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "certificate revoked")
}

// TestRevokedNodeSessionClosedOnPoke: revoking a node closes its open
// session at once through the poke, and its reconnect is refused.
func TestRevokedNodeSessionClosedOnPoke(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	e.relay()
	g := e.startGateway(noResync)
	n, other := e.newNode(), e.newNode()
	d, _ := e.connect(g, n, nil)
	od, _ := e.connect(g, other, nil)

	start := realClock.Now()
	e.revoke(n.id)
	requireRevokedEnd(t, d, start)
	eventually(t, func() bool { return e.nodeRow(n.id).SessionID == nil }, "session cleared")

	d = e.open(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "boot-2"})
	err := d.ended()
	require.Equal(t, connect.CodeUnauthenticated, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "certificate revoked")
	require.Nil(t, e.nodeRow(n.id).SessionID)

	// The other node's session is untouched.
	od.heartbeat(1, 0)
	cmdID := e.queueCommand(other.id, "diag.nvml", "user")
	require.NoError(t, e.db.InTx(t.Context(), func(tx pgx.Tx) error { return store.PokeNodes(t.Context(), tx, e.db.Now(), other.id) }))
	require.Equal(t, cmdID, od.next().GetCommand().GetCommandId())
}

// TestRevokedSessionClosedByResync: without the poke (no relay), the
// periodic re-read closes the session of a revoked node, and of a node whose
// session certificate alone was revoked.
func TestRevokedSessionClosedByResync(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: 200 * time.Millisecond, IdleTimeout: time.Hour})
	n, c := e.newNode(), e.newNode()
	dn, _ := e.connect(g, n, nil)
	dc, _ := e.connect(g, c, nil)

	start := realClock.Now()
	e.revoke(n.id)
	// Raw SQL: one certificate of a node revoked alone, which no store
	// function does (RevokeNode revokes them all with the node).
	e.exec(`UPDATE node_certs SET revoked_at = $2 WHERE serial = $1`, certSerial(c), e.db.Now())
	requireRevokedEnd(t, dn, start)
	requireRevokedEnd(t, dc, start)
}

// renew sends a RenewCertificate with csr and returns the answer.
func (d *daemon) renew(csr []byte) *gatewayv1.CertificateIssued {
	d.t.Helper()
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_RenewCertificate{RenewCertificate: &gatewayv1.RenewCertificate{CsrDer: csr}}})
	ci := d.next().GetCertificateIssued()
	require.NotNil(d.t, ci, "CertificateIssued")
	return ci
}

func (e *env) certCount(nodeID string) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.db.Pool.QueryRow(e.t.Context(), `SELECT count(*) FROM node_certs WHERE node_id = $1`, nodeID).Scan(&n))
	return n
}

// TestRenewalKeepsTheSession: a RenewCertificate is answered with a node
// certificate for the new key, recorded in node_certs, while the session
// goes on; the new certificate opens the next session.
func TestRenewalKeepsTheSession(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	e.relay()
	// The node's certificate is recorded just before the renewal: no rate
	// limit here (TestRenewalRateLimitedPerNode).
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour, NodeCerts: service.NodeCerts{NodeCertTTL: 2 * time.Hour},
		RenewInterval: time.Millisecond})
	n := e.newNode()
	d, w := e.connect(g, n, nil)

	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(key, n.id)
	require.NoError(t, err)
	before := realClock.Now()
	ci := d.renew(csr)
	require.Empty(t, ci.GetError())
	cert, err := x509.ParseCertificate(ci.GetCertificateDer())
	require.NoError(t, err)
	require.True(t, key.PublicKey.Equal(cert.PublicKey), "for the CSR's key")
	id, err := pki.NodeIDFromCert(cert, e.trustDomain)
	require.NoError(t, err)
	require.Equal(t, n.id, id)
	require.WithinDuration(t, before.Add(2*time.Hour), cert.NotAfter, time.Minute, "NodeCertTTL")
	require.True(t, cert.NotAfter.Equal(ci.GetNotAfter().AsTime()))
	_, err = cert.Verify(x509.VerifyOptions{Roots: e.nodeCA.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err, "signed by the node CA")

	rec, err := store.GetSessionCert(t.Context(), e.db.Pool, pki.SerialHex(cert))
	require.NoError(t, err)
	require.Equal(t, n.id, rec.NodeID)
	require.Nil(t, rec.RevokedAt)
	require.True(t, rec.NotAfter.Equal(cert.NotAfter))

	// Same session: it still delivers, and the node's live session is it.
	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	require.NoError(t, e.db.InTx(t.Context(), func(tx pgx.Tx) error { return store.PokeNodes(t.Context(), tx, e.db.Now(), n.id) }))
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID)

	// The next dial with the new certificate opens a session.
	d.close()
	renewed := node{id: n.id, cert: tls.Certificate{Certificate: [][]byte{cert.Raw}, PrivateKey: key, Leaf: cert}}
	_, w2 := e.connect(g, renewed, nil)
	require.NotEqual(t, w.GetSessionId(), w2.GetSessionId())
	require.Equal(t, w2.GetSessionId(), *e.nodeRow(n.id).SessionID)
}

// TestRenewalRefusals: a CSR that does not parse or is not signed by its key,
// and any renewal of a revoked node, are refused with a reason and nothing is
// recorded. A bad CSR leaves the session going on; the delivery that answers
// a revoked node's renewal re-reads the node and then ends its session with
// Unauthenticated "certificate revoked", even without a poke or a resync.
func TestRenewalRefusals(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour})
	n := e.newNode()
	d, w := e.connect(g, n, nil)

	ci := d.renew([]byte("not a csr"))
	require.Empty(t, ci.GetCertificateDer())
	require.Contains(t, ci.GetError(), "csr_der")

	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(key, n.id)
	require.NoError(t, err)
	tampered := append([]byte(nil), csr...)
	tampered[len(tampered)-3] ^= 0xff // inside the signature
	ci = d.renew(tampered)
	require.Empty(t, ci.GetCertificateDer())
	require.Contains(t, ci.GetError(), "csr_der")
	require.Equal(t, 1, e.certCount(n.id))

	// The session goes on: it still answers, and is still the node's.
	d.heartbeat(1, 0)
	ci = d.renew([]byte("still not a csr"))
	require.Contains(t, ci.GetError(), "csr_der")
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID, "the refusals did not end the session")

	// Revoked while the session is open (no poke, no resync here): the
	// refusal reaches the daemon, then the session ends.
	start := realClock.Now()
	e.revoke(n.id)
	ci = d.renew(csr)
	require.Empty(t, ci.GetCertificateDer())
	require.Equal(t, "certificate revoked", ci.GetError())
	requireRevokedEnd(t, d, start)
	require.Equal(t, 1, e.certCount(n.id), "no certificate recorded")
	eventually(t, func() bool { return e.nodeRow(n.id).SessionID == nil }, "session cleared")
}

// TestSignaturesAreRelayedUntouched: the gateway sends commands and desired
// states with the signatures stored beside them.
func TestSignaturesAreRelayedUntouched(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNodeWith(storetest.NodeOpts{SpecGeneration: 1, Spec: `{"labels": {"a": "b"}}`, SpecSignature: []byte{3, 4}},
		time.Time{})
	cmdID := e.insertCommand(storetest.CommandOpts{NodeID: n.id, Kind: store.CommandDiagNVML, Signature: []byte{1, 2}})
	d, _ := e.connect(g, n, nil)
	c := d.next().GetCommand()
	require.Equal(t, cmdID, c.GetCommandId())
	require.Equal(t, []byte{1, 2}, c.GetSignature())
	ds := d.next().GetDesiredState()
	require.EqualValues(t, 1, ds.GetGeneration())
	require.Equal(t, map[string]string{"a": "b"}, ds.GetSpec().GetLabels())
	require.Equal(t, []byte{3, 4}, ds.GetSignature())
}

// TestSpecRefusalIsRecorded: a SpecRefused report becomes a
// node.spec_refused event and the session goes on.
func TestSpecRefusalIsRecorded(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, w := e.connect(g, n, nil)
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
		Report: &gatewayv1.Report_SpecRefused{SpecRefused: &gatewayv1.SpecRefused{Generation: 4, Reason: "refused: unsigned"}}}}})
	var data string
	eventually(t, func() bool {
		return e.db.Pool.QueryRow(t.Context(), `SELECT data::text FROM events WHERE type = $1 AND subject_id = $2`,
			store.EventNodeSpecRefused, n.id).Scan(&data) == nil
	}, "spec refusal recorded")
	require.JSONEq(t, `{"nodeId": "`+n.id+`", "generation": 4, "reason": "refused: unsigned"}`, data)
	d.heartbeat(1, 0)
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID)
}
