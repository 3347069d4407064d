package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

type placeFixture struct {
	t      *testing.T
	db     *store.DB
	clk    *clock.Fake
	fleet  *storetest.Fleet
	tenant string
}

func newPlaceFixture(t *testing.T, name string, gpus ...int) placeFixture {
	t.Helper()
	return newPlaceFixtureWith(t, storetest.FleetOpts{Name: name, GPUs: gpus})
}

// newPlaceFixtureWith is newPlaceFixture with the fleet that opts describe.
func newPlaceFixtureWith(t *testing.T, opts storetest.FleetOpts) placeFixture {
	t.Helper()
	clk := clock.NewFake(time.Date(2030, 1, 1, 10, 20, 30, 500_000_000, time.FixedZone("IST", 5*3600+1800)))
	db := storetest.New(t, clk)
	f := storetest.NewFleetWith(t, db, opts)
	return placeFixture{t: t, db: db, clk: clk, fleet: f, tenant: f.Tenant(t, "tenant-"+opts.Name, 64)}
}

func (f placeFixture) reserve(gpus int32, d time.Duration) store.Reservation {
	f.t.Helper()
	r, err := f.fleet.Reserve(f.t.Context(), f.tenant, gpus, d)
	require.NoError(f.t, err)
	require.Equal(f.t, store.ReservationPending, r.State)
	return r
}

func (f placeFixture) place(signer *store.IntentSigner, ps ...store.Placement) ([]string, error) {
	var placed []string
	err := f.db.InTx(f.t.Context(), func(tx pgx.Tx) error {
		var err error
		placed, err = store.PlaceReservations(f.t.Context(), tx, signer, f.db.Now(), ps)
		return err
	})
	return placed, err
}

func (f placeFixture) get(id string) store.Reservation {
	f.t.Helper()
	r, err := store.GetReservation(f.t.Context(), f.db.Pool, store.AllTenants, id)
	require.NoError(f.t, err)
	return r
}

func (f placeFixture) spec(nodeID string) (*gatewayv1.NodeSpec, int64) {
	f.t.Helper()
	var b []byte
	var gen int64
	require.NoError(f.t, f.db.Pool.QueryRow(f.t.Context(), `SELECT spec, spec_generation FROM nodes WHERE id = $1`, nodeID).Scan(&b, &gen))
	ns := &gatewayv1.NodeSpec{}
	require.NoError(f.t, protojson.Unmarshal(b, ns))
	return ns, gen
}

