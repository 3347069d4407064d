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

// TestExpiryFailsWhatWasNeverPlaced: at their end time, a placed
// reservation expires (its allocation leaves the spec), and one still
// pending fails with the reason that it was never placed
// (reservation.failed), not expired without a reason.
func TestExpiryFailsWhatWasNeverPlaced(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(start)
	db := storetest.New(t, clk)
	ctx := t.Context()
	f := storetest.NewFleet(t, db, "expiry", 8)
	tenant := f.Tenant(t, "expiry-tenant", 64)
	reserve := func(gpus int32) store.Reservation {
		r, err := f.Reserve(ctx, tenant, gpus, time.Hour)
		require.NoError(t, err)
		return r
	}
	placed, pending := reserve(4), reserve(6)
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.PlaceReservations(ctx, tx, nil, db.Now(), []store.Placement{{ReservationID: placed.ID, TenantID: tenant,
			NodeID: f.Nodes[0], Devices: []int32{0, 1, 2, 3}, Lower: db.Now(), Upper: placed.EndAt}})
		return err
	}))
	e := &controllers.Expiry{DB: db, Clock: clk, Batch: 1}
	n, err := e.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "nothing is due")

	clk.Advance(time.Hour)
	n, err = e.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	get := func(id string) store.Reservation {
		r, err := store.GetReservation(ctx, db.Pool, store.AllTenants, id)
		require.NoError(t, err)
		return r
	}
	require.Equal(t, store.ReservationExpired, get(placed.ID).State)
	got := get(pending.ID)
	require.Equal(t, store.ReservationFailed, got.State)
	require.Equal(t, "never placed: no node had 6 free GPUs before its end time", got.Reason)
	rows, err := db.Pool.Query(ctx, `SELECT type FROM events WHERE subject_id = $1 ORDER BY id`, pending.ID)
	require.NoError(t, err)
	types, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"reservation.created", "reservation.failed"}, types)

	n, err = e.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "ended once")
}
