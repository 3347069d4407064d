package joinservice_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto"
	"crypto/ecdh"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/proto"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

type fixture struct {
	db       *store.DB
	pkiDir   string
	nodeCA   *pki.CA
	poolID   string
	siteID   string
	tenantID string
	client   joinv1connect.JoinServiceClient
	url      string
	// controlURL is the control listener's (NodeCertService, mutual TLS).
	controlURL string
	srv        *joinservice.Server
	// joinKey is JoinService's HPKE public key, pins the deployment's pins
	// and signSPKI the join signing key: what a daemon joins with.
	joinKey  *ecdh.PublicKey
	pins     pki.Pins
	signSPKI []byte
}

func setup(t testing.TB) *fixture { return setupWith(t, nil) }

// setupWith is setup with edit applied to JoinService's Config.
func setupWith(t testing.TB, edit func(*joinservice.Config)) *fixture {
	t.Helper()
	return setupOn(t, clock.New(), edit)
}

// setupOn is setupWith on clock clk (the database's, and so JoinService's
// time).
func setupOn(t testing.TB, clk clock.Clock, edit func(*joinservice.Config)) *fixture {
	t.Helper()
	db := storetest.New(t, clk)
	ctx := t.Context()
	now := db.Now()
	f := &fixture{db: db, pkiDir: t.TempDir()}
	_, err := pki.Init(f.pkiDir, pki.InitOptions{}, now)
	require.NoError(t, err)
	f.nodeCA, err = pki.LoadCA(f.pkiDir+"/"+pki.NodeCACert, f.pkiDir+"/"+pki.NodeCAKey)
	require.NoError(t, err)
	f.pins, err = pki.ReadPins(f.pkiDir)
	require.NoError(t, err)
	encSPKI, signSPKI, err := pki.ReadJoinPublicKeys(f.pkiDir)
	require.NoError(t, err)
	keys, err := pki.CheckJoinKeys(f.pins, encSPKI, signSPKI)
	require.NoError(t, err)
	f.joinKey, f.signSPKI = keys.Encryption, keys.SigningSPKI

	tenant := store.Tenant{ID: ids.New(ids.Tenant, now), Name: "root", CreatedAt: now}
	require.NoError(t, store.CreateTenant(ctx, db.Pool, tenant))
	site := store.Site{ID: ids.New(ids.Site, now), Name: "dev-1", Region: "dev-1", CreatedAt: now}
	require.NoError(t, store.CreateSite(ctx, db.Pool, site))
	f.poolID, f.siteID, f.tenantID = ids.New(ids.Pool, now), site.ID, tenant.ID
	require.NoError(t, store.CreatePool(ctx, db.Pool, store.Pool{ID: f.poolID, SiteID: site.ID,
		OwnerTenantID: tenant.ID, Name: "metal-host", Kind: "metal-host", CreatedAt: now}))

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	control, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f.controlURL = "https://" + control.Addr().String()
	cfg := joinservice.Config{PKI: service.PKI{PKIDir: f.pkiDir}, Listener: ln, ControlListener: control,
		Gateways: service.Gateways{GatewayURL: "https://gw.example:8443", GatewayServerName: "gw.example"}}
	if edit != nil {
		edit(&cfg)
	}
	srv, err := joinservice.New(cfg, joinservice.Deps{DB: db, Logger: telemetry.Discard()})
	require.NoError(t, err)
	f.srv = srv
	sctx, cancel := context.WithCancel(context.Background())
	var g errgroup.Group
	g.Go(func() error { return srv.Run(sctx) })
	t.Cleanup(func() {
		cancel()
		require.NoError(t, g.Wait())
	})

	// Cleartext HTTP/2, as daemons behind the dev gateway speak it.
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &protocols}
	t.Cleanup(tr.CloseIdleConnections)
	f.url = "http://" + ln.Addr().String()
	f.client = joinv1connect.NewJoinServiceClient(&http.Client{Transport: tr}, f.url)
	return f
}

// token mints a join token of the fixture's pool and returns its secret.
func (f *fixture) token(t testing.TB, maxUses int32, expires time.Time) (string, string) {
	t.Helper()
	secret, err := iam.NewSecret(iam.JoinTokenPrefix)
	require.NoError(t, err)
	id := ids.New(ids.JoinToken, f.db.Now())
	require.NoError(t, store.CreateJoinToken(t.Context(), f.db.Pool, store.AllTenants, store.JoinToken{ID: id, PoolID: f.poolID,
		Hash: iam.HashSecret(secret), MaxUses: maxUses, ExpiresAt: expires, CreatedAt: f.db.Now()}))
	return id, secret
}