func (f placeFixture) events(id string) []string {
	f.t.Helper()
	rows, err := f.db.Pool.Query(f.t.Context(), `SELECT type FROM events WHERE subject_id = $1 ORDER BY id`, id)
	require.NoError(f.t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(f.t, err)
	return out
}

func (f placeFixture) outbox(subject string) int {
	f.t.Helper()
	var n int
	require.NoError(f.t, f.db.Pool.QueryRow(f.t.Context(), `SELECT count(*) FROM outbox WHERE subject = $1`, subject).Scan(&n))
	return n
}

func (f placeFixture) placement(r store.Reservation, node string, devs ...int32) store.Placement {
	now := f.db.Now()
	return store.Placement{ReservationID: r.ID, TenantID: r.TenantID, NodeID: node, Devices: devs, Lower: now, Upper: r.EndAt}
}

// TestPlaceBindsBooksAndSignsTheSpec: a placement turns the reservation
// binding with its bookings, gives the node the next spec generation with
// the allocation, signed, pokes its gateway and writes reservation.bound;
// placing it again does nothing.
func TestPlaceBindsBooksAndSignsTheSpec(t *testing.T) {
	t.Parallel()
	f := newPlaceFixtureWith(t, storetest.FleetOpts{Name: "bind", GPUs: []int{8},
		Node: func(_ int, o *storetest.NodeOpts) { o.GatewayID = "gw-1" }})
	signer, root := newIntentSigner(t)
	node := f.fleet.Nodes[0]
	r := f.reserve(4, time.Hour)

	placed, err := f.place(signer, f.placement(r, node, 1, 3, 5, 7))
	require.NoError(t, err)
	require.Equal(t, []string{r.ID}, placed)
	got := f.get(r.ID)
	require.Equal(t, store.ReservationBinding, got.State)
	require.Equal(t, node, got.NodeID)
	require.Equal(t, []int32{1, 3, 5, 7}, got.DeviceIndexes)
	require.NotNil(t, got.PlacedAt)
	require.NotNil(t, got.SpecGeneration)
	require.EqualValues(t, 2, *got.SpecGeneration)

	ns, gen := f.spec(node)
	require.EqualValues(t, 2, gen)
	require.Len(t, ns.GetAllocations(), 1)
	require.Equal(t, r.ID, ns.GetAllocations()[0].GetReservationId())
	require.Equal(t, []int32{1, 3, 5, 7}, ns.GetAllocations()[0].GetDeviceIndexes())
	require.Equal(t, f.fleet.PoolID, ns.GetLabels()["better-compute.io/pool"], "labels kept")
	var sig []byte
	var specJSON []byte
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT spec, spec_signature FROM nodes WHERE id = $1`, node).Scan(&specJSON, &sig))
	ds, err := store.DesiredStateMessage(gen, specJSON, sig)
	require.NoError(t, err)
	require.Empty(t, daemon.VerifySpec(root, node, ds), "the new generation is signed")
	require.Equal(t, 1, f.outbox(store.SubjectPokeGatewayPrefix+"gw-1"))
	require.Equal(t, []string{"reservation.created", "reservation.bound"}, f.events(r.ID))
	require.Equal(t, 1, countEvents(t, f.db, f.tenant, "reservation.bound"))

	placed, err = f.place(signer, f.placement(r, node, 0, 2, 4, 6))
	require.NoError(t, err)
	require.Empty(t, placed, "no longer pending: skipped")
	require.Equal(t, []int32{1, 3, 5, 7}, f.get(r.ID).DeviceIndexes)
}

// TestOverlappingBookingIsRefusedByTheDatabase (I1): a placement on a device
// another transaction booked for an overlapping time fails on
// bookings_no_overlap and writes nothing, even when both are planned on the
// same stale view; the same device after the other's end is fine.
func TestOverlappingBookingIsRefusedByTheDatabase(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "overlap", 8)
	node := f.fleet.Nodes[0]
	a, b := f.reserve(2, time.Hour), f.reserve(2, time.Hour)
	_, err := f.place(nil, f.placement(a, node, 0, 1))
	require.NoError(t, err)
	_, gen := f.spec(node)

	_, err = f.place(nil, f.placement(b, node, 1, 2))
	require.True(t, store.IsConstraint(err, store.BookingsNoOverlap), "%v", err)
	require.ErrorIs(t, err, store.ErrConflict)
	got := f.get(b.ID)
	require.Equal(t, store.ReservationPending, got.State, "rolled back whole")
	require.Empty(t, got.DeviceIndexes)
	_, gen2 := f.spec(node)
	require.Equal(t, gen, gen2)
	require.Equal(t, []string{"reservation.created"}, f.events(b.ID))

	// Two transactions racing on the same device: one wins.
	c := f.reserve(1, time.Hour)
	d := f.reserve(1, time.Hour)
	errs := make(chan error, 2)
	for _, r := range []store.Reservation{c, d} {
		go func() {
			_, err := f.place(nil, f.placement(r, node, 5))
			errs <- err
		}()
	}
	e1, e2 := <-errs, <-errs
	require.True(t, (e1 == nil) != (e2 == nil), "exactly one wins: %v / %v", e1, e2)

	// A booking after the first one's end does not overlap it.
	f.clk.Advance(2 * time.Hour)
	e := f.reserve(2, time.Hour)
	_, err = f.place(nil, f.placement(e, node, 0, 1))
	require.NoError(t, err)
}

// TestActivateOnlyWhatTheNodeWasGiven: AllocationBound activates a binding
// reservation of the reporting node at a generation that carries it, once.
func TestActivateOnlyWhatTheNodeWasGiven(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "activate", 8, 8)
	n0, n1 := f.fleet.Nodes[0], f.fleet.Nodes[1]
	r := f.reserve(2, time.Hour)
	_, err := f.place(nil, f.placement(r, n0, 0, 1))
	require.NoError(t, err)
	activate := func(node string, gen int64) store.Activation {
		var a store.Activation
		require.NoError(t, f.db.InTx(t.Context(), func(tx pgx.Tx) error {
			var err error
			a, err = store.ActivateReservation(t.Context(), tx, f.db.Now(), node, r.ID, []string{"nvidia.com/gpu=0", "nvidia.com/gpu=1"}, gen)
			return err
		}))
		return a
	}
	require.False(t, activate(n1, 2).Activated, "another node")
	require.False(t, activate(n0, 1).Activated, "a generation before the allocation")
	require.Equal(t, store.ReservationBinding, f.get(r.ID).State)
	a := activate(n0, 2)
	require.True(t, a.Activated)
	got := f.get(r.ID)
	require.Equal(t, store.ReservationActive, got.State)
	require.Equal(t, []string{"nvidia.com/gpu=0", "nvidia.com/gpu=1"}, got.Binding)
	require.NotNil(t, got.ActiveAt)
	require.False(t, activate(n0, 3).Activated, "already active")
	require.Equal(t, []string{"reservation.created", "reservation.bound", "reservation.active"}, f.events(r.ID))

	err = f.db.InTx(t.Context(), func(tx pgx.Tx) error {
		_, err := store.ActivateReservation(t.Context(), tx, f.db.Now(), n0, "res_nope", nil, 9)
		return err
	})
	require.ErrorIs(t, err, store.ErrNotFound)
}

// TestActivateReservationsInOneStatement: a batch of AllocationBound
// reports is one statement (in AutoCommit: no BEGIN or COMMIT) that
// activates each binding reservation its node reports at a generation that
// carries it, once, with one reservation.active event each, and answers
// every report in its order: a stale generation, another node's report, a
// second report of a reservation the batch activates and an unknown
// reservation change nothing. Not parallel: the counter sees every
// statement of the process.
func TestActivateReservationsInOneStatement(t *testing.T) {
	f := newPlaceFixture(t, "activate-batch", 8, 8)
	n0, n1 := f.fleet.Nodes[0], f.fleet.Nodes[1]
	r1, r2, r3 := f.reserve(2, time.Hour), f.reserve(2, time.Hour), f.reserve(1, time.Hour)
	_, err := f.place(nil, f.placement(r1, n0, 0, 1), f.placement(r2, n0, 2, 3), f.placement(r3, n1, 0))
	require.NoError(t, err)
	gen0, gen1 := *f.get(r1.ID).SpecGeneration, *f.get(r3.ID).SpecGeneration
	require.Equal(t, gen0, *f.get(r2.ID).SpecGeneration)

	stmts := storetest.CountStatements()
	out, err := store.ActivateReservations(t.Context(), f.db.AutoCommit(), f.db.Now(), []store.AllocationBound{
		{NodeID: n1, ReservationID: r3.ID, Binding: []string{"nvidia.com/gpu=0"}, Generation: gen1 - 1}, // stale
		{NodeID: n0, ReservationID: r1.ID, Binding: []string{"nvidia.com/gpu=0", "nvidia.com/gpu=1"}, Generation: gen0},
		{NodeID: n1, ReservationID: r2.ID, Binding: []string{"nvidia.com/gpu=2"}, Generation: gen1}, // another node's
		{NodeID: n0, ReservationID: r2.ID, Generation: gen0 + 1},
		{NodeID: n0, ReservationID: r1.ID, Binding: []string{"nvidia.com/gpu=9"}, Generation: gen0}, // again
		{NodeID: n0, ReservationID: "res_nope", Generation: gen0},
	})
	stmts.Stop()
	require.NoError(t, err)
	var sent []string
	for _, q := range stmts.SQL() {
		if q != store.OutboxNotifySQL {
			sent = append(sent, q)
		}
	}
	require.Len(t, sent, 1, "%q", sent)
	for i := range out {
		out[i].CreatedAt = time.Time{}
	}
	tenant := r1.TenantID
	require.Equal(t, []store.Activation{
		{Found: true, TenantID: tenant, State: store.ReservationBinding},
		{Found: true, Activated: true, TenantID: tenant, State: store.ReservationActive},
		{Found: true, TenantID: tenant, State: store.ReservationActive},
		{Found: true, Activated: true, TenantID: tenant, State: store.ReservationActive},
		{Found: true, TenantID: tenant, State: store.ReservationActive},
		{},
	}, out)
	got1, got2 := f.get(r1.ID), f.get(r2.ID)
	require.Equal(t, []string{"nvidia.com/gpu=0", "nvidia.com/gpu=1"}, got1.Binding)
	require.Equal(t, []string{}, got2.Binding)
	require.NotNil(t, got1.ActiveAt)
	require.Equal(t, store.ReservationBinding, f.get(r3.ID).State)
	for _, id := range []string{r1.ID, r2.ID} {
		require.Equal(t, []string{"reservation.created", "reservation.bound", "reservation.active"}, f.events(id))
	}
	require.Equal(t, []string{"reservation.created", "reservation.bound"}, f.events(r3.ID))
	var data string
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT data::text FROM events WHERE subject_id = $1 AND type = $2`,
		r2.ID, store.EventReservationActive).Scan(&data))
	require.JSONEq(t, fmt.Sprintf(`{"reservationId": %q, "nodeId": %q, "binding": [], "generation": %d}`, r2.ID, n0, gen0+1), data)
	require.Equal(t, 2, countEvents(t, f.db, tenant, "reservation.active"))
}

