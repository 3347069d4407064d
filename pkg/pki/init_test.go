package pki_test

import (
	"crypto"
	"os"
	"path/filepath"
	"testing"

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
// its private key (the pin does not change); a missing gateway certificate is
// issued for the existing gateway key.
func TestInitNeverReplacesAPrivateKey(t *testing.T) {
	for _, tc := range []struct{ removed, key string }{
		{pki.JoinSigningPub, pki.JoinSigningKey},
		{pki.JoinEncryptionPub, pki.JoinEncryptionKey},
		{pki.CommandSigningPub, pki.CommandSigningKey},
		{pki.GatewayCert, pki.GatewayKey},
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
			if tc.removed != pki.GatewayCert {
				require.Equal(t, pub, read(t, filepath.Join(dir, tc.removed)), "the public file is derived from the key")
			} else {
				gw, err := pki.LoadCert(filepath.Join(dir, pki.GatewayCert))
				require.NoError(t, err)
				k, err := pki.ParseKeyPEM(key)
				require.NoError(t, err)
				require.True(t, k.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(gw.PublicKey), "issued for the existing key")
			}
		})
	}
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
		pki.ServingCAKey, pki.GatewayKey, pki.ServingCACert, pki.NodeCACert, pki.GatewayCert, pki.JoinSigningPub} {
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
