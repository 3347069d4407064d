package scheduler_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
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

func newScheduler(t *testing.T, db *store.DB, clk clock.Clock, holder string) *scheduler.Server {
	t.Helper()
	s, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: holder}},
		scheduler.Deps{DB: db, NC: startNATS(t), Clock: clk})
	require.NoError(t, err)
	return s
}

// requireViewIsDatabase fails unless the replica's view of the pool is what
// the database holds: PoolCapacity's nodes and open bookings, at the
// generations the database has.
func requireViewIsDatabase(t *testing.T, s *scheduler.Server, db *store.DB, poolID, what string) {
	t.Helper()
	ctx := t.Context()
	now := db.Now()
	nodes, booked, gens, ok := s.CapacityView(poolID)
	require.True(t, ok, "%s: the replica holds a view of the pool", what)
	wantNodes, wantBooked, err := store.PoolCapacity(ctx, db.Pool, poolID, now)
	require.NoError(t, err)
	require.Equal(t, wantNodes, nodes, "%s: the view's nodes", what)
	var open []store.BookedInterval
	for _, b := range booked {
		if now.Before(b.Upper) {
			open = append(open, utc(b))
		}
	}
	for i := range wantBooked {
		wantBooked[i] = utc(wantBooked[i])
	}
	require.ElementsMatch(t, wantBooked, open, "%s: the view's bookings", what)
	got, err := store.PoolCapacitySince(ctx, db.Pool, poolID, now, gens)
	require.NoError(t, err)
	for _, c := range got {
		require.False(t, c.Changed, "%s: node %s is at generation %d, the view at %d", what, c.ID, c.Generation, gens[c.ID])
	}
}

// utc is b with its times in UTC (the instants are what count).
func utc(b store.BookedInterval) store.BookedInterval {
	b.Lower, b.Upper = b.Lower.UTC(), b.Upper.UTC()
	return b
}

// TestCapacityViewFollowsTheDatabase: through a long random sequence of
// reservations, releases, cordons, lost and returning nodes, devices
// turning unhealthy, time passing and a revocation, the replica's view of
// its pool is, after each pass that visited the pool, what PoolCapacity
// reads (its own placements applied without a read), and, brought up to
// date as a pass does, what PoolCapacity reads after any change.
func TestCapacityViewFollowsTheDatabase(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 0, 0, 0, time.FixedZone("PST", -8*3600)))
	db := storetest.New(t, clk)
	ctx := t.Context()
	f := storetest.NewFleet(t, db, "view", 4, 4, 8, 2, 8, 4)
	tenant := f.Tenant(t, "view-tenant", 10_000)
	s := newScheduler(t, db, clk, "a")
	rng := rand.New(rand.NewPCG(19, 21))
	inTx := func(fn func(tx pgx.Tx) error) {
		t.Helper()
		require.NoError(t, db.InTx(ctx, fn))
	}
	node := func() string { return f.Nodes[rng.IntN(len(f.Nodes))] }
	revoked := false
	for step := range 120 {
		var what string
		switch op := rng.IntN(10); {
		case op < 4:
			gpus := int32(1 + rng.IntN(8))
			d := []time.Duration{time.Hour, 5 * time.Minute, 90 * time.Second}[rng.IntN(3)]
			_, err := f.Reserve(ctx, tenant, gpus, d)
			require.NoError(t, err)
			what = "a reservation"
		case op == 4:
			rs, err := store.ListReservations(ctx, db.Pool, store.ReservationFilter{Scope: store.AllTenants, State: store.ReservationBinding})
			require.NoError(t, err)
			if len(rs) == 0 {
				continue
			}
			r := rs[rng.IntN(len(rs))]
			inTx(func(tx pgx.Tx) error {
				_, err := store.EndReservation(ctx, tx, nil, store.AllTenants, db.Now(), r.ID, store.ReservationReleased)
				return err
			})
			what = "a release"
		case op == 5:
			n := node()
			inTx(func(tx pgx.Tx) error {
				if rng.IntN(2) == 0 {
					_, err := store.UncordonNode(ctx, tx, store.AllTenants, db.Now(), n)
					return err
				}
				_, err := store.CordonNode(ctx, tx, store.AllTenants, db.Now(), n, "maintenance")
				if errors.Is(err, store.ErrNodeRevoked) {
					return nil
				}
				return err
			})
			what = "a cordon or uncordon"
		case op == 6:
			n := node()
			inTx(func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `UPDATE nodes SET reachable = NOT reachable WHERE id = $1`, n)
				return err
			})
			what = "a node lost or back"
		case op == 7:
			n := node()
			inTx(func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `UPDATE node_devices SET healthy = NOT healthy WHERE node_id = $1 AND device_index = $2`,
					n, rng.IntN(2))
				return err
			})
			what = "a device's health"
		case op == 8:
			clk.Advance(time.Duration(1+rng.IntN(4)) * time.Minute)
			what = "time passing"
		default:
			if revoked || step < 60 {
				continue
			}
			revoked = true
			n := node()
			inTx(func(tx pgx.Tx) error {
				if _, err := store.RevokeNode(ctx, tx, store.AllTenants, db.Now(), n, "decommissioned"); err != nil {
					return err
				}
				_, err := store.FailNodeReservations(ctx, tx, nil, db.Now(), n, "node revoked")
				return err
			})
			what = "a revocation"
		}
		res, err := s.Schedule(ctx)
		require.NoError(t, err)
		require.Zero(t, res.Conflicts, "step %d (%s): a single replica whose view follows the database has no conflict", step, what)
		if res.Placed+res.Waiting+res.Failed > 0 {
			requireViewIsDatabase(t, s, db, f.PoolID, "after the pass of step "+what)
		}
		require.NoError(t, s.RefreshCapacityView(ctx, f.PoolID))
		requireViewIsDatabase(t, s, db, f.PoolID, "brought up to date after "+what)
	}
	require.Positive(t, s.Placed())
}

