package store_test

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func TestNodes(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()

	var nodeIDs []string
	for range 3 {
		nodeIDs = append(nodeIDs, ids.New(ids.Node, now))
	}
	slices.Sort(nodeIDs) // ids of one millisecond need not sort in creation order
	for i, id := range nodeIDs {
		n := store.NewNode{ID: id, PoolID: f.pool.ID, Hostname: "host-" + id, MachineID: "m", Variant: "hgx-h100",
			AgentVersion: "v1", CreatedAt: now}
		if i != 1 {
			require.NoError(t, store.CreateNode(ctx, f.db.Pool, n))
			continue
		}
		// The second one failed acceptance with the two GPUs it reported,
		// and its gateway heard from it.
		storetest.Node(t, f.db, &storetest.NodeOpts{ID: id, PoolID: n.PoolID, Hostname: n.Hostname, MachineID: n.MachineID,
			Variant: n.Variant, AgentVersion: n.AgentVersion, CreatedAt: now, State: store.NodeAcceptanceFailed,
			Reason: "expected 8 GPUs, found 2", GatewayID: "gw-a", LastSeen: now, Reachable: true,
			GPUs: 2, GPUMemoryBytes: 85899345920})
	}
	require.NoError(t, store.CreateNodeCert(ctx, f.db.Pool, store.NewNodeCert{Serial: "0abc", NodeID: nodeIDs[0],
		PublicKeySHA256: []byte{1, 2}, NotBefore: now, NotAfter: now.Add(24 * time.Hour), CreatedAt: now}))
	require.ErrorIs(t, store.CreateNodeCert(ctx, f.db.Pool, store.NewNodeCert{Serial: "0abc", NodeID: nodeIDs[1],
		PublicKeySHA256: []byte{1, 2}, NotBefore: now, NotAfter: now, CreatedAt: now}), store.ErrConflict)
	var notAfter time.Time
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT not_after FROM node_certs WHERE node_id = $1`, nodeIDs[0]).Scan(&notAfter))
	require.True(t, notAfter.Equal(now.Add(24*time.Hour)))

	n, err := store.GetNode(ctx, f.db.Pool, store.AllTenants, nodeIDs[1])
	require.NoError(t, err)
	require.Equal(t, f.tenant.ID, n.PoolOwnerTenantID)
	require.Equal(t, "gw-a", n.GatewayID)
	require.True(t, n.Reachable)
	require.Equal(t, store.NodeAcceptanceFailed, n.ProvisionState)
	require.Equal(t, "expected 8 GPUs, found 2", n.ProvisionReason)
	require.True(t, n.LastSeen.Equal(now))
	require.Len(t, n.Devices, 2)
	require.EqualValues(t, 1, n.Devices[1].Index)
	require.Equal(t, "NVIDIA H100 80GB HBM3", n.Devices[0].Model)
	_, err = store.GetNode(ctx, f.db.Pool, store.AllTenants, "node_missing")
	require.ErrorIs(t, err, store.ErrNotFound)

	all, err := store.ListNodes(ctx, f.db.Pool, store.NodeFilter{Scope: store.AllTenants})
	require.NoError(t, err)
	require.Len(t, all, 3)
	require.Equal(t, nodeIDs[0], all[0].ID)
	require.Equal(t, "host-"+nodeIDs[0], all[0].Hostname)
	require.Empty(t, all[0].Devices)
	require.Len(t, all[1].Devices, 2)

	page, err := store.ListNodes(ctx, f.db.Pool, store.NodeFilter{Scope: store.AllTenants, After: nodeIDs[0], Limit: 1})
	require.NoError(t, err)
	require.Len(t, page, 1)
	require.Equal(t, nodeIDs[1], page[0].ID)

	other, err := store.ListNodes(ctx, f.db.Pool, store.NodeFilter{Scope: store.TenantScope("ten_other")})
	require.NoError(t, err)
	require.Empty(t, other)
	other, err = store.ListNodes(ctx, f.db.Pool, store.NodeFilter{Scope: store.AllTenants, PoolID: "pool_other"})
	require.NoError(t, err)
	require.Empty(t, other)
}

// TestExpireJoiningNodes: a node that joined long ago and never opened a
// session is deleted with its certificates and gives its token its use back;
// a recent one, one that opened a session and one past joining stay.
func TestExpireJoiningNodes(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	now := db.Now()
	old := now.Add(-2 * time.Hour)
	jt := storetest.JoinToken(t, db, &storetest.JoinTokenOpts{MaxUses: 5, Uses: 4})
	pool := jt.PoolID
	phantom := storetest.Node(t, db, &storetest.NodeOpts{PoolID: pool, JoinTokenID: jt.ID, CreatedAt: old}).ID
	storetest.NodeCert(t, db, &storetest.NodeCertOpts{NodeID: phantom})
	recent := storetest.Node(t, db, &storetest.NodeOpts{PoolID: pool, JoinTokenID: jt.ID, CreatedAt: now.Add(-time.Minute)}).ID
	connected := storetest.Node(t, db, &storetest.NodeOpts{PoolID: pool, JoinTokenID: jt.ID, CreatedAt: old, LastSeen: old}).ID
	adopted := storetest.Node(t, db, &storetest.NodeOpts{PoolID: pool, JoinTokenID: jt.ID, CreatedAt: old,
		State: store.NodeAdopted}).ID

	gone, err := store.ExpireJoiningNodes(ctx, db.Pool, now, time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, []string{phantom}, gone)
	_, err = store.GetNode(ctx, db.Pool, store.AllTenants, phantom)
	require.ErrorIs(t, err, store.ErrNotFound)
	var certs int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM node_certs WHERE node_id = $1`, phantom).Scan(&certs))
	require.Zero(t, certs)
	for _, id := range []string{recent, connected, adopted} {
		_, err := store.GetNode(ctx, db.Pool, store.AllTenants, id)
		require.NoError(t, err, id)
	}
	got, err := store.GetJoinToken(ctx, db.Pool, store.AllTenants, jt.ID)
	require.NoError(t, err)
	require.EqualValues(t, 3, got.Uses, "the phantom's use is given back")
}

// TestOneKeyJoinsOnce: a public key joins as one node at most; a second
// node with it is refused by the database (ConstraintNodeJoinKey), and
// JoinedKeys finds the first.
func TestOneKeyJoinsOnce(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	now := db.Now()
	pool := storetest.Pool(t, db, nil).ID
	key := []byte("0123456789abcdef0123456789abcdef")
	join := func(node, serial string) error {
		return store.CreateJoinedNodes(ctx, db.Pool, []store.NewNode{{ID: node, PoolID: pool, CreatedAt: now}},
			[]store.NewNodeCert{{Serial: serial, NodeID: node, PublicKeySHA256: key, NotBefore: now, NotAfter: now.Add(time.Hour),
				CreatedAt: now}})
	}
	require.NoError(t, join("node_first", "01"))
	err := join("node_second", "02")
	require.True(t, store.IsConstraint(err, store.ConstraintNodeJoinKey), "%v", err)
	joined, err := store.JoinedKeys(ctx, db.Pool, [][]byte{key})
	require.NoError(t, err)
	require.Len(t, joined, 1)
	for _, j := range joined {
		require.Equal(t, "node_first", j.NodeID)
	}
}
