package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// TestRaceTwoSchedulers: 200 concurrent reservations of 1–8 GPUs from 4
// tenants (quota 40 each, 160 in all) against 8 nodes × 8 GPUs, while two
// scheduler instances place them at once without a lease between them. The
// database must show no overlapping bookings, no tenant over its quota, and
// every reservation binding (placed whole on one node, in its node's spec),
// pending only when no node has room for it, or failed with a reason; once
// the daemons bind, every placed one is active.
func TestRaceTwoSchedulers(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	nc := startNATS(t)
	ctx := t.Context()
	f := storetest.NewFleet(t, db, "race", 8, 8, 8, 8, 8, 8, 8, 8)
	const quota = 40
	tenants := make([]string, 4)
	for i := range tenants {
		tenants[i] = f.Tenant(t, fmt.Sprintf("race-tenant-%d", i), quota)
	}

	var scheds []*scheduler.Server
	for _, name := range []string{"a", "b"} {
		// Small batches so that the two instances interleave many
		// transactions.
		s, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: name}, Batch: 3},
			scheduler.Deps{DB: db, NC: nc})
		require.NoError(t, err)
		scheds = append(scheds, s)
	}
	stop := make(chan struct{})
	var loops sync.WaitGroup
	var conflicts [2]int
	for i, s := range scheds {
		loops.Add(1)
		go func() {
			defer loops.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				res, err := s.Schedule(ctx)
				if err != nil && ctx.Err() == nil {
					t.Errorf("scheduler %d: %v", i, err)
					return
				}
				conflicts[i] += res.Conflicts
			}
		}()
	}

	var wg sync.WaitGroup
	var mu sync.Mutex
	refused := 0
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gpus := int32(1 + rand.IntN(8))
			_, err := f.Reserve(ctx, tenants[i%4], gpus, time.Hour)
			if errors.Is(err, store.ErrQuotaExceeded) {
				mu.Lock()
				refused++
				mu.Unlock()
				return
			}
			if err != nil {
				t.Errorf("reserve %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	// Let both instances run over the final state.
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM reservations WHERE state = 'pending'`).Scan(&n))
		return n == 0 || fitsNowhere(t, db, f)
	}, 20*time.Second, 20*time.Millisecond)
	close(stop)
	loops.Wait()
	t.Logf("refused by quota: %d; conflicts a=%d b=%d; placed a=%d b=%d", refused, conflicts[0], conflicts[1],
		scheds[0].Placed(), scheds[1].Placed())
	require.Positive(t, refused, "the quotas (160 GPUs) are below the demand (about 900), so some requests are refused")

	// I1: no two bookings of one device overlap.
	var overlaps int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM bookings a JOIN bookings b
		ON a.node_id = b.node_id AND a.device_index = b.device_index AND a.reservation_id < b.reservation_id
		AND a.during && b.during`).Scan(&overlaps))
	require.Zero(t, overlaps)

	// Quota: no tenant holds more than its quota.
	rows, err := db.Pool.Query(ctx, `SELECT tenant_id, sum(gpus) FROM reservations
		WHERE state IN ('pending', 'binding', 'active') GROUP BY tenant_id`)
	require.NoError(t, err)
	for rows.Next() {
		var ten string
		var sum int
		require.NoError(t, rows.Scan(&ten, &sum))
		require.LessOrEqual(t, sum, quota, "tenant %s", ten)
	}
	require.NoError(t, rows.Err())

	// Every reservation: placed whole on one node, pending, or failed with
	// a reason.
	all, err := store.ListReservations(ctx, db.Pool, store.ReservationFilter{Scope: store.AllTenants})
	require.NoError(t, err)
	require.Equal(t, 200-refused, len(all))
	placed := map[string][]store.Reservation{}
	for _, r := range all {
		switch r.State {
		case store.ReservationBinding:
			require.NotEmpty(t, r.NodeID)
			require.Len(t, r.DeviceIndexes, int(r.GPUs), "whole reservation on one node: %s", r.ID)
			require.NotNil(t, r.SpecGeneration)
			placed[r.NodeID] = append(placed[r.NodeID], r)
		case store.ReservationPending:
			require.Empty(t, r.NodeID)
		case store.ReservationFailed:
			require.NotEmpty(t, r.Reason)
		default:
			t.Fatalf("reservation %s is %s", r.ID, r.State)
		}
	}
	require.NotEmpty(t, placed)
	// Each node's spec carries exactly its placed reservations.
	for _, nodeID := range f.Nodes {
		var spec []byte
		var gen int64
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT spec, spec_generation FROM nodes WHERE id = $1`, nodeID).Scan(&spec, &gen))
		ns := &gatewayv1.NodeSpec{}
		require.NoError(t, protojson.Unmarshal(spec, ns))
		want := map[string][]int32{}
		for _, r := range placed[nodeID] {
			want[r.ID] = r.DeviceIndexes
			require.LessOrEqual(t, *r.SpecGeneration, gen)
		}
		got := map[string][]int32{}
		for _, a := range ns.GetAllocations() {
			got[a.GetReservationId()] = a.GetDeviceIndexes()
		}
		require.Equal(t, want, got, "spec of %s", nodeID)
	}

	// The daemons bind what they were sent (as the gateway records their
	// AllocationBound): every placed reservation turns active, so every
	// reservation ends active, pending or failed with a reason.
	for nodeID, rs := range placed {
		var gen int64
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT spec_generation FROM nodes WHERE id = $1`, nodeID).Scan(&gen))
		for _, r := range rs {
			names := make([]string, len(r.DeviceIndexes))
			for i, d := range r.DeviceIndexes {
				names[i] = daemon.CDIName(d)
			}
			act, err := store.ActivateReservation(ctx, db.Pool, db.Now(), nodeID, r.ID, names, gen)
			require.NoError(t, err)
			require.True(t, act.Activated, "reservation %s", r.ID)
		}
	}
	all, err = store.ListReservations(ctx, db.Pool, store.ReservationFilter{Scope: store.AllTenants})
	require.NoError(t, err)
	for _, r := range all {
		switch r.State {
		case store.ReservationActive:
			require.Len(t, r.Binding, int(r.GPUs), "reservation %s", r.ID)
		case store.ReservationPending:
		case store.ReservationFailed:
			require.NotEmpty(t, r.Reason)
		default:
			t.Fatalf("reservation %s ended %s", r.ID, r.State)
		}
	}
}

// fitsNowhere reports whether no pending reservation fits the free GPUs of
// any node now (a scheduler has nothing left to do).
func fitsNowhere(t *testing.T, db *store.DB, f *storetest.Fleet) bool {
	t.Helper()
	var fits bool
	require.NoError(t, db.Pool.QueryRow(context.Background(), `SELECT EXISTS (
		SELECT 1 FROM reservations r WHERE r.state = 'pending' AND r.gpus <= (
			SELECT max(8 - (SELECT count(*) FROM bookings b WHERE b.node_id = n.id AND upper(b.during) > now()))
			FROM nodes n WHERE n.pool_id = $1))`, f.PoolID).Scan(&fits))
	return !fits
}