// TestCapacityViewMissingABookingIsRebuilt: a booking written without a
// spec rebuild (a fixture's, which moves no generation) is missing from the
// replica's view, so the pass plans over it; the bookings' exclusion
// constraint refuses the placement, the view is read again whole, and the
// reservation is placed on the other node in the same pass.
func TestCapacityViewMissingABookingIsRebuilt(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	f := storetest.NewFleet(t, db, "stale", 4, 4)
	tenant := f.Tenant(t, "stale-tenant", 16)
	s := newScheduler(t, db, clk, "a")

	r1, err := f.Reserve(ctx, tenant, 2, time.Hour)
	require.NoError(t, err)
	res, err := s.Schedule(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Placed)
	got, err := store.GetReservation(ctx, db.Pool, store.AllTenants, r1.ID)
	require.NoError(t, err)
	require.Equal(t, f.Nodes[0], got.NodeID, "best fit, ties to the smaller id")

	hidden := storetest.Reservation(t, db, &storetest.ReservationOpts{TenantID: tenant, PoolID: f.PoolID, GPUs: 2,
		State: store.ReservationBinding, NodeID: f.Nodes[0], DeviceIndexes: []int32{2, 3}, PlacedAt: db.Now()})
	r2, err := f.Reserve(ctx, tenant, 2, time.Hour)
	require.NoError(t, err)
	res, err = s.Schedule(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Conflicts, "the view thought devices 2 and 3 of %s free", f.Nodes[0])
	require.Equal(t, 1, res.Placed)
	got, err = store.GetReservation(ctx, db.Pool, store.AllTenants, r2.ID)
	require.NoError(t, err)
	require.Equal(t, f.Nodes[1], got.NodeID)
	requireViewIsDatabase(t, s, db, f.PoolID, "after the conflict")
	_, booked, _, _ := s.CapacityView(f.PoolID)
	for i := range booked {
		booked[i] = utc(booked[i])
	}
	require.Contains(t, booked, utc(store.BookedInterval{NodeID: f.Nodes[0], DeviceIndex: 2, Lower: hidden.StartAt, Upper: hidden.EndAt}))
}

// TestCapacityViewReadsAnotherReplicasPlacements: a node another replica
// placed on has a new generation, so the first replica reads it again
// before it plans, and plans on it without a conflict.
func TestCapacityViewReadsAnotherReplicasPlacements(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	f := storetest.NewFleet(t, db, "replicas", 4, 4)
	tenant := f.Tenant(t, "replicas-tenant", 16)
	a, b := newScheduler(t, db, clk, "a"), newScheduler(t, db, clk, "b")
	schedule := func(s *scheduler.Server) scheduler.PassResult {
		t.Helper()
		_, err := f.Reserve(ctx, tenant, 2, time.Hour)
		require.NoError(t, err)
		res, err := s.Schedule(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, res.Placed)
		return res
	}
	schedule(a)
	schedule(b)
	schedule(b)
	res := schedule(a)
	require.Zero(t, res.Conflicts, "a read b's nodes again before planning")
	requireViewIsDatabase(t, a, db, f.PoolID, "a after b's placements")
	var overlaps int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM bookings x JOIN bookings y
		ON x.node_id = y.node_id AND x.device_index = y.device_index AND x.reservation_id < y.reservation_id
		AND x.during && y.during`).Scan(&overlaps))
	require.Zero(t, overlaps)
}

// TestPassStatements: with the pool's view current, a pass costs the same
// handful of statements whether it places 4 reservations or 40 (the
// pending read, the capacity read, and one placement transaction: BEGIN,
// the nodes' lock, the placements with their bookings, the allocations
// with the SSH CAs, the specs, the gateways' pokes, the events, COMMIT; the
// outbox's NOTIFY after it).
// Not parallel: the counter sees every statement of the process.
func TestPassStatements(t *testing.T) {
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	gpus := make([]int, 50)
	for i := range gpus {
		gpus[i] = 8
	}
	f := storetest.NewFleet(t, db, "statements", gpus...)
	tenant := f.Tenant(t, "statements-tenant", 8*50)
	s := newScheduler(t, db, clk, "a")
	pass := func(n int) ([]string, int) {
		t.Helper()
		for range n {
			_, err := f.Reserve(ctx, tenant, 2, time.Hour)
			require.NoError(t, err)
		}
		stmts := storetest.CountStatements()
		res, err := s.Schedule(context.Background())
		stmts.Stop()
		require.NoError(t, err)
		require.Equal(t, n, res.Placed)
		return stmts.SQL(), stmts.Count()
	}
	pass(40) // reads the pool whole
	sql4, n4 := pass(4)
	sql40, n40 := pass(40)
	require.LessOrEqual(t, n4, 12, strings.Join(sql4, "\n---\n"))
	require.Equal(t, n4, n40, "statements do not grow with the placements:\n%s", strings.Join(sql40, "\n---\n"))
}
