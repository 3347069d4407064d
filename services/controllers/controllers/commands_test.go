package controllers_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

// TestCommandExpiry: a user command still open at its deadline expires with
// a command.expired event, once; a command that finished, one not yet due
// and an acceptance command are left alone; a late report of the expired
// command changes nothing.
func TestCommandExpiry(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	clk := clock.NewFake(start)
	db := storetest.New(t, clk)
	ctx := t.Context()
	storetest.Tenant(t, db, &storetest.TenantOpts{ID: "ten_1", Name: "one"})
	storetest.Site(t, db, &storetest.SiteOpts{ID: "site_1", Name: "dev-1"})
	storetest.Pool(t, db, &storetest.PoolOpts{ID: "pool_1", SiteID: "site_1", OwnerTenantID: "ten_1", Name: "p"})
	storetest.Node(t, db, &storetest.NodeOpts{ID: "n1", PoolID: "pool_1", State: store.NodeAdopted})
	storetest.Node(t, db, &storetest.NodeOpts{ID: "n2", PoolID: "pool_1", State: store.NodeAccepting})
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_acc", NodeID: "n2", Purpose: "acceptance", State: "delivered",
		Deadline: start})
	for _, n := range []store.NewCommand{
		{Scope: store.AllTenants, ID: "cmd_a", NodeID: "n1", Kind: store.CommandNodeReboot, Deadline: start.Add(time.Minute)},
		{Scope: store.AllTenants, ID: "cmd_b", NodeID: "n1", Kind: store.CommandDiagNVML, Deadline: start.Add(time.Minute)},
		{Scope: store.AllTenants, ID: "cmd_c", NodeID: "n1", Kind: store.CommandLogsCollect, Deadline: start.Add(time.Hour)},
	} {
		require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
			_, err := store.QueueCommand(ctx, tx, nil, start, n)
			return err
		}))
	}
	// The daemon started cmd_a and finished cmd_b.
	_, err := store.ApplySessionCommandUpdates(ctx, db.Pool, []store.SessionCommandUpdate{
		{NodeID: "n1", CommandID: "cmd_a", State: "running", Now: start},
		{NodeID: "n1", CommandID: "cmd_b", State: "succeeded", Now: start},
	})
	require.NoError(t, err)

	e := &controllers.CommandExpiry{DB: db, Clock: clk, Batch: 1}
	n, err := e.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "nothing is due before the deadline")

	clk.Advance(time.Minute)
	n, err = e.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = e.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, n)

	states := map[string]string{}
	rows, err := db.Pool.Query(ctx, `SELECT id, state FROM commands`)
	require.NoError(t, err)
	for rows.Next() {
		var id, state string
		require.NoError(t, rows.Scan(&id, &state))
		states[id] = state
	}
	require.NoError(t, rows.Err())
	require.Equal(t, map[string]string{"cmd_a": "expired", "cmd_b": "succeeded", "cmd_c": "queued", "cmd_acc": "delivered"}, states)
	var events int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM events WHERE type = 'command.expired' AND subject_id = 'cmd_a'
		AND tenant_id = 'ten_1'`).Scan(&events))
	require.Equal(t, 1, events)

	// The daemon's late report does not revive it.
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		out, err := store.ApplySessionCommandUpdates(ctx, tx, []store.SessionCommandUpdate{{NodeID: "n1", CommandID: "cmd_a",
			State: "succeeded", Now: clk.Now()}})
		require.NoError(t, err)
		require.False(t, out[0].Applied)
		return nil
	}))
}
