package store_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
)

// generations returns every node's capacity generation as PoolCapacitySince
// reads them (knowing none).
func (f placeFixture) generations() map[string]int64 {
	f.t.Helper()
	got, err := store.PoolCapacitySince(f.t.Context(), f.db.Pool, f.fleet.PoolID, f.db.Now(), nil)
	require.NoError(f.t, err)
	out := map[string]int64{}
	for _, c := range got {
		require.True(f.t, c.Changed, "a node the caller does not know is read whole")
		out[c.ID] = c.Generation
	}
	return out
}

func (f placeFixture) inTx(fn func(ctx context.Context, tx pgx.Tx) error) {
	f.t.Helper()
	require.NoError(f.t, f.db.InTx(f.t.Context(), func(tx pgx.Tx) error { return fn(f.t.Context(), tx) }))
}

// TestCapacityGenerationMoves: a node's capacity generation moves with every
// change of what placement reads of it (cordon, uncordon, its session's
// end, reachability, a placement's spec, a booking's end, its devices, its
// revocation), and not with what placement does not read (a heartbeat's
// last_seen, a cordon's reason alone).
func TestCapacityGenerationMoves(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "capgen", 4, 4)
	n0, n1 := f.fleet.Nodes[0], f.fleet.Nodes[1]
	gen := f.generations()
	moved := func(what string, node string) {
		t.Helper()
		now := f.generations()
		require.Greater(t, now[node], gen[node], "%s moves the generation of %s", what, node)
		for id, g := range now {
			if id != node {
				require.Equal(t, gen[id], g, "%s leaves the generation of %s", what, id)
			}
		}
		gen = now
	}
	still := func(what string) {
		t.Helper()
		require.Equal(t, gen, f.generations(), "%s moves no generation", what)
	}

	now := f.db.Now()
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE nodes SET last_seen = $2 WHERE id = $1`, n0, now)
		return err
	})
	still("a heartbeat")
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.CordonNode(ctx, tx, store.AllTenants, now, n0, "maintenance")
		return err
	})
	moved("a cordon", n0)
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE nodes SET cordon_reason = 'other' WHERE id = $1`, n0)
		return err
	})
	still("a cordon's reason")
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.UncordonNode(ctx, tx, store.AllTenants, now, n0)
		return err
	})
	moved("an uncordon", n0)

	r := f.reserve(2, time.Hour)
	res := f.placeAt(gen, store.Placement{ReservationID: r.ID, TenantID: f.tenant, NodeID: n1, Devices: []int32{0, 1},
		Lower: now, Upper: r.EndAt})
	require.Equal(t, []string{r.ID}, res.Placed)
	require.Equal(t, map[string]int64{n1: gen[n1] + 1}, res.Generations, "the placement says the generation it leaves")
	moved("a placement", n1)

	f.clk.Advance(time.Minute)
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.EndReservation(ctx, tx, nil, store.AllTenants, f.db.Now(), r.ID, store.ReservationReleased)
		return err
	})
	moved("a release (its bookings end)", n1)

	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE node_devices SET healthy = false WHERE node_id = $1 AND device_index = 3`, n0)
		return err
	})
	moved("a device turning unhealthy", n0)
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `DELETE FROM node_devices WHERE node_id = $1 AND device_index = 3`, n0)
		return err
	})
	moved("a device removed", n0)
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO node_devices (node_id, device_index, uuid, model, memory_bytes, healthy)
			VALUES ($1, 3, 'GPU-back', 'NVIDIA H100 80GB HBM3', 1, true)`, n0)
		return err
	})
	moved("a device added", n0)

	node, err := store.GetNode(t.Context(), f.db.Pool, store.AllTenants, n0)
	require.NoError(t, err)
	require.NotEmpty(t, node.SessionID)
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.CloseSession(ctx, tx, f.db.Now(), n0, node.SessionID, time.Time{})
		return err
	})
	moved("the end of its session", n0)
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE nodes SET reachable = false WHERE id = $1`, n0)
		return err
	})
	moved("its loss of reachability", n0)

	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		_, err := store.RevokeNode(ctx, tx, store.AllTenants, f.db.Now(), n1, "stolen")
		return err
	})
	got := f.generations()
	require.NotContains(t, got, n1, "a revoked node is no capacity")
	require.Equal(t, gen[n0], got[n0])
}

func (f placeFixture) placeAt(gens map[string]int64, ps ...store.Placement) store.PlaceResult {
	f.t.Helper()
	var res store.PlaceResult
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		var err error
		res, err = store.PlaceReservationsAt(ctx, tx, nil, f.db.Now(), ps, gens)
		return err
	})
	return res
}

// TestPlaceReservationsAtSkipsChangedNodes: a placement planned on a node's
// capacity generation is not written once the node has changed since (here
// a cordon lifted again: the same state, another generation), and the other
// nodes' placements of the batch are; planned again on the generation read
// now, it is written.
func TestPlaceReservationsAtSkipsChangedNodes(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "capskip", 4, 4)
	n0, n1 := f.fleet.Nodes[0], f.fleet.Nodes[1]
	gens := f.generations()
	now := f.db.Now()
	f.inTx(func(ctx context.Context, tx pgx.Tx) error {
		if _, err := store.CordonNode(ctx, tx, store.AllTenants, now, n0, "a moment"); err != nil {
			return err
		}
		_, err := store.UncordonNode(ctx, tx, store.AllTenants, now, n0)
		return err
	})
	a, b := f.reserve(2, time.Hour), f.reserve(2, time.Hour)
	pa := store.Placement{ReservationID: a.ID, TenantID: f.tenant, NodeID: n0, Devices: []int32{0, 1}, Lower: now, Upper: a.EndAt}
	pb := store.Placement{ReservationID: b.ID, TenantID: f.tenant, NodeID: n1, Devices: []int32{0, 1}, Lower: now, Upper: b.EndAt}
	res := f.placeAt(gens, pa, pb)
	require.Equal(t, []string{b.ID}, res.Placed)
	require.Equal(t, []string{n0}, res.Skipped)
	require.Equal(t, store.ReservationPending, f.get(a.ID).State)
	require.Equal(t, store.ReservationBinding, f.get(b.ID).State)

	res = f.placeAt(f.generations(), pa)
	require.Equal(t, []string{a.ID}, res.Placed)
	require.Empty(t, res.Skipped)
}

// TestPoolCapacitySinceMatchesPoolCapacity: read knowing nothing,
// PoolCapacitySince returns what PoolCapacity does; read knowing every
// generation, nothing changed; after a placement, only its node changed,
// with what PoolCapacity now says of it.
func TestPoolCapacitySinceMatchesPoolCapacity(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "capsince", 4, 8, 2)
	ctx := t.Context()
	r := f.reserve(3, time.Hour)
	now := f.db.Now()
	_, err := f.place(nil, store.Placement{ReservationID: r.ID, TenantID: f.tenant, NodeID: f.fleet.Nodes[1],
		Devices: []int32{1, 2, 5}, Lower: now, Upper: r.EndAt})
	require.NoError(t, err)

	check := func(known map[string]int64, changed ...string) map[string]int64 {
		t.Helper()
		nodes, booked, err := store.PoolCapacity(ctx, f.db.Pool, f.fleet.PoolID, f.db.Now())
		require.NoError(t, err)
		got, err := store.PoolCapacitySince(ctx, f.db.Pool, f.fleet.PoolID, f.db.Now(), known)
		require.NoError(t, err)
		require.Len(t, got, len(nodes))
		gens := map[string]int64{}
		var changedIDs []string
		for i, c := range got {
			gens[c.ID] = c.Generation
			require.Equal(t, nodes[i].ID, c.ID)
			if !c.Changed {
				continue
			}
			changedIDs = append(changedIDs, c.ID)
			require.Equal(t, nodes[i], c.Node)
			var want []store.BookedInterval
			for _, b := range booked {
				if b.NodeID == c.ID {
					want = append(want, b)
				}
			}
			require.ElementsMatch(t, want, c.Booked)
		}
		slices.Sort(changed)
		require.Equal(t, changed, changedIDs)
		return gens
	}
	gens := check(nil, f.fleet.Nodes...)
	check(gens)
	r2 := f.reserve(2, time.Hour)
	_, err = f.place(nil, store.Placement{ReservationID: r2.ID, TenantID: f.tenant, NodeID: f.fleet.Nodes[2],
		Devices: []int32{0, 1}, Lower: f.db.Now(), Upper: r2.EndAt})
	require.NoError(t, err)
	check(gens, f.fleet.Nodes[2])
}

// oldFailedReservation writes a reservation of f's tenant on node that
// failed 72 hours ago, with its booking, for retention to delete.
func (f placeFixture) oldFailedReservation(id, node string) {
	f.t.Helper()
	ctx := f.t.Context()
	old := f.db.Now().Add(-72 * time.Hour)
	_, err := f.db.Pool.Exec(ctx, `INSERT INTO reservations (id, tenant_id, pool_id, gpus, start_at, end_at, state, reason,
		node_id, created_at, updated_at, placed_at, ended_at)
		VALUES ($1, $2, $3, 1, $4, $5, 'failed', 'lost', $6, $4, $5, $4, $5)`, id, f.tenant, f.fleet.PoolID, old, old.Add(time.Hour), node)
	require.NoError(f.t, err)
	_, err = f.db.Pool.Exec(ctx, `INSERT INTO bookings (reservation_id, node_id, device_index, during)
		VALUES ($1, $2, 0, tstzrange($3, $4, '[)'))`, id, node, old, old.Add(time.Hour))
	require.NoError(f.t, err)
}

// TestRetentionLeavesCapacity: deleting long-ended reservations with their
// bookings moves no capacity generation (they were no capacity), and takes
// no node's lock, so it never waits on, or deadlocks with, a writer that
// holds a node (here one that locks both nodes in id order, as placements
// do, after retention started).
func TestRetentionLeavesCapacity(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "retcap", 4, 4)
	ctx := t.Context()
	lo, hi := f.fleet.Nodes[0], f.fleet.Nodes[1]
	f.oldFailedReservation("res_old_lo", lo)
	f.oldFailedReservation("res_old_hi", hi)
	// lo's row after hi's in the heap, as a heartbeat's update leaves it.
	_, err := f.db.Pool.Exec(ctx, `UPDATE nodes SET last_seen = $2 WHERE id = $1`, lo, f.db.Now())
	require.NoError(t, err)
	before := f.generations()

	tx, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx, `SELECT id FROM nodes WHERE id = $1 FOR NO KEY UPDATE`, lo)
	require.NoError(t, err)

	// Bounded: waiting for the held node would be waiting for this test.
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	deleted, err := store.DeleteOldReservations(rctx, f.db.Pool, f.db.Now().Add(-time.Hour), 100)
	require.NoError(t, err)
	require.Equal(t, 2, deleted)
	_, err = tx.Exec(ctx, `SELECT id FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE`, []string{lo, hi})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, before, f.generations())
}