func newCSR(t testing.TB) []byte {
	t.Helper()
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	der, err := pki.NewCSR(key, "machine")
	require.NoError(t, err)
	return der
}

// seal seals token to the fixture's JoinService, bound to csr.
func (f *fixture) seal(t testing.TB, token string, csr []byte) []byte {
	t.Helper()
	sealed, err := pki.SealJoinToken(f.joinKey, token, csr)
	require.NoError(t, err)
	return sealed
}

// request returns a JoinRequest with a new CSR and token sealed to it.
func (f *fixture) request(t testing.TB, token string, claims *joinv1.Claims) *joinv1.JoinRequest {
	t.Helper()
	csr := newCSR(t)
	return &joinv1.JoinRequest{SealedToken: f.seal(t, token, csr), CsrDer: csr, Claims: claims}
}

// mismatchedCSR returns a CSR whose signature was made by another key than
// the one it carries: the request of one key with the signature of another.
func mismatchedCSR(t testing.TB) []byte {
	t.Helper()
	type certificationRequest struct {
		TBS       asn1.RawValue
		Algorithm pkix.AlgorithmIdentifier
		Signature asn1.BitString
	}
	var a, b certificationRequest
	_, err := asn1.Unmarshal(newCSR(t), &a)
	require.NoError(t, err)
	_, err = asn1.Unmarshal(newCSR(t), &b)
	require.NoError(t, err)
	a.Signature = b.Signature
	der, err := asn1.Marshal(a)
	require.NoError(t, err)
	_, err = x509.ParseCertificateRequest(der)
	require.NoError(t, err, "it still parses: only the signature is wrong")
	return der
}

