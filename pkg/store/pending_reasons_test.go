package store_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
)

// TestPendingReasonsWrittenOnlyWhenChanged: a reason is written to a
// pending reservation when it differs from the stored one, never to one no
// longer pending, and placing a reservation clears it.
func TestPendingReasonsWrittenOnlyWhenChanged(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "reasons", 8)
	a, b := f.reserve(2, time.Hour), f.reserve(2, time.Hour)
	_, err := f.place(nil, f.placement(b, f.fleet.Nodes[0], 0, 1))
	require.NoError(t, err)
	set := func(rs ...store.PendingReason) int64 {
		n, err := store.SetPendingReasons(t.Context(), f.db.Pool, f.db.Now(), rs)
		require.NoError(t, err)
		return n
	}
	require.EqualValues(t, 1, set(store.PendingReason{ID: a.ID, Reason: "waiting: x"}, store.PendingReason{ID: b.ID, Reason: "waiting: y"}),
		"b is binding: left alone")
	require.Equal(t, "waiting: x", f.get(a.ID).Reason)
	require.Empty(t, f.get(b.ID).Reason)
	require.Zero(t, set(store.PendingReason{ID: a.ID, Reason: "waiting: x"}), "unchanged: not written")
	require.EqualValues(t, 1, set(store.PendingReason{ID: a.ID, Reason: "waiting: z"}))

	_, err = f.place(nil, f.placement(a, f.fleet.Nodes[0], 2, 3))
	require.NoError(t, err)
	got := f.get(a.ID)
	require.Equal(t, store.ReservationBinding, got.State)
	require.Empty(t, got.Reason, "placing clears the reason")
}

// TestFailNeverPlaced: of due reservations, the ones still pending fail
// with the reason and a reservation.failed event; placed ones are left to
// EndReservation.
func TestFailNeverPlaced(t *testing.T) {
	t.Parallel()
	f := newPlaceFixture(t, "neverplaced", 8)
	placed, pending := f.reserve(2, time.Hour), f.reserve(7, time.Hour)
	_, err := f.place(nil, f.placement(placed, f.fleet.Nodes[0], 0, 1))
	require.NoError(t, err)
	f.clk.Advance(time.Hour)
	var failed []store.ReservationFailure
	require.NoError(t, f.db.InTx(t.Context(), func(tx pgx.Tx) error {
		ids, err := store.ClaimDueReservations(t.Context(), tx, f.db.Now(), 10)
		require.ElementsMatch(t, []string{placed.ID, pending.ID}, ids)
		if err != nil {
			return err
		}
		failed, err = store.FailNeverPlaced(t.Context(), tx, f.db.Now(), ids)
		return err
	}))
	require.Equal(t, []store.ReservationFailure{{ID: pending.ID, TenantID: f.tenant, Reason: store.NeverPlacedReason(7)}}, failed)
	require.Equal(t, "never placed: no node had 7 free GPUs before its end time", store.NeverPlacedReason(7))
	got := f.get(pending.ID)
	require.Equal(t, store.ReservationFailed, got.State)
	require.Equal(t, store.NeverPlacedReason(7), got.Reason)
	require.NotNil(t, got.EndedAt)
	require.Equal(t, []string{"reservation.created", "reservation.failed"}, f.events(pending.ID))
	require.Equal(t, 1, countEvents(t, f.db, f.tenant, "reservation.failed"))
	require.Equal(t, store.ReservationBinding, f.get(placed.ID).State, "placed: not failed")
}
