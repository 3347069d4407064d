package controllers_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

// TestSSHCAs: the reconciler gives every adopted node's spec the PKI
// directory's SSH user CAs (a new generation), changes nothing the second
// time, and leaves the CAs alone when the directory has none.
func TestSSHCAs(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	node := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted, SpecGeneration: 1}).ID

	empty := &controllers.SSHCAs{DB: db, PKIDir: t.TempDir()}
	changed, err := empty.Reconcile(ctx)
	require.NoError(t, err, "a PKI directory without the CAs is not an error")
	require.False(t, changed)

	dir := t.TempDir()
	_, err = pki.Init(dir, pki.InitOptions{}, db.Now())
	require.NoError(t, err)
	want, err := controllers.ReadSSHUserCAs(dir)
	require.NoError(t, err)
	require.Len(t, want, 2)
	r := &controllers.SSHCAs{DB: db, PKIDir: dir}
	changed, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.True(t, changed)
	n, err := store.GetNode(ctx, db.Pool, store.AllTenants, node)
	require.NoError(t, err)
	require.EqualValues(t, 2, n.SpecGeneration)
	var raw []byte
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT spec FROM nodes WHERE id = $1`, node).Scan(&raw))
	spec := &gatewayv1.NodeSpec{}
	require.NoError(t, protojson.Unmarshal(raw, spec))
	require.Len(t, spec.SshUserCas, 2)
	require.Equal(t, "break-glass", spec.SshUserCas[0].Name)
	require.Equal(t, want[0].PublicKey, spec.SshUserCas[0].PublicKey)

	changed, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.False(t, changed, "the same CAs change nothing")
	changed, err = empty.Reconcile(ctx)
	require.NoError(t, err)
	require.False(t, changed, "a directory without CAs does not remove them")
	got, err := store.SSHUserCAs(ctx, db.Pool)
	require.NoError(t, err)
	require.Len(t, got, 2)
}