// nodeIDs returns every node's id, sorted.
func (f *fixture) nodeIDs(t testing.TB) []string {
	t.Helper()
	rows, err := f.db.Pool.Query(t.Context(), `SELECT id FROM nodes ORDER BY id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return ids
}

// pokedNodes returns the node ids of every controllers poke in the outbox,
// sorted.
func (f *fixture) pokedNodes(t *testing.T) []string {
	t.Helper()
	rows, err := f.db.Pool.Query(t.Context(), `SELECT payload FROM outbox WHERE subject = $1`, store.SubjectPokeControllers)
	require.NoError(t, err)
	payloads, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	require.NoError(t, err)
	var ids []string
	for _, p := range payloads {
		var poke store.Poke
		require.NoError(t, json.Unmarshal(p, &poke))
		ids = append(ids, poke.NodeIDs...)
	}
	slices.Sort(ids)
	return ids
}

func (f *fixture) count(t *testing.T, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), sql).Scan(&n))
	return n
}

func TestJoin(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	tokenID, secret := f.token(t, 5, f.db.Now().Add(time.Hour))
	before := f.db.Now()

	res, err := f.client.Join(ctx, connect.NewRequest(f.request(t, secret,
		&joinv1.Claims{Hostname: "gpu-01", MachineId: "m-01", AgentVersion: "bcd/1.0", Variant: "hgx-h100"})))
	require.NoError(t, err)
	msg := res.Msg
	// Signed with the pinned key, as the daemon checks it; no signed intent.
	verified, err := pki.CheckJoinResponse(msg, f.pins, f.signSPKI)
	require.NoError(t, err)
	require.Nil(t, verified.CommandSigningRoot)
	require.Nil(t, msg.Trust)
	require.NoError(t, ids.Check(ids.Node, msg.NodeId))
	require.Equal(t, f.poolID, msg.PoolId)
	require.Equal(t, []string{"https://gw.example:8443"}, msg.GatewayUrls)
	require.Equal(t, "gw.example", msg.GatewayServerName)
	require.Equal(t, pki.DefaultTrustDomain, msg.TrustDomain)
	require.Equal(t, f.nodeCA.Cert.Raw, msg.NodeCaDer)
	servingCA, err := pki.LoadCert(f.pkiDir + "/" + pki.ServingCACert)
	require.NoError(t, err)
	require.Equal(t, servingCA.Raw, msg.ServingCaDer)

	// The certificate chains to the node CA for client auth and names the node.
	cert, err := x509.ParseCertificate(msg.CertificateDer)
	require.NoError(t, err)
	_, err = cert.Verify(x509.VerifyOptions{Roots: f.nodeCA.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	require.Len(t, cert.URIs, 1)
	require.Equal(t, "spiffe://"+pki.DefaultTrustDomain+"/node/"+msg.NodeId, cert.URIs[0].String())
	id, err := pki.NodeIDFromCert(cert, pki.DefaultTrustDomain)
	require.NoError(t, err)
	require.Equal(t, msg.NodeId, id)
	require.True(t, msg.NotAfter.AsTime().Equal(cert.NotAfter))
	require.WithinDuration(t, before.Add(24*time.Hour), cert.NotAfter, time.Minute)

	// One transaction wrote the node, its certificate, the use and the poke.
	n, err := store.GetNode(ctx, f.db.Pool, store.AllTenants, msg.NodeId)
	require.NoError(t, err)
	require.Equal(t, store.NodeJoining, n.ProvisionState)
	require.Equal(t, tokenID, n.JoinTokenID)
	require.Equal(t, "gpu-01", n.Hostname)
	require.Equal(t, "m-01", n.MachineID)
	require.Equal(t, "bcd/1.0", n.AgentVersion)
	require.Equal(t, "hgx-h100", n.Variant)
	var serial string
	var keySum []byte
	var notAfter time.Time
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT serial, public_key_sha256, not_after FROM node_certs WHERE node_id = $1`,
		msg.NodeId).Scan(&serial, &keySum, &notAfter))
	require.Equal(t, pki.SerialHex(cert), serial)
	require.Equal(t, pki.PublicKeySHA256(cert), keySum)
	require.True(t, notAfter.Equal(cert.NotAfter.Truncate(time.Microsecond)))
	jt, err := store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, tokenID)
	require.NoError(t, err)
	require.EqualValues(t, 1, jt.Uses)
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM outbox WHERE subject = 'bc.poke.controllers'`))
	// ... and the node.joined event, for watchers too (woken by its hint,
	// bc.events.<tenant>.node.joined, after the commit; no outbox row).
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'node.joined' AND subject_id = '`+msg.NodeId+`'`))
	require.Zero(t, f.count(t, `SELECT count(*) FROM outbox WHERE subject LIKE 'bc.events.%'`))

	// Health answers on the same mux.
	resp, err := http.Get(f.url + "/healthz")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.NoError(t, resp.Body.Close())
}

