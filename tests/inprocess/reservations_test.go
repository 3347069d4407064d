package inprocess_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

// reserve creates a reservation of tenant in the fixture's pool through the
// store (the API's path without HTTP).
func (f *fixture) reserve(t *testing.T, tenant string, gpus int32, d time.Duration) store.Reservation {
	t.Helper()
	db := f.stack.DB
	var out store.CreatedReservation
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		now := db.Now()
		var err error
		out, err = store.CreateReservation(t.Context(), tx, now, store.NewReservation{
			ID: ids.New(ids.Reservation, now), TenantID: tenant, PoolID: f.pool, GPUs: gpus, StartAt: now, EndAt: now.Add(d),
		})
		return err
	}))
	require.Equal(t, store.ReservationPending, out.Reservation.State)
	return out.Reservation
}

func (f *fixture) reservation(t *testing.T, id string) store.Reservation {
	t.Helper()
	r, err := store.GetReservation(context.Background(), f.stack.DB.Pool, store.AllTenants, id)
	require.NoError(t, err)
	return r
}

func (f *fixture) waitState(t *testing.T, id, state string, within time.Duration) store.Reservation {
	t.Helper()
	var r store.Reservation
	require.Eventually(t, func() bool {
		r = f.reservation(t, id)
		return r.State == state
	}, within, 10*time.Millisecond, "reservation %s to be %s: %+v", id, state, &r)
	return r
}

func (f *fixture) offer(t *testing.T, name string, quota int32) string {
	t.Helper()
	tenant := storetest.Tenant(t, f.stack.DB, &storetest.TenantOpts{Name: name}).ID
	storetest.Offer(t, f.stack.DB, &storetest.OfferOpts{PoolID: f.pool, TenantID: tenant, GPUQuota: quota})
	return tenant
}

type nodeRow struct {
	connected          bool
	spec, observed     int64
	allocationsInSpecs []string
}

