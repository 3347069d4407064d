package pki_test

import (
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/pki"
)

// complete returns a directory Init has filled, and its pins.
func complete(t *testing.T) (string, pki.Pins) {
	t.Helper()
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	pins, err := pki.ReadPins(dir)
	require.NoError(t, err)
	return dir, pins
}

func read(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return b
}

// TestInitNeverReplacesAPrivateKey: a missing public file is derived from
// its private key (the pin does not change); a missing gateway or
// JoinService certificate is issued for the existing key.
func TestInitNeverReplacesAPrivateKey(t *testing.T) {
	for _, tc := range []struct{ removed, key string }{
		{pki.JoinSigningPub, pki.JoinSigningKey},
		{pki.JoinEncryptionPub, pki.JoinEncryptionKey},
		{pki.CommandSigningPub, pki.CommandSigningKey},
		{pki.GatewayCert, pki.GatewayKey},
		{pki.JoinServiceCert, pki.JoinServiceKey},
	} {
		t.Run(tc.removed, func(t *testing.T) {
			dir, pins := complete(t)
			key := read(t, filepath.Join(dir, tc.key))
			pub := read(t, filepath.Join(dir, tc.removed))
			require.NoError(t, os.Remove(filepath.Join(dir, tc.removed)))
			res, err := pki.Init(dir, pki.InitOptions{}, now)
			require.NoError(t, err)
			require.True(t, res.Wrote)
			require.Equal(t, key, read(t, filepath.Join(dir, tc.key)), "the private key is kept")
			after, err := pki.ReadPins(dir)
			require.NoError(t, err)
			require.Equal(t, pins, after, "no pin changes")
			if tc.removed != pki.GatewayCert && tc.removed != pki.JoinServiceCert {
				require.Equal(t, pub, read(t, filepath.Join(dir, tc.removed)), "the public file is derived from the key")
			} else {
				gw, err := pki.LoadCert(filepath.Join(dir, tc.removed))
				require.NoError(t, err)
				k, err := pki.ParseKeyPEM(key)
				require.NoError(t, err)
				require.True(t, k.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(gw.PublicKey), "issued for the existing key")
			}
		})
	}
}

// TestInitGivesAnOldGatewayCertificateClientAuth: a gateway certificate
// without the ClientAuth usage (one made before gateways were JoinService's
// clients) is issued again, for the same key, with it; one that has it is
// kept as it is.
func TestInitGivesAnOldGatewayCertificateClientAuth(t *testing.T) {
	dir, pins := complete(t)
	key := read(t, filepath.Join(dir, pki.GatewayKey))
	k, err := pki.ParseKeyPEM(key)
	require.NoError(t, err)
	sca, err := pki.LoadCA(filepath.Join(dir, pki.ServingCACert), filepath.Join(dir, pki.ServingCAKey))
	require.NoError(t, err)
	// What Init issued before: ServerAuth only, through the public API.
	old, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{SerialNumber: big.NewInt(7), DNSNames: []string{"gateway"},
		NotBefore: now, NotAfter: now.Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}, sca.Cert, k.Public(), sca.Key)
	require.NoError(t, err)
	oldCert, err := x509.ParseCertificate(old)
	require.NoError(t, err)
	require.NoError(t, pki.WriteCert(filepath.Join(dir, pki.GatewayCert), oldCert))

	res, err := pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	require.True(t, res.Wrote)
	gw, err := pki.LoadCert(filepath.Join(dir, pki.GatewayCert))
	require.NoError(t, err)
	require.Equal(t, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, gw.ExtKeyUsage)
	require.True(t, k.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(gw.PublicKey), "for the same key")
	require.Equal(t, key, read(t, filepath.Join(dir, pki.GatewayKey)))
	after, err := pki.ReadPins(dir)
	require.NoError(t, err)
	require.Equal(t, pins, after, "no pin changes")

	crt := read(t, filepath.Join(dir, pki.GatewayCert))
	res, err = pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	require.False(t, res.Wrote)
	require.Equal(t, crt, read(t, filepath.Join(dir, pki.GatewayCert)), "kept once it has ClientAuth")
}

// TestInitRefusesHalfACA: a CA certificate without its key, or a key without
// its certificate, is an error naming the missing file; nothing is replaced.
// (A new CA would change its pin, or orphan every certificate it signed.)
func TestInitRefusesHalfACA(t *testing.T) {
	for _, tc := range []struct{ removed, kept string }{
		{pki.ServingCACert, pki.ServingCAKey},
		{pki.ServingCAKey, pki.ServingCACert},
		{pki.NodeCACert, pki.NodeCAKey},
		{pki.NodeCAKey, pki.NodeCACert},
		{pki.JoinSigningKey, pki.JoinSigningPub},
	} {
		t.Run(tc.removed, func(t *testing.T) {
			dir, _ := complete(t)
			kept := read(t, filepath.Join(dir, tc.kept))
			require.NoError(t, os.Remove(filepath.Join(dir, tc.removed)))
			_, err := pki.Init(dir, pki.InitOptions{}, now)
			require.ErrorContains(t, err, filepath.Join(dir, tc.removed)+" is missing but "+filepath.Join(dir, tc.kept)+" exists")
			require.Equal(t, kept, read(t, filepath.Join(dir, tc.kept)))
			require.NoFileExists(t, filepath.Join(dir, tc.removed))
		})
	}
}

// TestInitChecksEveryExistingFile: a key or certificate that does not parse,
// or a public file that is not its key's, is an error naming the file.
func TestInitChecksEveryExistingFile(t *testing.T) {
	for _, name := range []string{pki.JoinSigningKey, pki.JoinEncryptionKey, pki.CommandSigningKey, pki.NodeCAKey,
		pki.ServingCAKey, pki.GatewayKey, pki.ServingCACert, pki.NodeCACert, pki.GatewayCert, pki.JoinServiceKey, pki.JoinServiceCert, pki.JoinSigningPub} {
		t.Run("garbage "+name, func(t *testing.T) {
			dir, _ := complete(t)
			require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte("garbage\n"), 0o600))
			_, err := pki.Init(dir, pki.InitOptions{}, now)
			require.ErrorContains(t, err, filepath.Join(dir, name))
		})
	}
	t.Run("public file of another key", func(t *testing.T) {
		dir, _ := complete(t)
		other, _ := complete(t)
		require.NoError(t, os.WriteFile(filepath.Join(dir, pki.CommandSigningPub), read(t, filepath.Join(other, pki.CommandSigningPub)), 0o644))
		_, err := pki.Init(dir, pki.InitOptions{}, now)
		require.ErrorContains(t, err, filepath.Join(dir, pki.CommandSigningPub)+" does not match "+filepath.Join(dir, pki.CommandSigningKey))
	})
}

// TestInitFixesKeyModes: a private key readable by group or others is made
// owner-only, with a warning naming it.
func TestInitFixesKeyModes(t *testing.T) {
	dir, _ := complete(t)
	path := filepath.Join(dir, pki.JoinSigningKey)
	require.NoError(t, os.Chmod(path, 0o644))
	res, err := pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	require.False(t, res.Wrote)
	require.Equal(t, []string{path + " was mode 0644 (readable by group or others); set it to 0600"}, res.Warnings)
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	res, err = pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	require.Empty(t, res.Warnings)
}
