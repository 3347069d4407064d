package store_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// livenessFixture is a fleet on a fake clock whose nodes start with no
// session and unreachable, and two gateways that write last_seen in batches.
type livenessFixture struct {
	placeFixture
	t0 time.Time
}

func newLivenessFixture(t *testing.T, name string, nodes int) livenessFixture {
	t.Helper()
	gpus := make([]int, nodes)
	for i := range gpus {
		gpus[i] = 2
	}
	f := livenessFixture{placeFixture: newPlaceFixtureWith(t, storetest.FleetOpts{Name: name, GPUs: gpus,
		Node: func(_ int, o *storetest.NodeOpts) { o.Reachable, o.SessionID = false, "" }})}
	f.t0 = f.db.Now()
	return f
}

// at sets the clock to t0 + d and returns that time.
func (f livenessFixture) at(d time.Duration) time.Time {
	f.clk.Set(f.t0.Add(d))
	return f.db.Now()
}

func (f livenessFixture) open(node, gw string) string {
	f.t.Helper()
	sid := ids.New(ids.Session, f.db.Now())
	require.NoError(f.t, f.db.InTx(f.t.Context(), func(tx pgx.Tx) error {
		_, err := storetest.OpenSession(f.t, tx, store.OpenSessionParams{NodeID: node, GatewayID: gw, SessionID: sid,
			BootID: "boot", Now: f.db.Now()})
		return err
	}))
	return sid
}

// flush is one gateway's batched flush at the current time: the hearings in
// batch and the gateway's presence, in one transaction.
func (f livenessFixture) flush(gw string, batch ...store.SessionLastSeen) {
	f.t.Helper()
	require.NoError(f.t, f.db.InTx(f.t.Context(), func(tx pgx.Tx) error {
		if _, err := store.RecordSessionLastSeen(f.t.Context(), tx, batch); err != nil {
			return err
		}
		return store.RecordGatewayPresence(f.t.Context(), tx, f.db.Now(), gw, store.GatewayPresenceTTL)
	}))
}

func (f livenessFixture) sweep() []string {
	f.t.Helper()
	var ids []string
	require.NoError(f.t, f.db.InTx(f.t.Context(), func(tx pgx.Tx) error {
		var err error
		ids, err = store.SweepUnreachable(f.t.Context(), tx, f.db.Now(), 30*time.Second, 100)
		return err
	}))
	return ids
}

func (f livenessFixture) reachable(node string) bool {
	f.t.Helper()
	var r bool
	require.NoError(f.t, f.db.Pool.QueryRow(f.t.Context(), `SELECT reachable FROM nodes WHERE id = $1`, node).Scan(&r))
	return r
}