// TestEndReservationFreesDevicesAndDropsTheAllocation: releasing an active
// reservation ends its bookings now, removes it from the node's spec (a new
// generation), pokes the scheduler and writes reservation.released; ending
// it again changes nothing. A pending one expires without a node.
func TestEndReservationFreesDevicesAndDropsTheAllocation(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "end", 8)
	node := f.fleet.Nodes[0]
	r := f.reserve(3, time.Hour)
	_, err := f.place(nil, f.placement(r, node, 0, 1, 2))
	require.NoError(t, err)
	f.clk.Advance(10 * time.Minute)
	pokes := f.outbox(store.SubjectPokeScheduler)
	end := func(id, state string) store.EndedReservation {
		var e store.EndedReservation
		require.NoError(t, f.db.InTx(t.Context(), func(tx pgx.Tx) error {
			var err error
			e, err = store.EndReservation(t.Context(), tx, nil, store.AllTenants, f.db.Now(), id, state)
			return err
		}))
		return e
	}
	e := end(r.ID, store.ReservationReleased)
	require.True(t, e.Changed)
	require.Equal(t, node, e.NodeID)
	got := f.get(r.ID)
	require.Equal(t, store.ReservationReleased, got.State)
	require.NotNil(t, got.EndedAt)
	var upper time.Time
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT max(upper(during)) FROM bookings WHERE reservation_id = $1`, r.ID).Scan(&upper))
	require.True(t, upper.Equal(f.db.Now()), "bookings end at the release: %s", upper)
	ns, gen := f.spec(node)
	require.Empty(t, ns.GetAllocations())
	require.EqualValues(t, 3, gen)
	require.Equal(t, pokes+1, f.outbox(store.SubjectPokeScheduler))
	require.Equal(t, []string{"reservation.created", "reservation.bound", "reservation.released"}, f.events(r.ID))
	require.False(t, end(r.ID, store.ReservationExpired).Changed)
	require.Equal(t, store.ReservationReleased, f.get(r.ID).State)

	p := f.reserve(1, time.Hour)
	e = end(p.ID, store.ReservationExpired)
	require.True(t, e.Changed)
	require.Empty(t, e.NodeID)
	require.Equal(t, store.ReservationExpired, f.get(p.ID).State)

	// The freed devices can be booked again now.
	again := f.reserve(8, time.Hour)
	_, err = f.place(nil, f.placement(again, node, 0, 1, 2, 3, 4, 5, 6, 7))
	require.NoError(t, err)
}

// TestUsageWindowsSumToBookedTime (I8): windows are written per UTC hour
// once final, a replay writes nothing, and the windows of a released and of
// an expired reservation add up exactly to GPUs × booked whole seconds.
func TestUsageWindowsSumToBookedTime(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "usage", 8)
	ctx := t.Context()
	node := f.fleet.Nodes[0]
	// Starts at 04:50:30.5 UTC (10:20:30.5 IST).
	rel := f.reserve(4, 3*time.Hour)
	exp := f.reserve(2, 90*time.Minute+250*time.Millisecond)
	_, err := f.place(nil, f.placement(rel, node, 0, 1, 2, 3), f.placement(exp, node, 4, 5))
	require.NoError(t, err)
	start := f.db.Now()

	write := func() int64 {
		ids, err := store.UsageCandidates(ctx, f.db.Pool, "", 100)
		require.NoError(t, err)
		n, err := store.WriteUsageWindows(ctx, f.db.Pool, f.db.Now(), ids)
		require.NoError(t, err)
		return n
	}
	windows := func(id string) map[time.Time]int64 {
		rows, err := f.db.Pool.Query(ctx, `SELECT window_start, gpu_seconds FROM usage_windows WHERE reservation_id = $1`, id)
		require.NoError(t, err)
		out := map[time.Time]int64{}
		for rows.Next() {
			var ws time.Time
			var s int64
			require.NoError(t, rows.Scan(&ws, &s))
			out[ws.UTC()] = s
		}
		require.NoError(t, rows.Err())
		return out
	}
	require.Zero(t, write(), "no hour has ended")

	f.clk.Advance(40 * time.Minute) // 05:30:30.5 UTC
	require.EqualValues(t, 2, write(), "04:00 for both")
	h4 := time.Date(2030, 1, 1, 4, 0, 0, 0, time.UTC)
	require.Equal(t, map[time.Time]int64{h4: 4 * 570}, windows(rel.ID), "04:50:30 to 05:00:00")
	require.Zero(t, write(), "replay")

	// exp ends at 06:20:30.75 UTC: expire it then; release rel at
	// 06:45:10.9 UTC.
	f.clk.Advance(50*time.Minute + 250*time.Millisecond)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		ids, err := store.ClaimDueReservations(ctx, tx, f.db.Now(), 10)
		require.Equal(t, []string{exp.ID}, ids)
		if err != nil {
			return err
		}
		_, err = store.EndReservation(ctx, tx, nil, store.AllTenants, f.db.Now(), exp.ID, store.ReservationExpired)
		return err
	}))
	f.clk.Advance(24*time.Minute + 40*time.Second + 150*time.Millisecond)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.EndReservation(ctx, tx, nil, store.AllTenants, f.db.Now(), rel.ID, store.ReservationReleased)
		return err
	}))
	end := f.db.Now()
	require.EqualValues(t, 4, write(), "05:00 and 06:00 of each")
	require.Zero(t, write(), "replay")
	ids, err := store.UsageCandidates(ctx, f.db.Pool, "", 100)
	require.NoError(t, err)
	require.Empty(t, ids, "both are done")

	sum := func(m map[time.Time]int64) (s int64) {
		for _, v := range m {
			s += v
		}
		return s
	}
	secs := func(a, b time.Time) int64 { return b.Truncate(time.Second).Unix() - a.Truncate(time.Second).Unix() }
	require.Equal(t, 4*secs(start, end), sum(windows(rel.ID)))
	require.Equal(t, map[time.Time]int64{h4: 4 * 570, h4.Add(time.Hour): 4 * 3600, h4.Add(2 * time.Hour): 4 * 2710}, windows(rel.ID))
	require.Equal(t, 2*secs(start, exp.EndAt), sum(windows(exp.ID)))
	require.Equal(t, int64(2*(570+3600+1230)), sum(windows(exp.ID)))
}

// TestOpenUsageCountsEndedUntilWritten (I8): the written windows and
// OpenUsage together count a reservation's GPU-seconds so far while it
// runs, all of them once it ends and before the sink writes its last
// windows, and the same once it has: the usage never goes down and no
// second counts twice.
func TestOpenUsageCountsEndedUntilWritten(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "openusage", 8)
	ctx := t.Context()
	node := f.fleet.Nodes[0]
	rel := f.reserve(4, 3*time.Hour)
	_, err := f.place(nil, f.placement(rel, node, 0, 1, 2, 3))
	require.NoError(t, err)
	start := f.db.Now()
	secs := func(a, b time.Time) int64 { return b.Truncate(time.Second).Unix() - a.Truncate(time.Second).Unix() }

	// total returns the reservation's GPU-seconds written and open, and how
	// many of its windows are open.
	total := func() (sum int64, open int) {
		uf := store.UsageFilter{Scope: store.AllTenants}
		written, err := store.ListUsage(ctx, f.db.Pool, uf)
		require.NoError(t, err)
		opened, err := store.OpenUsage(ctx, f.db.Pool, uf, f.db.Now())
		require.NoError(t, err)
		seen := map[time.Time]bool{}
		for _, w := range append(written, opened...) {
			require.Equal(t, rel.ID, w.ReservationID)
			require.False(t, seen[w.WindowStart], "window %s counted twice", w.WindowStart)
			seen[w.WindowStart] = true
			sum += w.GPUSeconds
		}
		return sum, len(opened)
	}
	write := func() int64 {
		ids, err := store.UsageCandidates(ctx, f.db.Pool, "", 100)
		require.NoError(t, err)
		n, err := store.WriteUsageWindows(ctx, f.db.Pool, f.db.Now(), ids)
		require.NoError(t, err)
		return n
	}

	// Running: 04:50:30 to 05:30:30, the 04:00 window written.
	f.clk.Advance(40 * time.Minute)
	require.EqualValues(t, 1, write())
	sum, open := total()
	require.Equal(t, 4*secs(start, f.db.Now()), sum)
	require.Equal(t, 1, open, "05:00 so far")

	// Just ended at 05:45:30, its 05:00 window not written yet.
	f.clk.Advance(15 * time.Minute)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.EndReservation(ctx, tx, nil, store.AllTenants, f.db.Now(), rel.ID, store.ReservationReleased)
		return err
	}))
	end := f.db.Now()
	sum, open = total()
	require.Equal(t, 4*secs(start, end), sum, "the ended reservation's last window counts before it is written")
	require.Equal(t, 1, open)
	f.clk.Advance(30 * time.Minute) // 06:15:30: the end, not now, bounds it.
	sum, _ = total()
	require.Equal(t, 4*secs(start, end), sum)

	// Written: the same total, nothing open.
	require.EqualValues(t, 1, write())
	sum, open = total()
	require.Equal(t, 4*secs(start, end), sum)
	require.Zero(t, open)
}

// TestOnlyAdoptedNodesArePlacedOn: nodes that are joining, accepting or
// failed acceptance have their reported GPUs recorded (node_devices) but
// are never capacity: PoolCapacity returns adopted nodes only, and a
// reservation that only such a node could hold fails at once.
func TestOnlyAdoptedNodesArePlacedOn(t *testing.T) {
	t.Parallel()
	states := []string{store.NodeAdopted, store.NodeAcceptanceFailed, store.NodeAccepting, store.NodeJoining}
	f := newPlaceFixtureWith(t, storetest.FleetOpts{Name: "adoptedonly", GPUs: []int{4, 8, 8, 8},
		Node: func(i int, o *storetest.NodeOpts) { o.State = states[i] }})
	ctx := t.Context()
	failed, accepting, joining := f.fleet.Nodes[1], f.fleet.Nodes[2], f.fleet.Nodes[3]
	n, err := store.GetNode(ctx, f.db.Pool, store.AllTenants, failed)
	require.NoError(t, err)
	require.Len(t, n.Devices, 8, "a failed node shows its GPUs")

	nodes, _, err := store.PoolCapacity(ctx, f.db.Pool, f.fleet.PoolID, f.db.Now())
	require.NoError(t, err)
	require.Len(t, nodes, 1)
	require.Equal(t, f.fleet.Nodes[0], nodes[0].ID, "only the adopted node is capacity")

	// Nothing but the failed node (and nodes still on their way to
	// adoption) has 8 GPUs; once those are gone too, 8 GPUs fail at once.
	_, err = store.MarkNodesAccepting(ctx, f.db.Pool, f.db.Now(), []string{joining})
	require.NoError(t, err)
	_, err = store.FailAcceptance(ctx, f.db.Pool, f.db.Now(), []store.AcceptanceFailure{
		{NodeID: accepting, PoolID: f.fleet.PoolID, OwnerTenantID: f.fleet.OwnerID, Reason: "no"},
		{NodeID: joining, PoolID: f.fleet.PoolID, OwnerTenantID: f.fleet.OwnerID, Reason: "no"}})
	require.NoError(t, err)
	r, err := f.fleet.Reserve(ctx, f.tenant, 8, time.Hour)
	require.NoError(t, err)
	require.Equal(t, store.ReservationFailed, r.State)
	require.Equal(t, "no node of pool "+f.fleet.PoolID+" has 8 GPUs (largest: 4)", r.Reason)
}

// TestPlacementRechecksTheNode: capacity read before a node's revocation or
// cordon (outside the placement's transaction) places nothing on it; the
// reservation stays pending, with no booking, for the next pass.
func TestPlacementRechecksTheNode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		change func(ctx context.Context, tx pgx.Tx, now time.Time, node string) error
	}{
		{"revoked", func(ctx context.Context, tx pgx.Tx, now time.Time, node string) error {
			_, err := store.RevokeNode(ctx, tx, store.AllTenants, now, node, "stolen")
			return err
		}},
		{"cordoned", func(ctx context.Context, tx pgx.Tx, now time.Time, node string) error {
			_, err := store.CordonNode(ctx, tx, store.AllTenants, now, node, "maintenance")
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newPlaceFixture(t, "recheck-"+tc.name, 8)
			ctx := t.Context()
			node := f.fleet.Nodes[0]
			r := f.reserve(2, time.Hour)
			nodes, _, err := store.PoolCapacity(ctx, f.db.Pool, f.fleet.PoolID, f.db.Now())
			require.NoError(t, err)
			require.Len(t, nodes, 1, "the scheduler saw the node placeable")
			require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error { return tc.change(ctx, tx, f.db.Now(), node) }))

			placed, err := f.place(nil, f.placement(r, node, 0, 1))
			require.NoError(t, err)
			require.Empty(t, placed)
			got := f.get(r.ID)
			require.Equal(t, store.ReservationPending, got.State)
			require.Empty(t, got.DeviceIndexes, "no booking")
		})
	}
}