// TestJoinRefusals is the table of bad joins: each is refused with its own
// code and message, and consumes nothing (no use counted, no node,
// certificate or poke written).
func TestJoinRefusals(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	now := f.db.Now()
	goodID, good := f.token(t, 5, now.Add(time.Hour))
	_, expired := f.token(t, 5, now.Add(-time.Minute))
	revokedID, revoked := f.token(t, 5, now.Add(time.Hour))
	_, err := store.RevokeJoinToken(ctx, f.db.Pool, store.AllTenants, revokedID, now)
	require.NoError(t, err)
	_, used := f.token(t, 10, now.Add(time.Hour))
	unknown, err := iam.NewSecret(iam.JoinTokenPrefix) // never recorded
	require.NoError(t, err)
	// Ten machines joined with it.
	_, granted, err := store.UseJoinTokenN(ctx, f.db.Pool, iam.HashSecret(used), 10, now)
	require.NoError(t, err)
	require.Equal(t, 10, granted)
	expiredTok, err := store.GetJoinTokenByHash(ctx, f.db.Pool, iam.HashSecret(expired))
	require.NoError(t, err)

	// Another deployment's join key: what a token sealed for the wrong
	// deployment (or by a daemon pinned to it) carries.
	otherKey, err := pki.GenerateJoinEncryptionKey()
	require.NoError(t, err)
	sealedTo := func(k *ecdh.PublicKey, token string, csr []byte) []byte {
		b, err := pki.SealJoinToken(k, token, csr)
		require.NoError(t, err)
		return b
	}
	csr, otherCSR := newCSR(t), newCSR(t)
	sealed := func(token string) []byte { return f.seal(t, token, csr) }
	tampered := sealed(good)
	tampered[len(tampered)-1] ^= 0x01
	mismatched := mismatchedCSR(t)
	const sealMsg = "sealed_token cannot be opened: it is not sealed to this deployment's join key or not bound to this CSR"

	for _, tc := range []struct {
		name string
		req  *joinv1.JoinRequest
		code connect.Code
		msg  string
	}{
		{"unknown token", &joinv1.JoinRequest{SealedToken: sealed(unknown), CsrDer: csr},
			connect.CodeUnauthenticated, "join token is not valid"},
		{"malformed token", &joinv1.JoinRequest{SealedToken: sealed("bcjt_unknown-token"), CsrDer: csr},
			connect.CodeUnauthenticated, "join token is not valid"},
		{"expired token", &joinv1.JoinRequest{SealedToken: sealed(expired), CsrDer: csr},
			connect.CodeFailedPrecondition, "join token expired at " + expiredTok.ExpiresAt.UTC().Format(time.RFC3339)},
		{"revoked token", &joinv1.JoinRequest{SealedToken: sealed(revoked), CsrDer: csr},
			connect.CodeFailedPrecondition, "join token was revoked"},
		{"used-up token", &joinv1.JoinRequest{SealedToken: sealed(used), CsrDer: csr},
			connect.CodeFailedPrecondition, "join token is used up (10 of 10 uses)"},
		{"sealed to another deployment's key", &joinv1.JoinRequest{SealedToken: sealedTo(otherKey.PublicKey(), good, csr), CsrDer: csr},
			connect.CodeUnauthenticated, sealMsg},
		{"sealed token replayed with another CSR", &joinv1.JoinRequest{SealedToken: sealed(good), CsrDer: otherCSR},
			connect.CodeUnauthenticated, sealMsg},
		{"sealed token tampered with", &joinv1.JoinRequest{SealedToken: tampered, CsrDer: csr},
			connect.CodeUnauthenticated, sealMsg},
		{"CSR whose key does not match its signature", &joinv1.JoinRequest{SealedToken: f.seal(t, good, mismatched), CsrDer: mismatched},
			connect.CodeInvalidArgument, "csr_der: csr signature does not match its public key"},
		{"garbage CSR", &joinv1.JoinRequest{SealedToken: f.seal(t, good, []byte("not a csr")), CsrDer: []byte("not a csr")},
			connect.CodeInvalidArgument, "csr_der: csr is not a DER PKCS#10 request"},
		{"no CSR", &joinv1.JoinRequest{SealedToken: sealed(good)},
			connect.CodeInvalidArgument, "csr_der"},
		{"no sealed token", &joinv1.JoinRequest{CsrDer: csr},
			connect.CodeInvalidArgument, "sealed_token"},
		{"sealed token too short", &joinv1.JoinRequest{SealedToken: make([]byte, 48), CsrDer: csr},
			connect.CodeInvalidArgument, "sealed_token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			signed := f.srv.CertificatesIssued()
			_, err := f.client.Join(ctx, connect.NewRequest(tc.req))
			require.Error(t, err)
			require.Equal(t, tc.code, connect.CodeOf(err), "%v", err)
			var cerr *connect.Error
			require.ErrorAs(t, err, &cerr)
			require.True(t, strings.Contains(cerr.Message(), tc.msg), "message %q should contain %q", cerr.Message(), tc.msg)
			// Nothing was consumed, and nothing signed for a token that
			// is unknown, revoked or expired (nor for a request refused
			// before its token is read).
			if tc.name != "used-up token" {
				require.Equal(t, signed, f.srv.CertificatesIssued(), "no certificate signed")
			}
			require.Zero(t, f.count(t, `SELECT count(*) FROM nodes`))
			require.Zero(t, f.count(t, `SELECT count(*) FROM node_certs`))
			require.Zero(t, f.count(t, `SELECT count(*) FROM outbox`))
			require.Equal(t, 10, f.count(t, `SELECT sum(uses) FROM join_tokens`), "only the used-up token's 10 uses")
		})
	}
	// The good token, refused only for how it was sent, still joins.
	_, err = f.client.Join(ctx, connect.NewRequest(f.request(t, good, nil)))
	require.NoError(t, err)
	jt, err := store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, goodID)
	require.NoError(t, err)
	require.EqualValues(t, 1, jt.Uses)
}

