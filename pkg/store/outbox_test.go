package store_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func outboxSubjects(t *testing.T, msgs []store.OutboxMessage) []string {
	t.Helper()
	out := make([]string, 0, len(msgs))
	for i, m := range msgs {
		if i > 0 {
			require.Less(t, msgs[i-1].ID, m.ID, "ordered by id")
		}
		out = append(out, m.Subject)
	}
	return out
}

// TestTakeOutbox: TakeOutbox deletes the oldest rows, skips the rows another
// transaction took, and a rollback puts the rows back.
func TestTakeOutbox(t *testing.T) {
	db := storetest.New(t, nil)
	ctx := t.Context()

	none, err := store.TakeOutbox(ctx, db.Pool, 10)
	require.NoError(t, err)
	require.Empty(t, none)

	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		for _, s := range []string{"t.1", "t.2", "t.3", "t.4", "t.5"} {
			if err := store.Enqueue(ctx, tx, db.Now(), s, []byte(s)); err != nil {
				return err
			}
		}
		return nil
	}))

	a, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = a.Rollback(ctx) }()
	got, err := store.TakeOutbox(ctx, a, 2)
	require.NoError(t, err)
	require.Equal(t, []string{"t.1", "t.2"}, outboxSubjects(t, got), "the oldest first")
	require.Equal(t, "t.1", string(got[0].Payload))

	// Another relay skips the rows a holds.
	b, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = b.Rollback(ctx) }()
	got, err = store.TakeOutbox(ctx, b, 10)
	require.NoError(t, err)
	require.Equal(t, []string{"t.3", "t.4", "t.5"}, outboxSubjects(t, got))

	// A failed publish rolls back: the rows are there again.
	require.NoError(t, b.Rollback(ctx))
	require.NoError(t, a.Rollback(ctx))
	require.Equal(t, 5, countRows(t, db, `SELECT count(*) FROM outbox`))

	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		got, err = store.TakeOutbox(ctx, tx, 10)
		return err
	}))
	require.Equal(t, []string{"t.1", "t.2", "t.3", "t.4", "t.5"}, outboxSubjects(t, got))
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM outbox`), "taken rows are gone once committed")
}
