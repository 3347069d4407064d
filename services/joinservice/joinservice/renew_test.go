package joinservice_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
)

// Tests of NodeCertService: the renewals gateways relay, decided and signed
// here, the one holder of the node CA's key.

// renewEvery is the fixtures' RenewInterval (the default's).
const renewEvery = 10 * time.Minute

// setupRenew is setupOn a fake clock, returned, with RenewInterval
// renewEvery and edit applied.
func setupRenew(t *testing.T, edit func(*joinservice.Config)) (*fixture, *clock.Fake) {
	t.Helper()
	fake := clock.NewFake(clock.New().Now())
	return setupOn(t, fake, func(c *joinservice.Config) {
		c.RenewInterval = renewEvery
		if edit != nil {
			edit(c)
		}
	}), fake
}

// member is a node that joined through the fixture's JoinService: its id,
// and the key and certificate it holds.
type member struct {
	id   string
	key  crypto.Signer
	cert *x509.Certificate
}

// joinNode joins a new node with a new key and returns it.
func (f *fixture) joinNode(t *testing.T) member {
	t.Helper()
	_, secret := f.token(t, 10, f.db.Now().Add(time.Hour))
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(key, "machine")
	require.NoError(t, err)
	res, err := f.client.Join(t.Context(), connect.NewRequest(&joinv1.JoinRequest{SealedToken: f.seal(t, secret, csr), CsrDer: csr}))
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(res.Msg.GetCertificateDer())
	require.NoError(t, err)
	return member{id: res.Msg.GetNodeId(), key: key, cert: cert}
}

// renewal returns the request a gateway relays when n, on a session whose
// client certificate is client, asks to renew with a new key (returned):
// its CSR and its proof, signed by n's key for n's certificate.
func (n member) renewal(t *testing.T, client *x509.Certificate) (*joinv1.RenewNodeCertificateRequest, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(key, "machine")
	require.NoError(t, err)
	proof, err := pki.SignRenewal(n.key, n.cert, csr)
	require.NoError(t, err)
	return &joinv1.RenewNodeCertificateRequest{NodeId: n.id, ClientCertSerial: pki.SerialHex(client),
		SessionCertDer: n.cert.Raw, CsrDer: csr, Proof: proof}, key
}

// fileCert loads the key pair name.crt, name.key of the fixture's PKI.
func (f *fixture) fileCert(t *testing.T, crt, key string) tls.Certificate {
	t.Helper()
	c, err := tls.LoadX509KeyPair(filepath.Join(f.pkiDir, crt), filepath.Join(f.pkiDir, key))
	require.NoError(t, err)
	return c
}

// nodeCertClient returns a NodeCertService client of the control listener
// that presents certs (none when empty) and trusts the serving CA, as a
// gateway does.
func (f *fixture) nodeCertClient(t *testing.T, certs ...tls.Certificate) joinv1connect.NodeCertServiceClient {
	t.Helper()
	ca, err := pki.LoadCert(filepath.Join(f.pkiDir, pki.ServingCACert))
	require.NoError(t, err)
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	var p http.Protocols
	p.SetHTTP2(true)
	tr := &http.Transport{Protocols: &p, TLSClientConfig: &tls.Config{Certificates: certs, RootCAs: roots, MinVersion: tls.VersionTLS13}}
	t.Cleanup(tr.CloseIdleConnections)
	return joinv1connect.NewNodeCertServiceClient(&http.Client{Transport: tr}, f.controlURL)
}

// gatewayClient is nodeCertClient with the gateway's certificate.
func (f *fixture) gatewayClient(t *testing.T) joinv1connect.NodeCertServiceClient {
	t.Helper()
	return f.nodeCertClient(t, f.fileCert(t, pki.GatewayCert, pki.GatewayKey))
}