func (f *fixture) node(t *testing.T, id string) nodeRow {
	t.Helper()
	var n nodeRow
	var spec []byte
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT session_id IS NOT NULL, spec_generation, observed_generation, spec
		FROM nodes WHERE id = $1`, id).Scan(&n.connected, &n.spec, &n.observed, &spec))
	ns := &gatewayv1.NodeSpec{}
	require.NoError(t, protojson.Unmarshal(spec, ns))
	for _, a := range ns.GetAllocations() {
		n.allocationsInSpecs = append(n.allocationsInSpecs, a.GetReservationId())
	}
	return n
}

// TestReservationLifecycle follows reservations through the real services
// and a fakedaemon: reserve 4 GPUs → active with CDI names in
// binding; the node disconnects while holding active reservations, which
// stay active with their bookings (I5); one is released meanwhile; on
// reconnect the daemon is sent the current spec (observed generation catches
// up); a short reservation expires at its end; and the usage windows of the
// released and the expired one add up to their booked GPU-seconds (I8).
func TestReservationLifecycle(t *testing.T) {
	f := setup(t)
	token, dataDir := f.joinToken(t), t.TempDir()
	start := func() (context.CancelFunc, *agent.Runner) {
		ctx, cancel := context.WithCancel(context.Background())
		r, err := fakedaemon.Start(ctx, fakedaemon.Config{Config: agent.Config{Server: f.stack.APIURL, Pins: f.stack.Pins,
			Token: token, DataDir: dataDir, Nodes: 1}, Variant: fakehw.VariantHGXH100}, agent.Deps{})
		require.NoError(t, err)
		return cancel, r
	}
	stop, r := start()
	t.Cleanup(func() { stop(); _ = r.Wait() })
	var nodeID string
	require.Eventually(t, func() bool {
		nodes, err := f.listNodes(t.Context())
		if err != nil || len(nodes) != 1 || nodes[0].GetProvisionState() != "adopted" || nodes[0].GetObservedGeneration() < 1 {
			return false
		}
		nodeID = nodes[0].GetId()
		return true
	}, 60*time.Second, 100*time.Millisecond)
	tenant := f.offer(t, "lifecycle", 64)

	// Reserve → active, with the CDI names of the booked GPUs.
	a := f.reserve(t, tenant, 4, time.Hour)
	ra := f.waitState(t, a.ID, store.ReservationActive, activeWithin)
	t.Logf("reserve → active in %s", ra.ActiveAt.Sub(ra.CreatedAt))
	require.Equal(t, nodeID, ra.NodeID)
	require.Len(t, ra.Binding, 4)
	for i, name := range ra.Binding {
		require.Equal(t, fmt.Sprintf("nvidia.com/gpu=%d", ra.DeviceIndexes[i]), name)
	}
	b := f.reserve(t, tenant, 4, time.Hour)
	rb := f.waitState(t, b.ID, store.ReservationActive, activeWithin)
	require.Equal(t, nodeID, rb.NodeID, "best fit: the same node")

	// Disconnect: the node's session closes, its reservations stay.
	stop()
	_ = r.Wait()
	require.Eventually(t, func() bool { return !f.node(t, nodeID).connected }, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, store.ReservationActive, f.reservation(t, a.ID).State)
	require.Equal(t, store.ReservationActive, f.reservation(t, b.ID).State)
	var booked int
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT count(*) FROM bookings WHERE node_id = $1
		AND upper(during) > $2`, nodeID, f.stack.DB.Now()).Scan(&booked))
	require.Equal(t, 8, booked)

	// b is released while the node is away: its spec moves on.
	require.NoError(t, f.stack.DB.InTx(t.Context(), func(tx pgx.Tx) error {
		_, err := store.EndReservation(t.Context(), tx, nil, store.AllTenants, f.stack.DB.Now(), b.ID, store.ReservationReleased)
		return err
	}))
	away := f.node(t, nodeID)
	require.Greater(t, away.spec, away.observed)
	require.Equal(t, []string{a.ID}, away.allocationsInSpecs)

	// Reconnect: the gateway sends the current spec; the daemon applies it.
	stop, r = start()
	require.Eventually(t, func() bool {
		n := f.node(t, nodeID)
		return n.connected && n.observed == away.spec
	}, 30*time.Second, 20*time.Millisecond, "observed generation catches up with %d", away.spec)
	require.Equal(t, store.ReservationActive, f.reservation(t, a.ID).State, "still active after the reconnect")

	// A short reservation expires at its end.
	c := f.reserve(t, tenant, 2, 1500*time.Millisecond)
	f.waitState(t, c.ID, store.ReservationActive, activeWithin)
	rc := f.waitState(t, c.ID, store.ReservationExpired, 5*time.Second)
	require.False(t, rc.EndedAt.Before(c.EndAt), "expired at %s, before it was due at %s", rc.EndedAt, c.EndAt)
	require.Eventually(t, func() bool {
		n := f.node(t, nodeID)
		return n.observed == n.spec && strings.Join(n.allocationsInSpecs, ",") == a.ID
	}, 5*time.Second, 20*time.Millisecond, "the spec drops the expired allocation and the daemon applies it")

	// Usage of the released and the expired reservation.
	_, err := f.stack.Controllers.Usage().Reconcile(t.Context())
	require.NoError(t, err)
	for _, id := range []string{b.ID, c.ID} {
		var sum, want int64
		require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT coalesce(sum(gpu_seconds), 0) FROM usage_windows
			WHERE reservation_id = $1`, id).Scan(&sum))
		require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT sum(extract(epoch FROM
				date_trunc('second', upper(during)) - date_trunc('second', lower(during))))::bigint
			FROM bookings WHERE reservation_id = $1`, id).Scan(&want))
		require.Equal(t, want, sum, "usage of %s", id)
	}
}

// activeWithin bounds how long a reservation may take to become active in
// these tests: a deadline for a hang, not a speed target (Reserve → active
// latency is measured by tests/bench BenchmarkReservations).
const activeWithin = 30 * time.Second
