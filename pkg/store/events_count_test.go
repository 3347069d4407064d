package store_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
)

// countEvents returns how many events of typ tenant has, and checks that
// none of them has an outbox row (an event's only message is its hint,
// published after the commit).
func countEvents(t *testing.T, db *store.DB, tenant, typ string) int {
	t.Helper()
	var n, outboxed int
	require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM events WHERE tenant_id = $1 AND type = $2`,
		tenant, typ).Scan(&n))
	require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE subject = $1`,
		store.SubjectEvents+"."+tenant+"."+typ).Scan(&outboxed))
	require.Zero(t, outboxed, "events of %s have no outbox rows", typ)
	return n
}
