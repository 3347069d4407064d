package gateway_test

import (
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

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

// answersHeartbeats checks that the session still answers: it sends
// heartbeats until one is acknowledged, failing the test after waitFor. (A
// heartbeat that arrives while a delivery is being sent gets no ack of its
// own: ackHeartbeat skips it, the delivery being proof enough that the
// gateway lives.)
func (d *daemon) answersHeartbeats() {
	d.t.Helper()
	deadline := realClock.Now().Add(waitFor)
	for seq := int64(1000); realClock.Now().Before(deadline); seq++ {
		d.heartbeat(seq, 0)
		timer := realClock.NewTimer(200 * time.Millisecond)
	wait:
		for {
			select {
			case got := <-d.acks:
				if got == seq {
					timer.Stop()
					return
				}
			case <-timer.C():
				break wait
			}
		}
	}
	require.FailNow(d.t, "the session answers no heartbeat")
}

// renew sends a RenewCertificate with csr (and no proof) and returns the
// answer.
func (d *daemon) renew(csr []byte) *gatewayv1.CertificateIssued {
	d.t.Helper()
	return d.renewWith(&gatewayv1.RenewCertificate{CsrDer: csr})
}

// renewWith sends r and returns the answer.
func (d *daemon) renewWith(r *gatewayv1.RenewCertificate) *gatewayv1.CertificateIssued {
	d.t.Helper()
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_RenewCertificate{RenewCertificate: r}})
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

// TestRenewalKeepsTheSession: a RenewCertificate is relayed to JoinService
// (NodeCertService) with the session's node, client certificate serial and
// certificate, the CSR and the daemon's proof, and answered with the node
// certificate JoinService signed, while the session goes on; the new
// certificate opens the next session.
func TestRenewalKeepsTheSession(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	e.relay()
	e.certs.setTTL(2 * time.Hour)
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour})
	n := e.newNode()
	d, w := e.connect(g, n, nil)

	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(key, n.id)
	require.NoError(t, err)
	proof, err := pki.SignRenewal(n.cert.PrivateKey.(crypto.Signer), n.cert.Leaf, csr)
	require.NoError(t, err)
	before := realClock.Now()
	ci := d.renewWith(&gatewayv1.RenewCertificate{CsrDer: csr, Proof: proof})
	require.Empty(t, ci.GetError())
	require.True(t, proto.Equal(renewalOf(n.id, n.cert.Leaf, n.cert.Leaf, csr, proof), e.certs.last()), "relayed: %v", e.certs.last())
	cert, err := x509.ParseCertificate(ci.GetCertificateDer())
	require.NoError(t, err)
	require.True(t, key.PublicKey.Equal(cert.PublicKey), "for the CSR's key")
	id, err := pki.NodeIDFromCert(cert, e.trustDomain)
	require.NoError(t, err)
	require.Equal(t, n.id, id)
	require.WithinDuration(t, before.Add(2*time.Hour), cert.NotAfter, time.Minute, "JoinService's certificate")
	require.True(t, cert.NotAfter.Equal(ci.GetNotAfter().AsTime()))

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

