package api_test

import (
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/api/apitest"
)

// TestListUsageCountsRunningReservations: a running reservation counts
// from its start, up to now, before the usage sink wrote its windows: the
// hours it has not written (the current one so far) are listed after the
// written ones, and in the total; an ended reservation counts its written
// windows only.
func TestListUsageCountsRunningReservations(t *testing.T) {
	t.Parallel()
	now := time.Date(2025, 3, 1, 10, 40, 0, 0, time.UTC)
	db := storetest.New(t, clock.NewFake(now))
	f := &fixture{db: db, url: apitest.Start(t, db)}
	tenant := apitest.Tenant(t, db, "acme")
	token := apitest.Token(t, db, tenant, iam.RoleViewer)
	pool := storetest.Pool(t, db, &storetest.PoolOpts{OwnerTenantID: tenant}).ID
	node := storetest.Node(t, db, &storetest.NodeOpts{PoolID: pool, GPUs: 8, State: store.NodeAdopted}).ID
	reservation := func(state string, gpus int32, devices []int32, start time.Time, end time.Time) string {
		o := &storetest.ReservationOpts{TenantID: tenant, PoolID: pool, GPUs: gpus, State: state, NodeID: node,
			DeviceIndexes: devices, StartAt: start, EndAt: end, PlacedAt: start, CreatedAt: start}
		if state == store.ReservationActive {
			o.ActiveAt = start
		} else {
			o.EndedAt = end
		}
		return storetest.Reservation(t, db, o).ID
	}
	// Active since 10:10 on 2 GPUs: 30 minutes so far, nothing written.
	fresh := reservation(store.ReservationActive, 2, []int32{0, 1}, now.Add(-30*time.Minute), now.Add(time.Hour))
	// Active since 08:30 on 1 GPU: the sink wrote 08:00, not yet 09:00.
	older := reservation(store.ReservationActive, 1, []int32{2}, now.Add(-130*time.Minute), now.Add(time.Hour))
	hour := now.Truncate(time.Hour)
	storetest.UsageWindow(t, db, &storetest.UsageWindowOpts{ReservationID: older, TenantID: tenant, PoolID: pool,
		WindowStart: hour.Add(-2 * time.Hour), GPUSeconds: 1800})
	// Released at 09:30, its windows written: listed as written.
	ended := reservation(store.ReservationReleased, 1, []int32{3}, hour.Add(-time.Hour), hour.Add(-30*time.Minute))
	storetest.UsageWindow(t, db, &storetest.UsageWindowOpts{ReservationID: ended, TenantID: tenant, PoolID: pool,
		WindowStart: hour.Add(-time.Hour), GPUSeconds: 1800})

	res, err := f.as(token).usage.ListUsage(t.Context(), connect.NewRequest(&computev1.ListUsageRequest{}))
	require.NoError(t, err)
	type window struct {
		res   string
		start time.Time
		secs  int64
	}
	var got []window
	for _, w := range res.Msg.Windows {
		got = append(got, window{w.ReservationId, w.WindowStart.AsTime().UTC(), w.GpuSeconds})
	}
	// By window start, then reservation id (ids grow with their creation).
	require.Equal(t, []window{
		{older, hour.Add(-2 * time.Hour), 1800},
		{older, hour.Add(-time.Hour), 3600},
		{ended, hour.Add(-time.Hour), 1800},
		{older, hour, 2400},
		{fresh, hour, 2 * 1800},
	}, got)
	require.EqualValues(t, 1800+3600+1800+3600+2400, res.Msg.TotalGpuSeconds)
}