// TestJoinSignedIntent: with SignedIntent, the response carries the
// command-signing root, covered by the signature and matching its pin.
func TestJoinSignedIntent(t *testing.T) {
	t.Parallel()
	f := setupWith(t, func(c *joinservice.Config) { c.SignedIntent = true })
	_, secret := f.token(t, 1, f.db.Now().Add(time.Hour))
	res, err := f.client.Join(t.Context(), connect.NewRequest(f.request(t, secret, nil)))
	require.NoError(t, err)
	_, root, err := pki.LoadPublicKey(filepath.Join(f.pkiDir, pki.CommandSigningPub))
	require.NoError(t, err)
	require.Equal(t, root, res.Msg.GetTrust().GetCommandSigningRoot())
	v, err := pki.CheckJoinResponse(res.Msg, f.pins, f.signSPKI)
	require.NoError(t, err)
	require.NotNil(t, v.CommandSigningRoot)
	// The root is signed: a response whose root was swapped is refused.
	res.Msg.Trust.CommandSigningRoot = f.signSPKI
	_, err = pki.CheckJoinResponse(res.Msg, pki.Pins{ServingCA: f.pins.ServingCA, JoinSigning: f.pins.JoinSigning}, f.signSPKI)
	require.ErrorContains(t, err, "its signature does not verify")
}

// TestJoinGatewayReplicas configures two gateways (BETTER_COMPUTE_GATEWAY_URL with a
// comma): the JoinResponse names both, the first also as gateway_url, under
// the signature.
func TestJoinGatewayReplicas(t *testing.T) {
	t.Parallel()
	f := setupWith(t, func(c *joinservice.Config) { c.GatewayURL = "https://gw-a.example:8443, https://gw-b.example:8443" })
	_, secret := f.token(t, 1, f.db.Now().Add(time.Hour))
	res, err := f.client.Join(t.Context(), connect.NewRequest(f.request(t, secret, nil)))
	require.NoError(t, err)
	require.Equal(t, []string{"https://gw-a.example:8443", "https://gw-b.example:8443"}, res.Msg.GetGatewayUrls())
	_, err = pki.CheckJoinResponse(res.Msg, f.pins, f.signSPKI)
	require.NoError(t, err)
}

func TestJoinRace(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	tokenID, secret := f.token(t, 10, f.db.Now().Add(time.Hour))

	var wg sync.WaitGroup
	errs := make([]error, 20)
	for i := range errs {
		wg.Go(func() {
			_, errs[i] = f.client.Join(ctx, connect.NewRequest(f.request(t, secret,
				&joinv1.Claims{Hostname: fmt.Sprintf("gpu-%02d", i)})))
		})
	}
	wg.Wait()
	var ok, usedUp int
	for _, err := range errs {
		switch {
		case err == nil:
			ok++
		case connect.CodeOf(err) == connect.CodeFailedPrecondition && strings.Contains(err.Error(), "used up (10 of 10 uses)"):
			usedUp++
		default:
			t.Fatalf("unexpected error: %v", err)
		}
	}
	require.Equal(t, 10, ok)
	require.Equal(t, 10, usedUp)
	jt, err := store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, tokenID)
	require.NoError(t, err)
	require.EqualValues(t, 10, jt.Uses)
	require.Equal(t, 10, f.count(t, `SELECT count(*) FROM nodes`))
	require.Equal(t, 10, f.count(t, `SELECT count(*) FROM node_certs`))
	// Joins recorded in one batch share one poke: every node is named once.
	require.Equal(t, f.nodeIDs(t), f.pokedNodes(t))
}

