package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// acceptanceDB returns a database with one pool and these nodes:
// "n-open" accepting with an open command before its deadline (and the
// error the daemon reported), "n-late" accepting with an open command past
// it, "n-done" accepting with a succeeded command, "n-none" accepting
// without a command, "n-join" joining and "n-adopted" adopted.
func acceptanceDB(t *testing.T) (*store.DB, time.Time) {
	t.Helper()
	now := time.Date(2030, 3, 4, 5, 6, 7, 0, time.UTC)
	db := storetest.New(t, clock.NewFake(now))
	storetest.Tenant(t, db, &storetest.TenantOpts{ID: "ten_1", Name: "owner"})
	storetest.Site(t, db, &storetest.SiteOpts{ID: "site_1", Name: "dev-1"})
	storetest.Pool(t, db, &storetest.PoolOpts{ID: "pool_1", SiteID: "site_1", OwnerTenantID: "ten_1", Name: "p", GPUModel: "H100",
		ExpectGPUCount: 8})
	for _, n := range []struct{ id, state string }{
		{"n-open", store.NodeAccepting}, {"n-late", store.NodeAccepting}, {"n-done", store.NodeAccepting},
		{"n-none", store.NodeAccepting}, {"n-join", store.NodeJoining}, {"n-adopted", store.NodeAdopted},
	} {
		storetest.Node(t, db, &storetest.NodeOpts{ID: n.id, PoolID: "pool_1", State: n.state})
	}
	for _, c := range []storetest.CommandOpts{
		{ID: "cmd-open", NodeID: "n-open", Purpose: "acceptance", State: "delivered", Deadline: now.Add(time.Minute), Deliveries: 1,
			Error: "daemon said so"},
		{ID: "cmd-late-0", NodeID: "n-late", Purpose: "acceptance", State: "expired", Deadline: now.Add(-2 * time.Minute),
			CreatedAt: now.Add(-4 * time.Minute), FinishedAt: now},
		{ID: "cmd-late", NodeID: "n-late", Purpose: "acceptance", State: "running", Deadline: now, Deliveries: 1},
		{ID: "cmd-done", NodeID: "n-done", Purpose: "acceptance", State: "succeeded", Deadline: now.Add(time.Minute), Deliveries: 1},
		{ID: "cmd-adopted", NodeID: "n-adopted", Purpose: "acceptance", State: "succeeded", Deadline: now, Deliveries: 1},
		{ID: "cmd-user", NodeID: "n-none", Kind: store.CommandLogsCollect, RetrySafe: new(bool), Deadline: now.Add(time.Minute)},
	} {
		storetest.Command(t, db, &c)
	}
	return db, now
}

func TestClaimDueAcceptances(t *testing.T) {
	t.Parallel()
	db, now := acceptanceDB(t)
	ctx := t.Context()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	due, err := store.ClaimDueAcceptances(ctx, tx, now, 10)
	require.NoError(t, err)
	require.Equal(t, []string{"n-done", "n-late", "n-none"}, due)

	// Another transaction skips the locked nodes.
	require.NoError(t, db.InTx(ctx, func(tx2 pgx.Tx) error {
		other, err := store.ClaimDueAcceptances(ctx, tx2, now, 10)
		require.Empty(t, other)
		return err
	}))

	checks, err := store.AcceptanceChecks(ctx, tx, append(due, "n-join"))
	require.NoError(t, err)
	require.Len(t, checks, 3, "a joining node was read as accepting")
	byNode := map[string]store.AcceptanceCheck{}
	for _, c := range checks {
		byNode[c.NodeID] = c
		require.Equal(t, "pool_1", c.PoolID)
		require.Equal(t, "site_1", c.SiteID)
		require.Equal(t, "ten_1", c.OwnerTenantID)
		require.Equal(t, "H100", c.GPUModel)
		require.EqualValues(t, 8, c.ExpectGPUCount)
	}
	require.Equal(t, "cmd-late", byNode["n-late"].CommandID)
	require.Equal(t, "running", byNode["n-late"].CommandState)
	require.True(t, byNode["n-late"].CommandDeadline.Equal(now))
	require.Equal(t, 1, byNode["n-late"].Attempts, "only the delivered acceptance command counts")
	require.Equal(t, "", byNode["n-none"].CommandID, "a user command counted as acceptance")
	require.Equal(t, 0, byNode["n-none"].Attempts)

	// Limit applies.
	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		one, err := store.ClaimDueAcceptances(ctx, tx, now, 1)
		require.Equal(t, []string{"n-done"}, one)
		return err
	}))
}

// TestExpireCommands: open commands expire with the reason for the state
// they were in (queued, delivered, running), and the function says which;
// a finished command is left alone, and an error already recorded is kept.
func TestExpireCommands(t *testing.T) {
	t.Parallel()
	db, now := acceptanceDB(t)
	ctx := t.Context()
	reasons := store.ExpiryReasons{Queued: "never delivered", Delivered: "never started", Running: "never finished"}
	expired, err := store.ExpireCommands(ctx, db.Pool, now, []string{"cmd-user", "cmd-late", "cmd-done", "cmd-open"}, reasons)
	require.NoError(t, err)
	require.Equal(t, []store.ExpiredCommand{{ID: "cmd-late", State: "running"}, {ID: "cmd-open", State: "delivered"},
		{ID: "cmd-user", State: "queued"}}, expired)
	rows, err := db.Pool.Query(ctx, `SELECT id, state, error FROM commands
		WHERE id IN ('cmd-user', 'cmd-late', 'cmd-done', 'cmd-open') ORDER BY id`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([3]string, error) {
		var v [3]string
		err := r.Scan(&v[0], &v[1], &v[2])
		return v, err
	})
	require.NoError(t, err)
	require.Equal(t, [][3]string{
		{"cmd-done", "succeeded", ""},
		{"cmd-late", "expired", "never finished"},
		{"cmd-open", "expired", "daemon said so"},
		{"cmd-user", "expired", "never delivered"},
	}, got)

	again, err := store.ExpireCommands(ctx, db.Pool, now, []string{"cmd-user", "cmd-late"}, reasons)
	require.NoError(t, err)
	require.Empty(t, again, "expired commands are not expired again")
}

