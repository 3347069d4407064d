package scheduler_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// TestPlacesOnAdoptedNodesOnly: a node that failed acceptance keeps the
// GPUs it reported (node_devices, for operators to see), and a node still
// accepting may have some too, but the scheduler never places on either:
// only on adopted nodes. A reservation that finds no room on them waits.
func TestPlacesOnAdoptedNodesOnly(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	f := storetest.NewFleetWith(t, db, storetest.FleetOpts{Name: "adopted", GPUs: []int{8, 8, 8},
		Node: func(i int, o *storetest.NodeOpts) {
			switch i {
			case 1:
				o.State, o.Reason = store.NodeAcceptanceFailed, "expected H100 GPUs"
			case 2:
				o.State = store.NodeAccepting
			}
		}})
	tenant := f.Tenant(t, "adopted-tenant", 64)
	adopted, failed, accepting := f.Nodes[0], f.Nodes[1], f.Nodes[2]
	srv, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: "a"}}, scheduler.Deps{DB: db, NC: startNATS(t), Clock: clk})
	require.NoError(t, err)

	var ids []string
	for range 3 {
		r, err := f.Reserve(ctx, tenant, 8, time.Hour)
		require.NoError(t, err)
		require.Equal(t, store.ReservationPending, r.State)
		ids = append(ids, r.ID)
	}
	res, err := srv.Schedule(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Placed)
	res, err = srv.Schedule(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Placed)

	placedOn := map[string]int{}
	for _, id := range ids {
		r, err := store.GetReservation(ctx, db.Pool, store.AllTenants, id)
		require.NoError(t, err)
		if r.NodeID != "" {
			placedOn[r.NodeID]++
		} else {
			require.Equal(t, store.ReservationPending, r.State, "waits for the adopted node")
		}
	}
	require.Equal(t, map[string]int{adopted: 1}, placedOn)
	var booked int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM bookings WHERE node_id = ANY($1)`,
		[]string{failed, accepting}).Scan(&booked))
	require.Zero(t, booked, "nothing booked on a node that is not adopted")
}
