package gateway_test

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

// Tests of the lifetime of a session's certificate: a session lasts as long
// as the certificate its authority rests on (the client certificate, then
// each one renewed on the session), and a renewal rests on it. Whether a
// renewal may be signed (that certificate valid and unrevoked, at most one
// per node per RENEW_INTERVAL) JoinService decides: its tests
// (services/joinservice, renew_test.go) cover that.

// neverIdle keeps the idle timeout out of tests that move a fake clock by
// days.
const neverIdle = 10000 * time.Hour

// csrFor returns a new key and a CSR of it for node id.
func csrFor(t testing.TB, id string) (*tls.Certificate, []byte) {
	t.Helper()
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(key, id)
	require.NoError(t, err)
	return &tls.Certificate{PrivateKey: key}, csr
}

// renewOK renews n's certificate on d with a new key and returns the
// renewed certificate as a node to dial with.
func (e *env) renewOK(d *daemon, n node) (node, *x509.Certificate) {
	e.t.Helper()
	c, csr := csrFor(e.t, n.id)
	ci := d.renew(csr)
	require.Empty(e.t, ci.GetError())
	cert, err := x509.ParseCertificate(ci.GetCertificateDer())
	require.NoError(e.t, err)
	c.Certificate, c.Leaf = [][]byte{cert.Raw}, cert
	return node{id: n.id, cert: *c}, cert
}

// deliveredAfter queues a command for node id, moves the fake clock to at
// (which fires the resync ticker) and checks that d still gets the command:
// the resync that ran at at kept the session and delivered on it.
func (e *env) deliveredAfter(fake *clock.Fake, d *daemon, id string, at time.Time) {
	e.t.Helper()
	cmdID := e.queueCommand(id, "diag.nvml", "user")
	fake.Set(at)
	require.Equal(e.t, cmdID, d.next().GetCommand().GetCommandId(), "the session goes on at %s", at)
}

// requireExpiredEnd checks that d ends with Unauthenticated, saying that
// the session's certificate expired.
func requireExpiredEnd(t *testing.T, d *daemon) {
	t.Helper()
	err := d.ended()
	require.Equal(t, connect.CodeUnauthenticated, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "certificate expired")
}

// TestSessionClosedWhenItsCertificateExpires: a session whose client
// certificate expires while the stream is open is closed by the next
// resync, with a reason; until then it goes on.
func TestSessionClosedWhenItsCertificateExpires(t *testing.T) {
	t.Parallel()
	fake := clock.NewFake(realClock.Now())
	e := setup(t, options{clock: fake})
	g := e.startGateway(gateway.Config{ResyncInterval: time.Minute, IdleTimeout: neverIdle})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	d.heartbeat(1, 0)
	require.Equal(t, int64(1), d.nextAck(), "the first delivery pass is over")
	notAfter := n.cert.Leaf.NotAfter

	e.deliveredAfter(fake, d, n.id, notAfter.Add(-time.Minute))
	fake.Set(notAfter.Add(time.Minute))
	requireExpiredEnd(t, d)
	eventually(t, func() bool { return e.nodeRow(n.id).SessionID == nil }, "session cleared")
}

// TestRenewalRefusedOnAnExpiredCertificate: a renewal on a session whose
// certificate has expired (before any resync closed it), which JoinService
// refuses, gets that refusal, and the delivery of the refusal ends the
// session.
func TestRenewalRefusedOnAnExpiredCertificate(t *testing.T) {
	t.Parallel()
	fake := clock.NewFake(realClock.Now())
	e := setup(t, options{clock: fake})
	g := e.startGateway(gateway.Config{ResyncInterval: 10 * neverIdle, IdleTimeout: neverIdle})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	d.heartbeat(1, 0)
	require.Equal(t, int64(1), d.nextAck())

	fake.Set(n.cert.Leaf.NotAfter.Add(time.Second))
	reason := "the session's certificate expired at " + n.cert.Leaf.NotAfter.UTC().Format(time.RFC3339)
	e.certs.setRefuse(connect.NewError(connect.CodeFailedPrecondition, errors.New(reason)))
	_, csr := csrFor(t, n.id)
	ci := d.renew(csr)
	require.Empty(t, ci.GetCertificateDer())
	require.Equal(t, reason, ci.GetError())
	require.Equal(t, 1, e.certCount(n.id), "no certificate recorded")
	requireExpiredEnd(t, d)
}

// TestRenewalExtendsTheSession: a daemon that renews on time keeps its
// session (on the connection of its first certificate) past that
// certificate's expiry, renews again on it (the renewed certificate is the
// session's now), and the session ends only when the newest certificate
// renewed on it expires without a further renewal.
func TestRenewalExtendsTheSession(t *testing.T) {
	t.Parallel()
	start := realClock.Now()
	fake := clock.NewFake(start)
	e := setup(t, options{clock: fake})
	const ttl = 24 * time.Hour
	e.certs.setTTL(ttl)
	g := e.startGateway(gateway.Config{ResyncInterval: time.Minute, IdleTimeout: neverIdle})
	n := e.newNode()
	d, w := e.connect(g, n, nil)
	d.heartbeat(1, 0)
	require.Equal(t, int64(1), d.nextAck())
	first := n.cert.Leaf.NotAfter

	fake.Set(start.Add(ttl * 2 / 3))
	_, second := e.renewOK(d, n)
	require.True(t, second.NotAfter.After(first.Add(ttl/2)), "renewed for NodeCertTTL from now")

	// Past the first certificate's expiry: same session, still delivering.
	e.deliveredAfter(fake, d, n.id, first.Add(time.Hour))
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID)

	// A renewal now checks the certificate renewed on the session, which is
	// valid, not the expired one of the connection.
	fake.Set(second.NotAfter.Add(-ttl / 3))
	_, third := e.renewOK(d, n)
	require.Equal(t, second.Raw, e.certs.last().GetSessionCertDer(), "the second renewal rests on the certificate renewed on the session")
	require.Equal(t, pki.SerialHex(n.cert.Leaf), e.certs.last().GetClientCertSerial())
	e.deliveredAfter(fake, d, n.id, second.NotAfter.Add(time.Hour))
	require.Equal(t, w.GetSessionId(), *e.nodeRow(n.id).SessionID)

	// No further renewal: the session ends when the newest one expires.
	e.deliveredAfter(fake, d, n.id, third.NotAfter.Add(-time.Minute))
	fake.Set(third.NotAfter.Add(time.Minute))
	requireExpiredEnd(t, d)
}

// TestRevokedRenewedCertificateEndsTheSession: revoking alone the
// certificate renewed on a session closes the session (as revoking its
// client certificate does), and refuses its renewals.
func TestRevokedRenewedCertificateEndsTheSession(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: 200 * time.Millisecond, IdleTimeout: time.Hour})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	_, renewed := e.renewOK(d, n)

	start := realClock.Now()
	// Raw SQL: one certificate of a node revoked alone, which no store
	// function does (RevokeNode revokes them all with the node).
	e.exec(`UPDATE node_certs SET revoked_at = $2 WHERE serial = $1`, pki.SerialHex(renewed), e.db.Now())
	requireRevokedEnd(t, d, start)
}
