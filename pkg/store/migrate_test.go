package store_test

import (
	"context"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	os.Exit(code)
}

func tables(t *testing.T, url string) []string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT table_name FROM information_schema.tables
		WHERE table_schema = 'public' AND table_name <> 'schema_migrations' ORDER BY 1`)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return names
}

// TestMigrationsUpDownUp checks that every down migration undoes its up
// migration and that the schema can be rebuilt afterwards.
func TestMigrationsUpDownUp(t *testing.T) {
	url := storetest.NewURL(t) // already migrated up from the template
	up := tables(t, url)
	for _, want := range []string{"tenants", "api_tokens", "sites", "pools", "join_tokens", "nodes",
		"node_certs", "node_devices", "commands", "outbox", "events", "leases", "audit"} {
		require.Contains(t, up, want)
	}
	v, dirty, err := store.MigrationVersion(url)
	require.NoError(t, err)
	require.False(t, dirty)
	require.NotZero(t, v)

	require.NoError(t, store.MigrateDown(url, 0))
	require.Empty(t, tables(t, url))
	v, _, err = store.MigrationVersion(url)
	require.NoError(t, err)
	require.Zero(t, v)

	require.NoError(t, store.MigrateUp(url))
	require.Equal(t, up, tables(t, url))
	require.NoError(t, store.MigrateUp(url), "a second up is no change, not an error")
}

// TestMigrateDownRefusesTooManySteps: asking to revert more migrations than
// are applied changes nothing, rather than reverting all and then failing.
func TestMigrateDownRefusesTooManySteps(t *testing.T) {
	url := storetest.NewURL(t)
	before := tables(t, url)
	err := store.MigrateDown(url, 999)
	require.ErrorContains(t, err, "nothing reverted")
	require.Equal(t, before, tables(t, url))
	v, _, err := store.MigrationVersion(url)
	require.NoError(t, err)
	require.NotZero(t, v)
}