// renew calls RenewNodeCertificate as a gateway.
func (f *fixture) renew(t *testing.T, req *joinv1.RenewNodeCertificateRequest) (*joinv1.RenewNodeCertificateResponse, error) {
	t.Helper()
	res, err := f.gatewayClient(t).RenewNodeCertificate(t.Context(), connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// renewOK renews n on a session whose client certificate is client and
// returns the node with its new key and certificate.
func (f *fixture) renewOK(t *testing.T, n member, client *x509.Certificate) member {
	t.Helper()
	req, key := n.renewal(t, client)
	res, err := f.renew(t, req)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(res.GetCertificateDer())
	require.NoError(t, err)
	require.True(t, key.PublicKey.Equal(cert.PublicKey), "for the CSR's key")
	return member{id: n.id, key: key, cert: cert}
}

// certCount is how many certificates node id has in node_certs.
func (f *fixture) certCount(t *testing.T, id string) int {
	t.Helper()
	return f.count(t, `SELECT count(*) FROM node_certs WHERE node_id = '`+id+`'`)
}

// requireRefused checks that err is a refusal with code whose message
// contains reason.
func requireRefused(t *testing.T, err error, code connect.Code, reason string) {
	t.Helper()
	require.Error(t, err)
	require.Equal(t, code, connect.CodeOf(err), "%v", err)
	var ce *connect.Error
	require.ErrorAs(t, err, &ce)
	require.Contains(t, ce.Message(), reason)
}

// TestRenewNodeCertificate: a gateway's renewal is signed with the node CA
// for the CSR's key and the node, valid for NODE_CERT_TTL, and recorded in
// node_certs; a renewal resting on the certificate renewed on a session
// (whose serial is not the client certificate's) is signed too.
func TestRenewNodeCertificate(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Hour
	f, fake := setupRenew(t, func(c *joinservice.Config) { c.NodeCertTTL = ttl })
	n := f.joinNode(t)
	issued := f.srv.CertificatesIssued()
	fake.Advance(renewEvery)

	before := f.db.Now()
	req, key := n.renewal(t, n.cert)
	res, err := f.renew(t, req)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(res.GetCertificateDer())
	require.NoError(t, err)
	require.True(t, key.PublicKey.Equal(cert.PublicKey), "for the CSR's key")
	id, err := pki.NodeIDFromCert(cert, pki.DefaultTrustDomain)
	require.NoError(t, err)
	require.Equal(t, n.id, id)
	require.WithinDuration(t, before.Add(ttl), cert.NotAfter, time.Minute, "NodeCertTTL")
	require.True(t, cert.NotAfter.Equal(res.GetNotAfter().AsTime()))
	_, err = cert.Verify(x509.VerifyOptions{Roots: f.nodeCA.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		CurrentTime: f.db.Now()})
	require.NoError(t, err, "signed by the node CA")
	rec, err := store.GetSessionCert(t.Context(), f.db.Pool, pki.SerialHex(cert))
	require.NoError(t, err)
	require.Equal(t, n.id, rec.NodeID)
	require.Nil(t, rec.RevokedAt)
	require.True(t, rec.NotAfter.Equal(cert.NotAfter.Truncate(time.Microsecond)))
	require.Equal(t, issued+1, f.srv.CertificatesIssued())

	// The same session renews again: it rests on the renewed certificate
	// now, whose key signs the proof.
	fake.Advance(renewEvery)
	renewed := member{id: n.id, key: key, cert: cert}
	third := f.renewOK(t, renewed, n.cert)
	require.Equal(t, 3, f.certCount(t, n.id))
	require.NotEqual(t, pki.SerialHex(cert), pki.SerialHex(third.cert))
}

// TestRenewalRefusals is the table of renewals refused before anything is
// signed: each with its code and reason, none recording a certificate.
func TestRenewalRefusals(t *testing.T) {
	t.Parallel()
	f, fake := setupRenew(t, nil)
	n, other := f.joinNode(t), f.joinNode(t)
	fake.Advance(renewEvery)
	alien, err := pki.NewCA("another node CA", f.db.Now().Add(-time.Hour), 24*time.Hour)
	require.NoError(t, err)

	for _, c := range []struct {
		name   string
		edit   func(r *joinv1.RenewNodeCertificateRequest)
		code   connect.Code
		reason string
	}{
		{"a CSR that does not parse", func(r *joinv1.RenewNodeCertificateRequest) {
			r.CsrDer = []byte("not a csr")
			r.Proof, err = pki.SignRenewal(n.key, n.cert, r.CsrDer)
			require.NoError(t, err)
		}, connect.CodeInvalidArgument, "csr_der: "},
		{"a CSR not signed by its key", func(r *joinv1.RenewNodeCertificateRequest) {
			r.CsrDer = mismatchedCSR(t)
			r.Proof, err = pki.SignRenewal(n.key, n.cert, r.CsrDer)
			require.NoError(t, err)
		}, connect.CodeInvalidArgument, "csr_der: "},
		{"no proof", func(r *joinv1.RenewNodeCertificateRequest) { r.Proof = nil }, connect.CodeInvalidArgument, "proof: "},
		{"a proof by another key", func(r *joinv1.RenewNodeCertificateRequest) {
			key, err := pki.GenerateKey()
			require.NoError(t, err)
			r.Proof, err = pki.SignRenewal(key, n.cert, r.CsrDer)
			require.NoError(t, err)
		}, connect.CodeInvalidArgument, "proof: "},
		{"the proof of another CSR", func(r *joinv1.RenewNodeCertificateRequest) {
			r.Proof, err = pki.SignRenewal(n.key, n.cert, newCSR(t))
			require.NoError(t, err)
		}, connect.CodeInvalidArgument, "proof: "},
		{"another node's proof, for its own session certificate", func(r *joinv1.RenewNodeCertificateRequest) {
			r.SessionCertDer = other.cert.Raw
			r.Proof, err = pki.SignRenewal(other.key, other.cert, r.CsrDer)
			require.NoError(t, err)
		}, connect.CodeInvalidArgument, "session_cert_der: not a certificate of node " + n.id},
		{"a session certificate of another CA", func(r *joinv1.RenewNodeCertificateRequest) {
			r.SessionCertDer = alien.Cert.Raw
		}, connect.CodeInvalidArgument, "session_cert_der: not signed by the node CA"},
		{"a session certificate that does not parse", func(r *joinv1.RenewNodeCertificateRequest) {
			r.SessionCertDer = []byte("junk")
		}, connect.CodeInvalidArgument, "session_cert_der: "},
		{"an unknown client certificate", func(r *joinv1.RenewNodeCertificateRequest) {
			r.ClientCertSerial = "0abc"
		}, connect.CodeFailedPrecondition, "the session's client certificate is not known"},
		{"another node's client certificate", func(r *joinv1.RenewNodeCertificateRequest) {
			r.ClientCertSerial = pki.SerialHex(other.cert)
		}, connect.CodeFailedPrecondition, "the session's client certificate is not known"},
		{"a request breaking nodecert.proto's rules", func(r *joinv1.RenewNodeCertificateRequest) {
			r.ClientCertSerial = "NOT HEX"
		}, connect.CodeInvalidArgument, "client_cert_serial"},
	} {
		t.Run(c.name, func(t *testing.T) {
			req, _ := n.renewal(t, n.cert)
			c.edit(req)
			_, err := f.renew(t, req)
			requireRefused(t, err, c.code, c.reason)
			require.Equal(t, 1, f.certCount(t, n.id), "nothing recorded")
		})
	}

	// Still renewable: the refusals left nothing behind.
	f.renewOK(t, n, n.cert)
}

// TestRenewalRefusedForRevoked: a revoked node, and a node whose session
// certificate alone was revoked, are refused "certificate revoked".
func TestRenewalRefusedForRevoked(t *testing.T) {
	t.Parallel()
	f, fake := setupRenew(t, nil)
	n, m := f.joinNode(t), f.joinNode(t)
	fake.Advance(renewEvery)
	renewed := f.renewOK(t, m, m.cert)
	fake.Advance(renewEvery)

	require.NoError(t, f.db.InTx(t.Context(), func(tx pgx.Tx) error {
		_, err := store.RevokeNode(t.Context(), tx, store.AllTenants, f.db.Now(), n.id, "test")
		return err
	}))
	req, _ := n.renewal(t, n.cert)
	_, err := f.renew(t, req)
	requireRefused(t, err, connect.CodeFailedPrecondition, "certificate revoked")
	require.Equal(t, 1, f.certCount(t, n.id))

	// Raw SQL: one certificate revoked alone, which no store function does.
	_, err = f.db.Pool.Exec(t.Context(), `UPDATE node_certs SET revoked_at = now() WHERE serial = $1`, pki.SerialHex(renewed.cert))
	require.NoError(t, err)
	req, _ = renewed.renewal(t, m.cert)
	_, err = f.renew(t, req)
	requireRefused(t, err, connect.CodeFailedPrecondition, "certificate revoked")
	require.Equal(t, 2, f.certCount(t, m.id))
}

// TestRenewalRefusedOnAnExpiredCertificate: a renewal resting on a session
// certificate past its NotAfter is refused, saying so, and records nothing.
func TestRenewalRefusedOnAnExpiredCertificate(t *testing.T) {
	t.Parallel()
	f, fake := setupRenew(t, nil)
	n := f.joinNode(t)
	fake.Set(n.cert.NotAfter.Add(time.Second))
	req, _ := n.renewal(t, n.cert)
	_, err := f.renew(t, req)
	requireRefused(t, err, connect.CodeFailedPrecondition, "the session's certificate expired at "+n.cert.NotAfter.UTC().Format(time.RFC3339))
	require.Equal(t, 1, f.certCount(t, n.id))
}

// TestRenewalRateLimitedPerNode: a node is issued at most one certificate
// per RenewInterval, counted from its newest one (issued at join or
// renewed), whichever session (and gateway) asks; a refusal says when to
// try again.
func TestRenewalRateLimitedPerNode(t *testing.T) {
	t.Parallel()
	f, fake := setupRenew(t, nil)
	start := fake.Now()
	n := f.joinNode(t) // its certificate is recorded now

	refused := func(n member, client *x509.Certificate, retryAt time.Time) {
		t.Helper()
		req, _ := n.renewal(t, client)
		_, err := f.renew(t, req)
		requireRefused(t, err, connect.CodeResourceExhausted, "renewal rate limited")
		requireRefused(t, err, connect.CodeResourceExhausted, retryAt.UTC().Format(time.RFC3339))
	}
	refused(n, n.cert, start.Add(renewEvery))
	require.Equal(t, 1, f.certCount(t, n.id))

	fake.Set(start.Add(renewEvery))
	renewed := f.renewOK(t, n, n.cert)
	require.Equal(t, 2, f.certCount(t, n.id))
	fake.Advance(renewEvery - time.Second)
	refused(renewed, n.cert, start.Add(2*renewEvery))
	// Another session, on the first certificate still valid, is no way
	// round it.
	refused(n, n.cert, start.Add(2*renewEvery))
	require.Equal(t, 2, f.certCount(t, n.id))
	fake.Advance(time.Second)
	f.renewOK(t, n, n.cert)
	require.Equal(t, 3, f.certCount(t, n.id))
}

// TestRenewIntervalBounds: a RenewInterval above a quarter of NodeCertTTL
// (a renewal whose answer was lost could not be retried before the
// certificate expires) keeps JoinService from starting; unset, it is the
// lesser of ten minutes and a tenth of NodeCertTTL.
func TestRenewIntervalBounds(t *testing.T) {
	t.Parallel()
	f := setup(t)
	_, err := joinservice.New(joinservice.Config{PKI: service.PKI{PKIDir: f.pkiDir}, NodeCerts: service.NodeCerts{NodeCertTTL: time.Hour},
		RenewInterval: 16 * time.Minute}, joinservice.Deps{DB: f.db})
	require.ErrorContains(t, err, "BETTER_COMPUTE_NODE_CERT_RENEW_INTERVAL")
	require.ErrorContains(t, err, "a quarter of")

	for _, c := range []struct{ ttl, want time.Duration }{{24 * time.Hour, 10 * time.Minute}, {time.Hour, 6 * time.Minute}} {
		t.Run(c.ttl.String(), func(t *testing.T) {
			t.Parallel()
			start := clock.New().Now()
			fake := clock.NewFake(start)
			f := setupOn(t, fake, func(cfg *joinservice.Config) { cfg.NodeCertTTL = c.ttl })
			n := f.joinNode(t) // its certificate is recorded at start
			fake.Set(start.Add(c.want - time.Second))
			req, _ := n.renewal(t, n.cert)
			_, err := f.renew(t, req)
			requireRefused(t, err, connect.CodeResourceExhausted, "renewal rate limited")
			fake.Set(start.Add(c.want))
			f.renewOK(t, n, n.cert)
		})
	}
}

// TestControlListenerTakesOnlyGateways: the control listener speaks mutual
// TLS only, and takes only client certificates of the serving CA with the
// ClientAuth usage (the gateways'): a client without a certificate, with a
// node certificate, or with JoinService's own serving certificate (no
// ClientAuth) is refused before any call, and no certificate is recorded.
func TestControlListenerTakesOnlyGateways(t *testing.T) {
	t.Parallel()
	f, fake := setupRenew(t, nil)
	n := f.joinNode(t)
	fake.Advance(renewEvery)
	nodeTLS := tls.Certificate{Certificate: [][]byte{n.cert.Raw}, PrivateKey: n.key, Leaf: n.cert}
	for name, client := range map[string]joinv1connect.NodeCertServiceClient{
		"no client certificate":      f.nodeCertClient(t),
		"a node certificate":         f.nodeCertClient(t, nodeTLS),
		"JoinService's own (server)": f.nodeCertClient(t, f.fileCert(t, pki.JoinServiceCert, pki.JoinServiceKey)),
	} {
		t.Run(name, func(t *testing.T) {
			req, _ := n.renewal(t, n.cert)
			_, err := client.RenewNodeCertificate(t.Context(), connect.NewRequest(req))
			require.Error(t, err)
			// Refused in the TLS handshake: the client sees its connection
			// fail (Unavailable), or be reset while it writes (Canceled),
			// never an answer of the service.
			require.Contains(t, []connect.Code{connect.CodeUnavailable, connect.CodeCanceled}, connect.CodeOf(err), "%v", err)
			require.Equal(t, 1, f.certCount(t, n.id))
		})
	}

	// Cleartext is no way in either.
	plain := joinv1connect.NewNodeCertServiceClient(http.DefaultClient, "http"+f.controlURL[len("https"):])
	req, _ := n.renewal(t, n.cert)
	_, err := plain.RenewNodeCertificate(t.Context(), connect.NewRequest(req))
	require.Error(t, err)
	require.Equal(t, 1, f.certCount(t, n.id))

	// The gateway's certificate is let in.
	f.renewOK(t, n, n.cert)
}