// TestLivenessSweep (I4, I5): with two gateways flushing last_seen in
// batches, a node silent for 31 s is marked unreachable and one heard 19 s
// ago is not; a node whose live session a present gateway holds is not
// swept however late its batch, until that gateway's presence expires; a
// swept node keeps its reservation; a new session makes it reachable again,
// with one event per transition.
func TestLivenessSweep(t *testing.T) {
	t.Parallel()
	f := newLivenessFixture(t, "live", 4)
	ctx := t.Context()
	a, b, c, d := f.fleet.Nodes[0], f.fleet.Nodes[1], f.fleet.Nodes[2], f.fleet.Nodes[3]

	sa, sc := f.open(a, "gw-1"), f.open(c, "gw-1")
	sb, sd := f.open(b, "gw-2"), f.open(d, "gw-2")
	for _, n := range f.fleet.Nodes {
		require.True(t, f.reachable(n))
		require.Equal(t, []string{store.EventNodeReachable}, f.events(n))
	}
	// C holds a reservation: connectivity must never end it (I5).
	r := f.reserve(2, time.Hour)
	placed, err := f.place(nil, f.placement(r, c, 0, 1))
	require.NoError(t, err)
	require.Equal(t, []string{r.ID}, placed)

	// t0+1: both gateways flush what they heard at t0 (a batch of two
	// nodes each).
	f.at(time.Second)
	f.flush("gw-1", store.SessionLastSeen{NodeID: a, SessionID: sa, At: f.t0}, store.SessionLastSeen{NodeID: c, SessionID: sc, At: f.t0})
	f.flush("gw-2", store.SessionLastSeen{NodeID: b, SessionID: sb, At: f.t0}, store.SessionLastSeen{NodeID: d, SessionID: sd, At: f.t0})
	// A's session ends at t0 (its last message); B's at t0+12 after gw-2
	// heard it then.
	f.at(12 * time.Second)
	_, err = store.CloseSession(ctx, f.db.Pool, f.db.Now(), a, sa, f.t0)
	require.NoError(t, err)
	_, err = store.CloseSession(ctx, f.db.Pool, f.db.Now(), b, sb, f.t0.Add(12*time.Second))
	require.NoError(t, err)
	// gw-2 heard D at t0+29 and flushed at t0+30; gw-1 heard C at t0+25
	// but its batch is late: C's last_seen is still t0. Both gateways are
	// present.
	f.at(30 * time.Second)
	f.flush("gw-2", store.SessionLastSeen{NodeID: d, SessionID: sd, At: f.t0.Add(29 * time.Second)})
	f.flush("gw-1")

	f.at(31 * time.Second)
	require.Equal(t, []string{a}, f.sweep(), "A was silent for 31 s; B was heard 19 s ago; C's gateway is present")
	require.False(t, f.reachable(a))
	require.True(t, f.reachable(b))
	require.True(t, f.reachable(c))
	require.Empty(t, f.sweep(), "a second pass finds nothing new")

	f.at(42*time.Second + time.Millisecond)
	require.Equal(t, []string{b}, f.sweep(), "B silent for 30 s and more")

	// gw-1 stops writing after t0+30: its presence lasts until t0+60.
	f.at(59 * time.Second)
	f.flush("gw-2", store.SessionLastSeen{NodeID: d, SessionID: sd, At: f.db.Now()})
	require.Empty(t, f.sweep(), "gw-1 is still present: C is not swept")
	f.at(60*time.Second + time.Millisecond)
	require.Equal(t, []string{c}, f.sweep(), "gw-1's presence expired")
	got := f.get(r.ID)
	require.Equal(t, store.ReservationBinding, got.State, "unreachable keeps the reservation (I5)")
	require.Equal(t, c, got.NodeID)
	var bookings int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM bookings WHERE reservation_id = $1 AND upper(during) > $2`,
		r.ID, f.db.Now()).Scan(&bookings))
	require.Equal(t, 2, bookings)

	// B: a late message on its closed session does not make it reachable;
	// a new session does, once.
	f.flush("gw-2", store.SessionLastSeen{NodeID: b, SessionID: sb, At: f.db.Now()})
	require.False(t, f.reachable(b))
	sb2 := f.open(b, "gw-1")
	require.True(t, f.reachable(b))
	f.flush("gw-1", store.SessionLastSeen{NodeID: b, SessionID: sb2, At: f.db.Now()})
	require.Equal(t, []string{store.EventNodeReachable, store.EventNodeUnreachable, store.EventNodeReachable}, f.events(b))
	// C comes back on its live session (its gateway flushes again): one
	// reachable event.
	f.flush("gw-1", store.SessionLastSeen{NodeID: c, SessionID: sc, At: f.db.Now()})
	f.flush("gw-1", store.SessionLastSeen{NodeID: c, SessionID: sc, At: f.db.Now()})
	require.True(t, f.reachable(c))
	require.Equal(t, []string{store.EventNodeReachable, store.EventNodeUnreachable, store.EventNodeReachable},
		f.events(c)[len(f.events(c))-3:])
	require.Equal(t, []string{store.EventNodeReachable, store.EventNodeUnreachable}, f.events(a))
	require.Equal(t, []string{store.EventNodeReachable}, f.events(d))
	require.Equal(t, 3, countEvents(t, f.db, f.fleet.OwnerID, store.EventNodeUnreachable))
	require.Equal(t, 6, countEvents(t, f.db, f.fleet.OwnerID, store.EventNodeReachable))

	// A gateway restarting under its id clears the sessions it held and
	// vouches for its nodes until now.
	n, err := store.ResetGatewaySessions(ctx, f.db.Pool, f.db.Now(), "gw-1")
	require.NoError(t, err)
	require.EqualValues(t, 2, n, "B and C")
	f.at(89 * time.Second)
	f.flush("gw-2", store.SessionLastSeen{NodeID: d, SessionID: sd, At: f.db.Now()})
	require.Empty(t, f.sweep())
	f.at(91 * time.Second)
	require.ElementsMatch(t, []string{b, c}, f.sweep())

	_, err = store.SweepUnreachable(ctx, f.db.Pool, f.db.Now(), 19*time.Second, 10)
	require.ErrorContains(t, err, "I4")
}

// TestCordon: a cordoned node is not schedulable and keeps its reservation;
// events are written per change, with the reason; uncordon pokes the
// scheduler.
func TestCordon(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "cordon", 2)
	ctx := t.Context()
	node := f.fleet.Nodes[0]
	r := f.reserve(1, time.Hour)
	_, err := f.place(nil, f.placement(r, node, 0))
	require.NoError(t, err)

	var last store.CordonResult
	cordon := func(reason string) bool {
		require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			last, err = store.CordonNode(ctx, tx, store.AllTenants, f.db.Now(), node, reason)
			return err
		}))
		return last.Changed
	}
	uncordon := func() bool {
		var changed bool
		require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			changed, err = store.UncordonNode(ctx, tx, store.AllTenants, f.db.Now(), node)
			return err
		}))
		return changed
	}
	schedulable := func() bool {
		nodes, _, err := store.PoolCapacity(ctx, f.db.Pool, f.fleet.PoolID, f.db.Now())
		require.NoError(t, err)
		require.Equal(t, node, nodes[0].ID)
		return nodes[0].Schedulable
	}
	require.True(t, schedulable())
	require.True(t, cordon("fan noise"))
	require.Equal(t, store.CordonResult{Changed: true}, last)
	require.False(t, schedulable())
	require.False(t, cordon("fan noise"), "same reason: nothing changes")
	require.Equal(t, store.CordonResult{WasCordoned: true, PreviousReason: "fan noise"}, last)
	require.True(t, cordon("fan replaced tomorrow"))
	require.Equal(t, store.CordonResult{Changed: true, WasCordoned: true, PreviousReason: "fan noise"}, last)
	n, err := store.GetNode(ctx, f.db.Pool, store.AllTenants, node)
	require.NoError(t, err)
	require.True(t, n.Cordoned)
	require.Equal(t, "fan replaced tomorrow", n.CordonReason)
	require.Equal(t, store.ReservationBinding, f.get(r.ID).State, "cordon keeps reservations")

	pokes := f.outbox(store.SubjectPokeScheduler)
	require.True(t, uncordon())
	require.False(t, uncordon())
	require.True(t, schedulable())
	require.Equal(t, pokes+1, f.outbox(store.SubjectPokeScheduler), "uncordon pokes the scheduler")
	require.Equal(t, []string{store.EventNodeCordoned, store.EventNodeCordoned, store.EventNodeUncordoned}, f.events(node))
	var data string
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT data::text FROM events WHERE subject_id = $1 AND type = $2`,
		node, store.EventNodeUncordoned).Scan(&data))
	require.JSONEq(t, `{"nodeId": "`+node+`", "previousReason": "fan replaced tomorrow"}`, data,
		"an uncordon has no reason of its own: the lifted cordon's is previousReason")
	require.Equal(t, 2, countEvents(t, f.db, f.fleet.OwnerID, store.EventNodeCordoned))

	_, err = store.CordonNode(ctx, f.db.Pool, store.AllTenants, f.db.Now(), "node_missing", "x")
	require.ErrorIs(t, err, store.ErrNotFound)

	// A revoked node is not cordoned: nothing changes, no event.
	_, err = store.RevokeNode(ctx, f.db.Pool, store.AllTenants, f.db.Now(), node, "stolen")
	require.NoError(t, err)
	_, err = store.CordonNode(ctx, f.db.Pool, store.AllTenants, f.db.Now(), node, "x")
	require.ErrorIs(t, err, store.ErrNodeRevoked)
	require.EqualError(t, err, "node "+node+" is revoked")
	n, err = store.GetNode(ctx, f.db.Pool, store.AllTenants, node)
	require.NoError(t, err)
	require.False(t, n.Cordoned)
	require.Equal(t, 2, countEvents(t, f.db, f.fleet.OwnerID, store.EventNodeCordoned))
	_, err = store.UncordonNode(ctx, f.db.Pool, store.AllTenants, f.db.Now(), "node_missing")
	require.ErrorIs(t, err, store.ErrNotFound)
}
