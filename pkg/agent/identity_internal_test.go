package agent

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/pki"
)

// TestIdentityKeyEncodedOnce: a joined machine's identity keeps the key as
// its pending join encoded it (the same PEM, not encoded again), and a
// renewed key is encoded anew: the file holds the key the identity signs
// with, each time.
func TestIdentityKeyEncodedOnce(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	ca, err := pki.NewCA("test CA", now, time.Hour)
	require.NoError(t, err)
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	pending, err := savePendingJoin(dir, "machine-1", key)
	require.NoError(t, err)
	loaded, err := loadPendingJoin(dir)
	require.NoError(t, err)
	require.Equal(t, pending.KeyPEM, loaded.KeyPEM)

	id := &Identity{NodeID: "node_01", MachineID: "machine-1", GatewayURLs: []string{"https://gw:8443"}, key: key,
		cert: ca.Cert, servingCA: ca.Cert, KeyPEM: pending.KeyPEM, pemOf: key}
	require.NoError(t, id.save(dir, nil))
	got, err := loadIdentity(dir)
	require.NoError(t, err)
	require.Equal(t, pending.KeyPEM, got.KeyPEM, "the pending join's encoding")
	require.True(t, key.PublicKey.Equal(got.key.Public()))

	// A renewal's key (renew.go copies the identity, then sets key).
	next := *got
	renewed, err := pki.GenerateKey()
	require.NoError(t, err)
	next.key = renewed
	require.NoError(t, next.save(dir, nil))
	got, err = loadIdentity(dir)
	require.NoError(t, err)
	require.True(t, renewed.PublicKey.Equal(got.key.Public()), "the renewed key is written")
	require.NotEqual(t, pending.KeyPEM, got.KeyPEM)
}