func TestAdoptAndFailOnlyAccepting(t *testing.T) {
	t.Parallel()
	db, now := acceptanceDB(t)
	ctx := t.Context()
	dev := store.NodeDevice{Index: 0, UUID: "GPU-x", Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 1, Healthy: true}
	adopted, err := store.AdoptNodes(ctx, db.Pool, nil, now, []store.Adoption{
		{NodeID: "n-done", PoolID: "pool_1", OwnerTenantID: "ten_1", Spec: []byte(`{}`), Inventory: []byte(`{"gpus":[{}]}`),
			Devices: []store.NodeDevice{dev}},
		{NodeID: "n-join", PoolID: "pool_1", OwnerTenantID: "ten_1", Spec: []byte(`{}`), Inventory: []byte(`{}`),
			Devices: []store.NodeDevice{dev}},
	})
	require.NoError(t, err)
	require.Equal(t, []string{"n-done"}, adopted)
	failed, err := store.FailAcceptance(ctx, db.Pool, now, []store.AcceptanceFailure{
		{NodeID: "n-late", PoolID: "pool_1", OwnerTenantID: "ten_1", Reason: "no", Inventory: []byte(`{"gpus":[{}]}`),
			Devices: []store.NodeDevice{dev}},
		{NodeID: "n-done", PoolID: "pool_1", OwnerTenantID: "ten_1", Reason: "already adopted", Inventory: []byte(`{}`)},
	})
	require.NoError(t, err)
	require.Equal(t, []string{"n-late"}, failed)

	n, err := store.GetNode(ctx, db.Pool, store.AllTenants, "n-done")
	require.NoError(t, err)
	require.Equal(t, store.NodeAdopted, n.ProvisionState)
	require.EqualValues(t, 1, n.SpecGeneration)
	require.Len(t, n.Devices, 1)
	n, err = store.GetNode(ctx, db.Pool, store.AllTenants, "n-join")
	require.NoError(t, err)
	require.Equal(t, store.NodeJoining, n.ProvisionState)
	require.Empty(t, n.Devices)
	n, err = store.GetNode(ctx, db.Pool, store.AllTenants, "n-late")
	require.NoError(t, err)
	require.Equal(t, store.NodeAcceptanceFailed, n.ProvisionState)
	require.Equal(t, "no", n.ProvisionReason)
	require.Len(t, n.Devices, 1, "the GPUs a failed node reported are recorded")
	require.Equal(t, "GPU-x", n.Devices[0].UUID)
	n, err = store.GetNode(ctx, db.Pool, store.AllTenants, "n-done")
	require.NoError(t, err)
	require.Len(t, n.Devices, 1, "a node no longer accepting keeps its devices")

	rows, err := db.Pool.Query(ctx, `SELECT tenant_id || ' ' || type || ' ' || subject_id FROM events ORDER BY id`)
	require.NoError(t, err)
	events, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"ten_1 node.adopted n-done", "ten_1 node.acceptance_failed n-late"}, events)
}

// TestAdoptAndFailReplaceDevices: a node's adoption replaces the devices it
// had (the GPUs reported by an earlier acceptance), keys and all, and a
// failure that reported none clears them, each in one statement with the
// delete.
func TestAdoptAndFailReplaceDevices(t *testing.T) {
	t.Parallel()
	db, now := acceptanceDB(t)
	ctx := t.Context()
	for _, id := range []string{"adopt-me", "fail-me"} {
		storetest.Node(t, db, &storetest.NodeOpts{ID: id, PoolID: "pool_1", State: store.NodeAccepting, GPUs: 2})
	}
	dev := store.NodeDevice{Index: 1, UUID: "GPU-new", Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 2, Healthy: true}
	generation := func(id string) (g int64) {
		t.Helper()
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT capacity_generation FROM nodes WHERE id = $1`, id).Scan(&g))
		return g
	}
	before := generation("adopt-me")
	adopted, err := store.AdoptNodes(ctx, db.Pool, nil, now, []store.Adoption{{NodeID: "adopt-me", PoolID: "pool_1",
		OwnerTenantID: "ten_1", Spec: []byte(`{}`), Inventory: []byte(`{"gpus":[{}]}`), Devices: []store.NodeDevice{dev}}})
	require.NoError(t, err)
	require.Equal(t, []string{"adopt-me"}, adopted)
	require.Equal(t, before+1, generation("adopt-me"),
		"the adoption moves the capacity generation once: the devices are written before it, while the node is no capacity")
	failed, err := store.FailAcceptance(ctx, db.Pool, now, []store.AcceptanceFailure{{NodeID: "fail-me", PoolID: "pool_1",
		OwnerTenantID: "ten_1", Reason: "no GPUs", Inventory: []byte(`{}`)}})
	require.NoError(t, err)
	require.Equal(t, []string{"fail-me"}, failed)

	n, err := store.GetNode(ctx, db.Pool, store.AllTenants, "adopt-me")
	require.NoError(t, err)
	require.Len(t, n.Devices, 1)
	require.Equal(t, int32(1), n.Devices[0].Index)
	require.Equal(t, "GPU-new", n.Devices[0].UUID)
	n, err = store.GetNode(ctx, db.Pool, store.AllTenants, "fail-me")
	require.NoError(t, err)
	require.Empty(t, n.Devices, "a failure that reported no GPUs clears them")
}
