package scheduler_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// TestPendingReasons: a pass that cannot place a reservation says why in
// its reason, and writes it once (a pass that finds the same reason writes
// nothing); past the starvation bound the newer ones say whom they wait
// behind; placing it clears the reason.
func TestPendingReasons(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	f := storetest.NewFleet(t, db, "reasons", 8)
	tenant := f.Tenant(t, "reasons-tenant", 64)
	srv, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: "a"}, StarvationBound: 5 * time.Minute},
		scheduler.Deps{DB: db, NC: startNATS(t), Clock: clk})
	require.NoError(t, err)
	reserve := func(gpus int32, d time.Duration) string {
		r, err := f.Reserve(ctx, tenant, gpus, d)
		require.NoError(t, err)
		return r.ID
	}
	type row struct {
		State, Reason string
		Updated       time.Time
	}
	get := func(id string) row {
		var r row
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT state, reason, updated_at FROM reservations WHERE id = $1`, id).
			Scan(&r.State, &r.Reason, &r.Updated))
		return r
	}
	pass := func() scheduler.PassResult {
		res, err := srv.Schedule(ctx)
		require.NoError(t, err)
		return res
	}

	held := reserve(6, time.Hour)
	// Queue order is (created_at, id); ids of one millisecond sort by time
	// only while no other test takes an id in between (ulid.Monotonic).
	clk.Advance(time.Millisecond)
	big := reserve(4, 3*time.Hour)
	require.Equal(t, 1, pass().Placed)
	first := get(big)
	require.Equal(t, store.ReservationPending, first.State)
	require.Equal(t, fmt.Sprintf("waiting: no node of pool %s has 4 free GPUs now (largest free: 2)", f.PoolID), first.Reason)

	clk.Advance(time.Second)
	require.Equal(t, 1, pass().Waiting)
	require.Equal(t, first, get(big), "the same reason is not written again")

	// Past the bound, big keeps the node from when held ends; a newer
	// request that would hold GPUs past then waits behind it.
	clk.Advance(5 * time.Minute)
	small := reserve(1, 2*time.Hour)
	require.Equal(t, 2, pass().Waiting)
	require.Equal(t, fmt.Sprintf("waiting: no node of pool %s has 4 free GPUs now (largest free: 2); next in line, on node %s from 2030-01-01T11:00:00Z",
		f.PoolID, f.Nodes[0]), get(big).Reason)
	require.Equal(t, "waiting behind "+big+" (past its bounded wait)", get(small).Reason)

	// held is released: big is placed first, then small; reasons cleared.
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.EndReservation(ctx, tx, nil, store.AllTenants, db.Now(), held, store.ReservationReleased)
		return err
	}))
	require.Equal(t, 2, pass().Placed)
	for _, id := range []string{big, small} {
		r := get(id)
		require.Equal(t, store.ReservationBinding, r.State)
		require.Empty(t, r.Reason)
	}
}

// TestPendingReasonWhenAllCordoned: with every node of the pool cordoned
// (and one unreachable too), a reservation's reason says so instead of
// "largest free: 0" about nodes with every GPU free.
func TestPendingReasonWhenAllCordoned(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	// Three nodes are cordoned, the fourth unreachable.
	f := storetest.NewFleetWith(t, db, storetest.FleetOpts{Name: "cordoned", GPUs: []int{8, 8, 8, 8},
		Node: func(i int, o *storetest.NodeOpts) {
			if i < 3 {
				o.Cordoned, o.CordonReason = true, "maintenance"
			} else {
				o.Reachable = false
			}
		}})
	tenant := f.Tenant(t, "cordoned-tenant", 64)
	srv, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: "a"}, StarvationBound: 5 * time.Minute},
		scheduler.Deps{DB: db, NC: startNATS(t), Clock: clk})
	require.NoError(t, err)
	r, err := f.Reserve(ctx, tenant, 1, time.Hour)
	require.NoError(t, err)
	res, err := srv.Schedule(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Waiting)
	var reason string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT reason FROM reservations WHERE id = $1`, r.ID).Scan(&reason))
	require.Equal(t, fmt.Sprintf("waiting: no node of pool %s has 1 free GPUs now (3 nodes cordoned, 1 unreachable; "+
		"largest free on a placeable node: 0)", f.PoolID), reason)
}