// TestJoinRetryIsTheSameNode: a Join retried with the same key (its
// response was lost, or the machine restarted mid-join, maybe with a new
// token of the pool) answers with the node that key joined as and a new
// certificate for it, and counts no use, also when the token is used up
// since, and when the retries arrive at once. The key with a token of
// another pool, or of a revoked node, is refused.
func TestJoinRetryIsTheSameNode(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	tokenID, secret := f.token(t, 1, f.db.Now().Add(time.Hour))
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	join := func(token string) (*joinv1.JoinResponse, error) {
		csr, err := pki.NewCSR(key, "machine")
		require.NoError(t, err)
		res, err := f.client.Join(ctx, connect.NewRequest(&joinv1.JoinRequest{SealedToken: f.seal(t, token, csr), CsrDer: csr}))
		if err != nil {
			return nil, err
		}
		return res.Msg, nil
	}
	first, err := join(secret)
	require.NoError(t, err)

	var wg sync.WaitGroup
	again := make([]*joinv1.JoinResponse, 4)
	errs := make([]error, len(again))
	for i := range again {
		wg.Go(func() { again[i], errs[i] = join(secret) })
	}
	wg.Wait()
	for i, msg := range again {
		require.NoError(t, errs[i], "the token is used up, but a retry uses none")
		require.Equal(t, first.NodeId, msg.NodeId)
		_, err := pki.CheckJoinResponse(msg, f.pins, f.signSPKI)
		require.NoError(t, err)
		cert, err := x509.ParseCertificate(msg.CertificateDer)
		require.NoError(t, err)
		id, err := pki.NodeIDFromCert(cert, pki.DefaultTrustDomain)
		require.NoError(t, err)
		require.Equal(t, first.NodeId, id)
		require.True(t, key.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(cert.PublicKey))
	}
	jt, err := store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, tokenID)
	require.NoError(t, err)
	require.EqualValues(t, 1, jt.Uses)
	require.Equal(t, []string{first.NodeId}, f.nodeIDs(t))
	require.Equal(t, 1+len(again), f.count(t, `SELECT count(*) FROM node_certs WHERE node_id = '`+first.NodeId+`'`),
		"every certificate issued is recorded (revocation revokes them all)")
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'node.joined'`), "joined once")

	// A new token of the pool (the machine restarted with one): the same
	// node, no use counted.
	samePoolID, samePool := f.token(t, 5, f.db.Now().Add(time.Hour))
	msg, err := join(samePool)
	require.NoError(t, err)
	require.Equal(t, first.NodeId, msg.NodeId)
	jt, err = store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, samePoolID)
	require.NoError(t, err)
	require.Zero(t, jt.Uses)

	// A token of another pool: refused, nothing counted.
	now := f.db.Now()
	other := store.Pool{ID: ids.New(ids.Pool, now), SiteID: f.siteID, OwnerTenantID: f.tenantID, Name: "other", Kind: "metal-host", CreatedAt: now}
	require.NoError(t, store.CreatePool(ctx, f.db.Pool, other))
	otherSecret, err := iam.NewSecret(iam.JoinTokenPrefix)
	require.NoError(t, err)
	otherID := ids.New(ids.JoinToken, now)
	require.NoError(t, store.CreateJoinToken(ctx, f.db.Pool, store.AllTenants, store.JoinToken{ID: otherID, PoolID: other.ID,
		Hash: iam.HashSecret(otherSecret), MaxUses: 5, ExpiresAt: now.Add(time.Hour), CreatedAt: now}))
	_, err = join(otherSecret)
	require.Equal(t, connect.CodeAlreadyExists, connect.CodeOf(err), "%v", err)
	require.ErrorContains(t, err, "csr_der: this key joined already, as node "+first.NodeId+" of another pool")
	jt, err = store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, otherID)
	require.NoError(t, err)
	require.Zero(t, jt.Uses)

	_, err = store.RevokeNode(ctx, f.db.Pool, store.AllTenants, f.db.Now(), first.NodeId, "test")
	require.NoError(t, err)
	_, err = join(secret)
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%v", err)
	require.ErrorContains(t, err, "node "+first.NodeId+" was revoked")
	require.Equal(t, []string{first.NodeId}, f.nodeIDs(t))
}

func TestNewNeedsPKI(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	_, err := joinservice.New(joinservice.Config{PKI: service.PKI{PKIDir: t.TempDir()}}, joinservice.Deps{DB: db})
	require.ErrorContains(t, err, "load node CA")

	for _, tc := range []struct {
		file, want string
		signed     bool
	}{
		{pki.JoinEncryptionKey, "load join encryption key", false},
		{pki.JoinSigningKey, "load join signing key", false},
		{pki.CommandSigningPub, "load command-signing root", true},
	} {
		dir := t.TempDir()
		_, err := pki.Init(dir, pki.InitOptions{}, db.Now())
		require.NoError(t, err)
		_, err = joinservice.New(joinservice.Config{PKI: service.PKI{PKIDir: dir}, Intent: service.Intent{SignedIntent: tc.signed}}, joinservice.Deps{DB: db})
		require.NoError(t, err)
		require.NoError(t, os.Remove(filepath.Join(dir, tc.file)))
		_, err = joinservice.New(joinservice.Config{PKI: service.PKI{PKIDir: dir}, Intent: service.Intent{SignedIntent: tc.signed}}, joinservice.Deps{DB: db})
		require.ErrorContains(t, err, tc.want)
		require.ErrorContains(t, err, filepath.Join(dir, tc.file), "the error names the file")
	}
}

// TestNewRefusesBadGatewayURL: a malformed BETTER_COMPUTE_GATEWAY_URL is refused at
// startup, naming the variable, rather than sent to every joining machine.
func TestNewRefusesBadGatewayURL(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, db.Now())
	require.NoError(t, err)
	for list, want := range map[string]string{
		"gateway:8443":                    `BETTER_COMPUTE_GATEWAY_URL: gateway URL "gateway:8443" must be https://HOST[:PORT]`,
		"http://gateway:8443":             `BETTER_COMPUTE_GATEWAY_URL: gateway URL "http://gateway:8443" must be https://HOST[:PORT]`,
		"https://gw-a:8443, https://:1":   `BETTER_COMPUTE_GATEWAY_URL: gateway URL "https://:1" has no host`,
		"https://gw-a:8443, https://gw-b": "",
	} {
		_, err := joinservice.New(joinservice.Config{PKI: service.PKI{PKIDir: dir}, Gateways: service.Gateways{GatewayURL: list}}, joinservice.Deps{DB: db})
		if want == "" {
			require.NoError(t, err, list)
			continue
		}
		require.ErrorContains(t, err, want, list)
	}
}

