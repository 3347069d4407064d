package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestCreateCertificateAsGo: createCertificate makes the certificate
// x509.CreateCertificate makes, but for its signature's randomness: the
// same TBSCertificate, byte for byte, wrapped as CreateCertificate wraps its
// own (wrapCertificate of CreateCertificate's TBSCertificate and signature is
// CreateCertificate's DER, byte for byte), and a signature that
// x509.ParseCertificate and CheckSignatureFrom(the CA) accept, for ECDSA
// CAs of each curve; a CA of another key type goes through
// CreateCertificate. It fails when CreateCertificate stops handing its
// signer the TBSCertificate (createCertificate would then sign through
// CreateCertificate, check included).
func TestCreateCertificateAsGo(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	leafKey, err := GenerateKey()
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: new(big.Int).Lsh(big.NewInt(0x5eed), 100),
		Subject:      pkix.Name{CommonName: "node_01"},
		URIs:         []*url.URL{NodeURI("example.test", "node_01")},
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	ecdsaCA := func(c elliptic.Curve) (*x509.Certificate, crypto.Signer) {
		key, err := ecdsa.GenerateKey(c, rand.Reader)
		require.NoError(t, err)
		return selfSigned(t, key, now), key
	}
	for _, tc := range []struct {
		name string
		ca   func() (*x509.Certificate, crypto.Signer)
		alg  x509.SignatureAlgorithm
	}{
		{"P-256", func() (*x509.Certificate, crypto.Signer) { return ecdsaCA(elliptic.P256()) }, x509.ECDSAWithSHA256},
		{"P-384", func() (*x509.Certificate, crypto.Signer) { return ecdsaCA(elliptic.P384()) }, x509.ECDSAWithSHA384},
		{"P-521", func() (*x509.Certificate, crypto.Signer) { return ecdsaCA(elliptic.P521()) }, x509.ECDSAWithSHA512},
		{"Ed25519", func() (*x509.Certificate, crypto.Signer) {
			_, key, err := ed25519.GenerateKey(rand.Reader)
			require.NoError(t, err)
			return selfSigned(t, key, now), key
		}, x509.PureEd25519},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			caCert, caKey := tc.ca()
			refDER, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, leafKey.Public(), caKey)
			require.NoError(t, err)
			ref, err := x509.ParseCertificate(refDER)
			require.NoError(t, err)

			der, err := createCertificate(tmpl, caCert, leafKey.Public(), caKey)
			require.NoError(t, err)
			got, err := x509.ParseCertificate(der)
			require.NoError(t, err)
			require.NoError(t, got.CheckSignatureFrom(caCert))
			require.Equal(t, tc.alg, got.SignatureAlgorithm)
			require.Equal(t, ref.RawTBSCertificate, got.RawTBSCertificate, "the TBSCertificate is CreateCertificate's")

			if _, ok := caKey.(*ecdsa.PrivateKey); ok {
				// CreateCertificate hands its signer the TBSCertificate
				// (crypto.MessageSigner), which createCertificate signs.
				capture := &tbsCapture{pub: caKey.Public()}
				_, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, leafKey.Public(), capture)
				require.ErrorIs(t, err, errTBSCaptured)
				require.Equal(t, ref.RawTBSCertificate, capture.tbs)
				alg, _, ok := tbsSignatureAlgorithm(ref.RawTBSCertificate)
				require.True(t, ok)
				again, err := wrapCertificate(ref.RawTBSCertificate, alg, ref.Signature)
				require.NoError(t, err)
				require.Equal(t, refDER, again, "wrapped as CreateCertificate wraps it")
				again, err = wrapCertificate(got.RawTBSCertificate, alg, got.Signature)
				require.NoError(t, err)
				require.Equal(t, der, again)
			}
		})
	}
}

// TestCreateCertificateRefusesAsGo: a template CreateCertificate refuses is
// refused, a key that is not the parent's too, and nothing is signed.
func TestCreateCertificateRefusesAsGo(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	key, err := GenerateKey()
	require.NoError(t, err)
	other, err := GenerateKey()
	require.NoError(t, err)
	caCert := selfSigned(t, key, now)
	_, err = createCertificate(&x509.Certificate{SerialNumber: big.NewInt(-1), NotBefore: now, NotAfter: now.Add(time.Hour)},
		caCert, other.Public(), key)
	require.ErrorContains(t, err, "serial number must be positive")
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(7), NotBefore: now, NotAfter: now.Add(time.Hour)}
	_, err = createCertificate(tmpl, caCert, other.Public(), other)
	require.ErrorContains(t, err, "doesn't match parent's PublicKey")
}

// selfSigned returns a CA certificate of key.
func selfSigned(t *testing.T, key crypto.Signer, now time.Time) *x509.Certificate {
	t.Helper()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return cert
}
