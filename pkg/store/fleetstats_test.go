package store_test

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// TestFleetStatsAt counts what the controllers' gauges show: unrevoked nodes
// by provision state and reachability, the GPUs of adopted nodes per pool
// booked now or free, live reservations by state, open commands by kind and
// state, and the outbox's backlog with the age of its oldest row.
func TestFleetStatsAt(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 3, 4, 5, 6, 7, 0, time.UTC)
	db := storetest.New(t, clock.NewFake(now))
	ctx := t.Context()
	f := storetest.NewFleetWith(t, db, storetest.FleetOpts{Name: "fs", GPUs: []int{8, 4, 2, 2}, Node: func(i int, n *storetest.NodeOpts) {
		switch i {
		case 2:
			n.Reachable = false
		case 3:
			n.RevokedAt = now // not counted
		}
	}})
	storetest.Node(t, db, &storetest.NodeOpts{PoolID: f.PoolID, State: store.NodeJoining})
	tenant := f.Tenant(t, "fs-tenant", 16)
	storetest.Reservation(t, db, &storetest.ReservationOpts{TenantID: tenant, PoolID: f.PoolID, State: store.ReservationActive,
		NodeID: f.Nodes[0], DeviceIndexes: []int32{0, 1, 2}, SpecGeneration: 1, StartAt: now.Add(-time.Hour), EndAt: now.Add(time.Hour),
		PlacedAt: now.Add(-time.Hour), ActiveAt: now.Add(-time.Hour)})
	storetest.Reservation(t, db, &storetest.ReservationOpts{TenantID: tenant, PoolID: f.PoolID, StartAt: now, EndAt: now.Add(time.Hour)})
	storetest.Command(t, db, &storetest.CommandOpts{NodeID: f.Nodes[1], Deadline: now.Add(time.Minute)})
	storetest.Command(t, db, &storetest.CommandOpts{NodeID: f.Nodes[1], State: "succeeded", Deadline: now.Add(time.Minute)})
	_, err := db.Pool.Exec(ctx, `DELETE FROM outbox`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO outbox (subject, payload, created_at) VALUES ('bc.poke.scheduler', '', $1), ('bc.poke.scheduler', '', $2)`,
		now.Add(-90*time.Second), now.Add(-time.Second))
	require.NoError(t, err)

	s, err := store.FleetStatsAt(ctx, db.Pool, now)
	require.NoError(t, err)
	nodes := map[string]int64{}
	for _, n := range s.Nodes {
		nodes[n.ProvisionState+map[bool]string{true: "/reachable", false: "/unreachable"}[n.Reachable]] = n.N
	}
	require.Empty(t, cmp.Diff(map[string]int64{"adopted/reachable": 2, "adopted/unreachable": 1, "joining/unreachable": 1}, nodes))
	require.Empty(t, cmp.Diff([]store.PoolGPUCount{
		{PoolID: f.PoolID, PoolName: "pool-fs", State: store.GPUBooked, N: 3},
		{PoolID: f.PoolID, PoolName: "pool-fs", State: store.GPUFree, N: 11},
	}, s.GPUs, cmpSortGPUs))
	require.Empty(t, cmp.Diff(map[string]int64{store.ReservationActive: 1, store.ReservationPending: 1}, s.Reservations))
	require.Empty(t, cmp.Diff([]store.CommandCount{{Kind: store.CommandDiagNVML, State: "queued", N: 1}}, s.Commands))
	require.Equal(t, int64(2), s.OutboxRows)
	require.Equal(t, 90*time.Second, s.OutboxAge)
}

var cmpSortGPUs = cmp.Transformer("sort", func(in []store.PoolGPUCount) map[string]store.PoolGPUCount {
	out := map[string]store.PoolGPUCount{}
	for _, g := range in {
		out[g.PoolID+"/"+g.State] = g
	}
	return out
})