// TestConfigSignedIntent reads BETTER_COMPUTE_SIGNED_INTENT from the
// environment as the binary does (config.Load): true, unset (false), and a
// value that is not a boolean, refused naming the variable.
func TestConfigSignedIntent(t *testing.T) {
	t.Setenv("BETTER_COMPUTE_SIGNED_INTENT", "true")
	var cfg joinservice.Config
	require.NoError(t, config.Load(&cfg, os.Getenv))
	require.True(t, cfg.SignedIntent)
	t.Setenv("BETTER_COMPUTE_SIGNED_INTENT", "")
	cfg = joinservice.Config{}
	require.NoError(t, config.Load(&cfg, os.Getenv))
	require.False(t, cfg.SignedIntent)
	t.Setenv("BETTER_COMPUTE_SIGNED_INTENT", "yes please")
	cfg = joinservice.Config{}
	require.ErrorContains(t, config.Load(&cfg, os.Getenv), `BETTER_COMPUTE_SIGNED_INTENT: want true or false, got "yes please"`)
}

// TestJoinThrottled checks that Join is limited per source address: after
// the burst every call is refused with ResourceExhausted and a retry hint
// before its request is read, valid or not, and nothing is recorded.
func TestJoinThrottled(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	cfg := joinservice.Config{PKI: service.PKI{PKIDir: f.pkiDir}, JoinBurst: 3, JoinRate: 1,
		Gateways: service.Gateways{GatewayURL: "https://gw.example:8443", GatewayServerName: "gw.example"}}
	srv, err := joinservice.New(cfg, joinservice.Deps{DB: f.db, Logger: telemetry.Discard(), Clock: clock.NewFake(f.db.Now())})
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	client := joinv1connect.NewJoinServiceClient(ts.Client(), ts.URL)
	_, secret := f.token(t, 5, f.db.Now().Add(time.Hour))

	for range 3 {
		_, err := client.Join(ctx, connect.NewRequest(&joinv1.JoinRequest{}))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	}
	for _, req := range []*joinv1.JoinRequest{{}, f.request(t, secret, &joinv1.Claims{Hostname: "gpu-01"})} {
		_, err := client.Join(ctx, connect.NewRequest(req))
		var cerr *connect.Error
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, connect.CodeResourceExhausted, cerr.Code(), "%v", err)
		require.Equal(t, "joins from this address: too many; retry in 1 s", cerr.Message())
		require.Equal(t, "1", cerr.Meta().Get("Retry-After"))
	}
	require.Zero(t, f.count(t, `SELECT count(*) FROM nodes`))
	require.Zero(t, srv.CertificatesIssued())
}