// TestRenewalRefusals: JoinService's refusals reach the daemon with their
// reasons unchanged (an invalid CSR or proof named as a field of
// renew_certificate), and any other failure of JoinService, or a
// JoinService that cannot be reached, as renewFailed, which the daemon
// retries; the session goes on through all of them. The delivery that
// answers a revoked node's renewal re-reads the node and then ends its
// session with Unauthenticated "certificate revoked", even without a poke or
// a resync.
func TestRenewalRefusals(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour})
	n := e.newNode()
	d, w := e.connect(g, n, nil)
	_, csr := csrFor(t, n.id)
	const failed = "the gateway could not issue the certificate; retry later"

	for _, c := range []struct {
		name   string
		refuse error
		want   string
	}{
		{"a bad CSR", connect.NewError(connect.CodeInvalidArgument, errors.New("csr_der: not a PKCS#10 request")),
			"renew_certificate.csr_der: not a PKCS#10 request"},
		{"a bad proof", connect.NewError(connect.CodeInvalidArgument, errors.New("proof: does not verify")),
			"renew_certificate.proof: does not verify"},
		{"a request of the gateway's that JoinService cannot take",
			connect.NewError(connect.CodeInvalidArgument, errors.New("client_cert_serial: not hex")), failed},
		{"rate limited", connect.NewError(connect.CodeResourceExhausted, errors.New("renewal rate limited: renew at or after …")),
			"renewal rate limited: renew at or after …"},
		{"an unknown certificate", connect.NewError(connect.CodeFailedPrecondition,
			errors.New("the session's client certificate is not known")), "the session's client certificate is not known"},
		{"JoinService failed", connect.NewError(connect.CodeInternal, errors.New("database down")), failed},
		{"JoinService unavailable", connect.NewError(connect.CodeUnavailable, errors.New("shutting down")), failed},
	} {
		t.Run(c.name, func(t *testing.T) {
			e.certs.setRefuse(c.refuse)
			ci := d.renew(csr)
			require.Empty(t, ci.GetCertificateDer())
			require.Equal(t, c.want, ci.GetError())
		})
	}
	require.Equal(t, 1, e.certCount(n.id))

	// The session goes on: it still answers, and is still the node's.
	d.answersHeartbeats()
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID, "the refusals did not end the session")

	// Revoked while the session is open (no poke, no resync here): the
	// refusal reaches the daemon, then the session ends.
	start := realClock.Now()
	e.revoke(n.id)
	e.certs.setRefuse(connect.NewError(connect.CodeFailedPrecondition, errors.New("certificate revoked")))
	ci := d.renew(csr)
	require.Empty(t, ci.GetCertificateDer())
	require.Equal(t, "certificate revoked", ci.GetError())
	requireRevokedEnd(t, d, start)
	eventually(t, func() bool { return e.nodeRow(n.id).SessionID == nil }, "session cleared")
}

// TestRenewalDoesNotStallTheSession: while JoinService decides a renewal,
// the session goes on (heartbeats are answered); a second RenewCertificate
// sent meanwhile is answered at once that one is in progress, and the first
// is answered when JoinService answers.
func TestRenewalDoesNotStallTheSession(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	release := e.certs.holdCalls()
	t.Cleanup(release)

	_, csr := csrFor(t, n.id)
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_RenewCertificate{RenewCertificate: &gatewayv1.RenewCertificate{CsrDer: csr}}})
	eventually(t, func() bool { return e.certs.calls() == 1 }, "JoinService is asked")
	d.answersHeartbeats() // meanwhile
	_, other := csrFor(t, n.id)
	busy := d.renew(other)
	require.Empty(t, busy.GetCertificateDer())
	require.Equal(t, "a renewal of this session is in progress; retry later", busy.GetError())
	require.Equal(t, 1, e.certs.calls(), "the second is not relayed")

	release()
	ci := d.next().GetCertificateIssued()
	require.NotNil(t, ci)
	require.Empty(t, ci.GetError())
	cert, err := x509.ParseCertificate(ci.GetCertificateDer())
	require.NoError(t, err)
	require.Equal(t, 2, e.certCount(n.id))
	require.Equal(t, csr, e.certs.last().GetCsrDer())
	require.NotEmpty(t, cert.Raw)
}

// TestRenewalWithoutJoinService: a gateway whose JoinService cannot be
// reached (what listens at its URL drops every connection at once) answers
// a renewal with the retryable renewFailed, and the session goes on.
func TestRenewalWithoutJoinService(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	// A listener kept open, so that no other test's server gets its port.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	g := e.startGateway(gateway.Config{ResyncInterval: time.Hour, JoinServiceURL: "https://" + ln.Addr().String()})
	n := e.newNode()
	d, w := e.connect(g, n, nil)
	_, csr := csrFor(t, n.id)
	ci := d.renew(csr)
	require.Empty(t, ci.GetCertificateDer())
	require.Equal(t, "the gateway could not issue the certificate; retry later", ci.GetError())
	d.answersHeartbeats()
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID)
	require.Equal(t, 0, e.certs.calls())

	_, err = gateway.New(gateway.Config{PKI: service.PKI{PKIDir: e.pkiDir}, JoinServiceURL: "http://joinservice:8087",
		Probes: service.Probes{NoHealthServer: true}, ControlURL: "http://gw:8086"}, gateway.Deps{DB: e.db, NC: e.nc})
	require.ErrorContains(t, err, "BETTER_COMPUTE_GATEWAY_JOINSERVICE_URL")
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
