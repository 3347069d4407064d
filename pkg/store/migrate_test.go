package store_test

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
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
		"node_certs", "node_devices", "commands", "outbox", "outbox_dead_letters", "events", "leases", "audit"} {
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

// TestMigration9OutboxDeleteOnPublish: 000009 deletes the published outbox
// rows, keeps the unpublished ones and drops published_at and its index;
// its down migration restores both, every kept row unpublished.
func TestMigration9OutboxDeleteOnPublish(t *testing.T) {
	url := storetest.NewURL(t)
	v, dirty, err := store.MigrationVersion(url)
	require.NoError(t, err)
	require.False(t, dirty)
	require.GreaterOrEqual(t, v, uint(9))
	// One step at a time: versions need not be consecutive (a branch may
	// lack a number another one took).
	toVersion8 := func() {
		t.Helper()
		v, _, err := store.MigrationVersion(url)
		require.NoError(t, err)
		for v > 8 {
			require.NoError(t, store.MigrateDown(url, 1))
			v, _, err = store.MigrationVersion(url)
			require.NoError(t, err)
		}
		require.Equal(t, uint(8), v)
	}
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	schema := func() (column, index bool) {
		t.Helper()
		require.NoError(t, conn.QueryRow(ctx, `SELECT
			EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = 'outbox' AND column_name = 'published_at'),
			EXISTS (SELECT 1 FROM pg_indexes WHERE indexname = 'outbox_unpublished_idx')`).Scan(&column, &index))
		return column, index
	}
	subjects := func() []string {
		t.Helper()
		rows, err := conn.Query(ctx, `SELECT subject FROM outbox ORDER BY id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}

	toVersion8()
	column, index := schema()
	require.True(t, column)
	require.True(t, index)
	// Raw SQL: rows of the schema at version 8 (published_at), which no
	// store function of today writes.
	_, err = conn.Exec(ctx, `INSERT INTO outbox (subject, payload, created_at, published_at) VALUES
		('t.published', '', now(), now()), ('t.pending', 'p', now(), NULL), ('t.pending2', '', now(), NULL)`)
	require.NoError(t, err)

	require.NoError(t, store.MigrateUp(url))
	column, index = schema()
	require.False(t, column)
	require.False(t, index)
	require.Equal(t, []string{"t.pending", "t.pending2"}, subjects(), "published rows deleted, the others kept")

	toVersion8()
	column, index = schema()
	require.True(t, column)
	require.True(t, index)
	var unpublished int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&unpublished))
	require.Equal(t, 2, unpublished)
	require.NoError(t, store.MigrateUp(url))
}

// TestInterruptedMigrationIsRetried: a run killed during migration N left
// the schema dirty at N with N rolled back; MigrateUp runs N again. A
// migration that fails again names `migrate force`, which marks a version.
func TestInterruptedMigrationIsRetried(t *testing.T) {
	url := storetest.NewURL(t)
	want := tables(t, url)
	latest, _, err := store.MigrationVersion(url)
	require.NoError(t, err)
	require.NoError(t, store.MigrateDown(url, 1))
	setVersion := func(v uint, dirty bool) {
		conn, err := pgx.Connect(t.Context(), url)
		require.NoError(t, err)
		defer conn.Close(context.Background())
		// Raw SQL: golang-migrate's own bookkeeping, as an interrupted run
		// leaves it.
		_, err = conn.Exec(t.Context(), `UPDATE schema_migrations SET version = $1, dirty = $2`, int64(v), dirty)
		require.NoError(t, err)
	}
	setVersion(latest, true) // what golang-migrate writes before it runs a migration

	require.NoError(t, store.MigrateUp(url))
	v, dirty, err := store.MigrationVersion(url)
	require.NoError(t, err)
	require.Equal(t, latest, v)
	require.False(t, dirty)
	require.Equal(t, want, tables(t, url))

	// Dirty although applied (killed between the migration's commit and
	// the clean mark): running it again fails, and the error says what to
	// do. The newest migration that creates a table cannot run twice
	// (others, such as CREATE OR REPLACE, can).
	again := newestCreatingTable(t)
	setVersion(again, true)
	err = store.MigrateUp(url)
	require.ErrorContains(t, err, fmt.Sprintf("better-compute migrate force %d", again))
	require.NoError(t, store.MigrateForce(url, latest))
	v, dirty, err = store.MigrationVersion(url)
	require.NoError(t, err)
	require.Equal(t, latest, v)
	require.False(t, dirty)
	require.NoError(t, store.MigrateUp(url))
	require.ErrorContains(t, store.MigrateForce(url, 999), "999 is not a migration version")
}

// newestCreatingTable is the version of the newest embedded up migration
// that creates a table.
func newestCreatingTable(t *testing.T) uint {
	t.Helper()
	names, err := fs.Glob(store.Migrations, "migrations/*.up.sql")
	require.NoError(t, err)
	slices.Sort(names)
	for _, name := range slices.Backward(names) {
		b, err := fs.ReadFile(store.Migrations, name)
		require.NoError(t, err)
		if strings.Contains(string(b), "CREATE TABLE") {
			v, err := strconv.ParseUint(strings.SplitN(path.Base(name), "_", 2)[0], 10, 32)
			require.NoError(t, err)
			return uint(v)
		}
	}
	require.FailNow(t, "no migration creates a table")
	return 0
}