// TestMessageLimit checks that JoinService refuses a request beyond
// service.MaxMessageBytes with ResourceExhausted, sent as it is or as a
// gzip bomb.
func TestMessageLimit(t *testing.T) {
	t.Parallel()
	f := setup(t)
	secret, _ := f.token(t, 1, f.db.Now().Add(time.Hour))
	req := f.request(t, secret, nil)
	req.CsrDer = bytes.Repeat([]byte{0}, 64<<20)
	for _, c := range []struct {
		name string
		opts []connect.ClientOption
		says string
	}{
		{name: "plain", says: "larger than configured max"},
		{name: "gzip bomb", opts: []connect.ClientOption{connect.WithSendGzip()}, says: "inflates beyond"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			client := joinv1connect.NewJoinServiceClient(http.DefaultClient, f.url, c.opts...)
			_, err := client.Join(t.Context(), connect.NewRequest(req))
			require.Equal(t, connect.CodeResourceExhausted, connect.CodeOf(err), "%v", err)
			require.Contains(t, err.Error(), c.says)
		})
	}
	require.Equal(t, int64(0), f.srv.CertificatesIssued())
}

// TestJoinRefusesInvalidClaims: claims that break join.proto's rules (a
// control or format character, a host name that is none, too long) are
// refused with InvalidArgument naming the field, before anything is
// consumed or recorded.
func TestJoinRefusesInvalidClaims(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		claims *joinv1.Claims
		field  string
	}{
		{"newline in hostname", &joinv1.Claims{Hostname: "gpu-01\nlevel=ERROR"}, "claims.hostname"},
		{"hostname that is no hostname", &joinv1.Claims{Hostname: "gpu_01; reboot"}, "claims.hostname"},
		{"escape sequence in agent version", &joinv1.Claims{Hostname: "gpu-01", AgentVersion: "bcd/1.0\x1b]0;owned\x07"}, "claims.agent_version"},
		{"bidirectional override in variant", &joinv1.Claims{Hostname: "gpu-01", Variant: "hgx\u202e001h"}, "claims.variant"},
		{"space in machine id", &joinv1.Claims{Hostname: "gpu-01", MachineId: "m 01"}, "claims.machine_id"},
		{"oversize machine id", &joinv1.Claims{Hostname: "gpu-01", MachineId: strings.Repeat("a", 129)}, "claims.machine_id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := setup(t)
			tokenID, secret := f.token(t, 5, f.db.Now().Add(time.Hour))
			_, err := f.client.Join(t.Context(), connect.NewRequest(f.request(t, secret, tc.claims)))
			require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
			require.ErrorContains(t, err, tc.field)
			require.Zero(t, f.srv.CertificatesIssued())
			require.Zero(t, f.count(t, `SELECT count(*) FROM nodes`))
			jt, err := store.GetJoinToken(t.Context(), f.db.Pool, store.AllTenants, tokenID)
			require.NoError(t, err)
			require.Zero(t, jt.Uses, "nothing consumed")
		})
	}
}

// TestJoinResponseUncompressed: JoinService answers a Join uncompressed even
// to a caller that accepts gzip. A JoinResponse is mostly certificates and
// signatures, which gzip shrinks by about a third (the test logs the sizes), and
// compressing it cost about a tenth of JoinService's CPU per join
// (uncompressedAnswers).
func TestJoinResponseUncompressed(t *testing.T) {
	t.Parallel()
	f := setup(t)
	_, secret := f.token(t, 1, f.db.Now().Add(time.Hour))
	body, err := proto.Marshal(f.request(t, secret, &joinv1.Claims{Hostname: "gpu-01", MachineId: "m-01"}))
	require.NoError(t, err)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, f.url+joinv1connect.JoinServiceJoinProcedure,
		bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/proto")
	req.Header.Set("Connect-Protocol-Version", "1")
	req.Header.Set("Accept-Encoding", "gzip") // set by hand: the transport then leaves the answer as sent
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Empty(t, resp.Header.Get("Content-Encoding"))
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var msg joinv1.JoinResponse
	require.NoError(t, proto.Unmarshal(raw, &msg))
	_, err = pki.CheckJoinResponse(&msg, f.pins, f.signSPKI)
	require.NoError(t, err)

	var gz bytes.Buffer
	w := gzip.NewWriter(&gz)
	_, err = w.Write(raw)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	t.Logf("JoinResponse: %d bytes, %d gzipped", len(raw), gz.Len())
}
