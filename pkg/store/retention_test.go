package store_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// TestDeleteOldCommands: DeleteOldCommands deletes the commands that
// finished before the cutoff, lowest id first and at most limit per call,
// and keeps every other: open ones, those that finished after the cutoff
// (created before it or not), and the acceptance commands of a node still
// accepting, wherever they sort among the commands it deletes.
func TestDeleteOldCommands(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	now := db.Now()
	const day = 24 * time.Hour
	cutoff := now.Add(-30 * day)
	adopted := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAdopted}).ID
	accepting := storetest.Node(t, db, &storetest.NodeOpts{State: store.NodeAccepting}).ID
	// In creation order, so in id order (ids.New at CreatedAt).
	mk := func(node, purpose, state string, created, finished time.Time) string {
		t.Helper()
		return storetest.Command(t, db, &storetest.CommandOpts{NodeID: node, Purpose: purpose, State: state,
			CreatedAt: created, FinishedAt: finished}).ID
	}
	openOld := mk(adopted, "user", "running", cutoff.Add(-10*day), time.Time{})
	mk(adopted, "user", "succeeded", cutoff.Add(-9*day), cutoff.Add(-9*day))
	accKept := mk(accepting, "acceptance", "expired", cutoff.Add(-8*day), cutoff.Add(-8*day))
	mk(adopted, "acceptance", "succeeded", cutoff.Add(-7*day), cutoff.Add(-7*day))
	finishedLate := mk(adopted, "user", "failed", cutoff.Add(-time.Hour), cutoff.Add(time.Hour))
	due := mk(adopted, "user", "expired", cutoff.Add(-time.Minute), cutoff.Add(-time.Second))
	recent := mk(adopted, "user", "succeeded", cutoff.Add(time.Hour), cutoff.Add(2*time.Hour))
	openNew := mk(adopted, "user", "queued", now, time.Time{})

	remaining := func() []string {
		t.Helper()
		rows, err := db.Pool.Query(ctx, `SELECT id FROM commands ORDER BY id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	n, err := store.DeleteOldCommands(ctx, db.Pool, cutoff, 2)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, []string{openOld, accKept, finishedLate, due, recent, openNew}, remaining(), "the lowest ids first")
	n, err = store.DeleteOldCommands(ctx, db.Pool, cutoff, 2)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = store.DeleteOldCommands(ctx, db.Pool, cutoff, 2)
	require.NoError(t, err)
	require.Zero(t, n)
	require.Equal(t, []string{openOld, accKept, finishedLate, recent, openNew}, remaining())

	// With no command created after the cutoff, the walk covers them all.
	n, err = store.DeleteOldCommands(ctx, db.Pool, now.Add(day), 10)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, []string{openOld, accKept, openNew}, remaining())
}
