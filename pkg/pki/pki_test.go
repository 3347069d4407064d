package pki_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/pki"
)

var now = time.Date(2026, 11, 30, 8, 0, 0, 0, time.UTC)

func TestInitWritesOwnerOnlyKeysAndKeepsExisting(t *testing.T) {
	dir := t.TempDir()
	res, err := pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	require.True(t, res.Wrote)
	for _, k := range []string{pki.NodeCAKey, pki.ServingCAKey, pki.GatewayKey} {
		st, err := os.Stat(filepath.Join(dir, k))
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), k)
	}
	before, err := os.ReadFile(filepath.Join(dir, pki.NodeCACert))
	require.NoError(t, err)
	res, err = pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	require.False(t, res.Wrote, "a second init changes nothing")
	require.Empty(t, res.Warnings)
	after, err := os.ReadFile(filepath.Join(dir, pki.NodeCACert))
	require.NoError(t, err)
	require.Equal(t, before, after)
	td, err := pki.ReadTrustDomain(dir)
	require.NoError(t, err)
	require.Equal(t, pki.DefaultTrustDomain, td)

	// The gateway certificate verifies against the serving CA for its names.
	sca, err := pki.LoadCert(filepath.Join(dir, pki.ServingCACert))
	require.NoError(t, err)
	gw, err := pki.LoadCert(filepath.Join(dir, pki.GatewayCert))
	require.NoError(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(sca)
	for _, name := range []string{"gateway", "localhost", "127.0.0.1"} {
		_, err = gw.Verify(x509.VerifyOptions{DNSName: name, Roots: pool, CurrentTime: now,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
		require.NoError(t, err, name)
	}
	// It is also the gateway's client certificate toward JoinService.
	_, err = gw.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err, "gateway.crt for client auth")

	// JoinService's serves its control listener, and is no client's.
	js, err := pki.LoadCert(filepath.Join(dir, pki.JoinServiceCert))
	require.NoError(t, err)
	for _, name := range []string{"joinservice", "localhost", "127.0.0.1"} {
		_, err = js.Verify(x509.VerifyOptions{DNSName: name, Roots: pool, CurrentTime: now,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
		require.NoError(t, err, name)
	}
	_, err = js.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.Error(t, err, "joinservice.crt is no client certificate")
}

func TestIssueNodeCertificate(t *testing.T) {
	ca, err := pki.NewCA("node CA", now, time.Hour*24*365)
	require.NoError(t, err)
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	der, err := pki.NewCSR(key, "machine")
	require.NoError(t, err)
	csr, err := pki.ParseCSR(der)
	require.NoError(t, err)
	cert, err := ca.IssueNode(csr, "node_01", "example.test", now, 24*time.Hour)
	require.NoError(t, err)

	_, err = cert.Verify(x509.VerifyOptions{Roots: ca.Pool(), CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	id, err := pki.NodeIDFromCert(cert, "example.test")
	require.NoError(t, err)
	require.Equal(t, "node_01", id)
	_, err = pki.NodeIDFromCert(cert, "other.test")
	require.Error(t, err, "another trust domain's node is nobody here")
	require.Equal(t, now.Add(24*time.Hour), cert.NotAfter)
	require.Len(t, pki.PublicKeySHA256(cert), 32)
	require.NotEmpty(t, pki.SerialHex(cert))
}

func TestParseCSRRefusesBadInput(t *testing.T) {
	_, err := pki.ParseCSR([]byte("not a csr"))
	require.ErrorContains(t, err, "not a DER PKCS#10")

	key, err := pki.GenerateKey()
	require.NoError(t, err)
	der, err := pki.NewCSR(key, "machine")
	require.NoError(t, err)
	tampered := append([]byte(nil), der...)
	tampered[len(tampered)-5] ^= 0xff // inside the signature
	_, err = pki.ParseCSR(tampered)
	require.Error(t, err)
}

func TestKeyAndCertPEMRoundTrip(t *testing.T) {
	dir := t.TempDir()
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	require.NoError(t, pki.WriteKey(filepath.Join(dir, "k"), key))
	b, err := os.ReadFile(filepath.Join(dir, "k"))
	require.NoError(t, err)
	back, err := pki.ParseKeyPEM(b)
	require.NoError(t, err)
	require.True(t, key.PublicKey.Equal(back.Public()))
}

// TestIssueNodeBackdatesLittle: NotBefore is backdated for clock skew by at
// most a tenth of the TTL (and never more than 5 minutes), so that two
// thirds of a short certificate's lifetime are not already past at issue.
func TestIssueNodeBackdatesLittle(t *testing.T) {
	ca, err := pki.NewCA("node CA", now, time.Hour*24*365)
	require.NoError(t, err)
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	der, err := pki.NewCSR(key, "machine")
	require.NoError(t, err)
	csr, err := pki.ParseCSR(der)
	require.NoError(t, err)
	for _, tc := range []struct{ ttl, backdate time.Duration }{
		{90 * time.Second, 9 * time.Second},
		{10 * time.Minute, time.Minute},
		{24 * time.Hour, 5 * time.Minute},
	} {
		cert, err := ca.IssueNode(csr, "node_01", "example.test", now, tc.ttl)
		require.NoError(t, err)
		require.Equal(t, now.Add(-tc.backdate), cert.NotBefore, tc.ttl)
		require.Equal(t, now.Add(tc.ttl), cert.NotAfter, tc.ttl)
	}
}

// TestParseCSRKeys: ParseCSR takes ECDSA P-256/P-384, Ed25519 and RSA of
// 2048 to 4096 bits, and refuses other keys before checking a signature.
func TestParseCSRKeys(t *testing.T) {
	t.Parallel()
	ec256, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	ec224, err := ecdsa.GenerateKey(elliptic.P224(), rand.Reader)
	require.NoError(t, err)
	_, ed, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	rsa2048, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	rsa1024, err := rsa.GenerateKey(rand.Reader, 1024) //nolint:gosec // the weak key ParseCSR must refuse
	require.NoError(t, err)
	for _, tc := range []struct {
		name string
		key  crypto.Signer
		err  string
	}{
		{"P-256", ec256, ""},
		{"Ed25519", ed, ""},
		{"RSA 2048", rsa2048, ""},
		{"P-224", ec224, "not on P-256 or P-384"},
		{"RSA 1024", rsa1024, "RSA key has 1024 bits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			der, err := pki.NewCSR(tc.key, "m")
			require.NoError(t, err)
			_, err = pki.ParseCSR(der)
			if tc.err == "" {
				require.NoError(t, err)
			} else {
				require.ErrorContains(t, err, tc.err)
			}
		})
	}
}

// TestRenewalProof: a proof verifies with the key of the certificate it was
// signed for, for that CSR only; another key's, another CSR's, one made for
// another certificate's serial, an empty or a truncated one does not.
func TestRenewalProof(t *testing.T) {
	ca, err := pki.NewCA("node CA", now, 24*time.Hour)
	require.NoError(t, err)
	issue := func() (*x509.Certificate, crypto.Signer) {
		key, err := pki.GenerateKey()
		require.NoError(t, err)
		der, err := pki.NewCSR(key, "machine")
		require.NoError(t, err)
		csr, err := pki.ParseCSR(der)
		require.NoError(t, err)
		cert, err := ca.IssueNode(csr, "node_01", "example.test", now, time.Hour)
		require.NoError(t, err)
		return cert, key
	}
	cert, key := issue()
	other, otherKey := issue()
	csrKey, err := pki.GenerateKey()
	require.NoError(t, err)
	csr, err := pki.NewCSR(csrKey, "machine")
	require.NoError(t, err)
	anotherCSR, err := pki.NewCSR(csrKey, "other")
	require.NoError(t, err)

	proof, err := pki.SignRenewal(key, cert, csr)
	require.NoError(t, err)
	require.NoError(t, pki.VerifyRenewal(cert, csr, proof))

	byOther, err := pki.SignRenewal(otherKey, cert, csr)
	require.NoError(t, err)
	forOther, err := pki.SignRenewal(key, other, csr)
	require.NoError(t, err)
	for name, c := range map[string]struct {
		cert  *x509.Certificate
		csr   []byte
		proof []byte
	}{
		"another key":         {cert, csr, byOther},
		"another CSR":         {cert, anotherCSR, proof},
		"another certificate": {other, csr, proof},
		"for another serial":  {cert, csr, forOther},
		"none":                {cert, csr, nil},
		"truncated":           {cert, csr, proof[:len(proof)-1]},
	} {
		require.ErrorIs(t, pki.VerifyRenewal(c.cert, c.csr, c.proof), pki.ErrRenewalProof, name)
	}

	// Ed25519 keys sign the digest itself.
	pub, edKey, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	edCert := &x509.Certificate{PublicKey: pub, SerialNumber: cert.SerialNumber}
	edProof, err := pki.SignRenewal(edKey, edCert, csr)
	require.NoError(t, err)
	require.True(t, ed25519.Verify(pub, pki.RenewalDigest(csr, pki.SerialHex(cert)), edProof))
	require.NoError(t, pki.VerifyRenewal(edCert, csr, edProof))
}
