package store_test

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// TestScanEventsReadsOneTenant: a tenant's watch reads that tenant's rows
// through events_tenant_idx, not every tenant's (a watch of a quiet tenant
// next to a busy one read all of the busy one's rows on every poll), with
// the generic plan DB.AutoCommit runs it with; AllTenants reads them all;
// MaxEventID of a tenant is its own newest.
func TestScanEventsReadsOneTenant(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	quiet, busy := storetest.Tenant(t, db, nil).ID, storetest.Tenant(t, db, nil).ID
	var mine []int64
	for i := range 1000 {
		if i%400 == 0 {
			mine = append(mine, storetest.Event(t, db, &storetest.EventOpts{TenantID: quiet}))
		}
		storetest.Event(t, db, &storetest.EventOpts{TenantID: busy})
	}
	_, err := db.Pool.Exec(ctx, `ANALYZE events`)
	require.NoError(t, err)

	scan, err := store.ScanEvents(ctx, db.AutoCommit(), 0, store.EventFilter{Scope: store.TenantScope(quiet)}, 500)
	require.NoError(t, err)
	var got []int64
	for _, e := range scan.Events {
		require.Equal(t, quiet, e.TenantID)
		got = append(got, e.ID)
	}
	require.Equal(t, mine, got)
	all, err := store.ScanEvents(ctx, db.AutoCommit(), 0, store.EventFilter{Scope: store.AllTenants}, 2000)
	require.NoError(t, err)
	require.Len(t, all.Events, 1003)
	none, err := store.ScanEvents(ctx, db.AutoCommit(), 0, store.EventFilter{}, 10)
	require.NoError(t, err)
	require.Empty(t, none.Events, "the zero Scope reads nothing")

	newest, err := store.MaxEventID(ctx, db.Pool, store.TenantScope(quiet))
	require.NoError(t, err)
	require.Equal(t, mine[len(mine)-1], newest)
	newest, err = store.MaxEventID(ctx, db.Pool, store.AllTenants)
	require.NoError(t, err)
	require.Equal(t, all.Events[len(all.Events)-1].ID, newest)

	conn, err := db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)
	defer func() { _, _ = conn.Exec(ctx, `RESET plan_cache_mode`) }()
	rows, err := conn.Query(ctx, "EXPLAIN "+store.ScanEventsSQL, quiet, int64(0), []string{}, []string{}, true, 500)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")
	require.Contains(t, plan, "events_tenant_idx", "a tenant's rows through its index:\n%s", plan)
	require.NotContains(t, plan, "Seq Scan on events", "no read of every tenant's rows:\n%s", plan)
	require.NotContains(t, plan, "events_pkey", "no walk of every id:\n%s", plan)
}

// TestEventIDAfterTransactionID: taking an event id gives the transaction
// its id first (migration 000017), which the watch's reading of one
// tenant's rows relies on (store.EventScan).
func TestEventIDAfterTransactionID(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	var def string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d
		JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
		WHERE d.adrelid = 'events'::regclass AND a.attname = 'id'`).Scan(&def))
	require.Equal(t, "events_next_id()", def)

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var before, after *string
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_xact_id_if_assigned()::text`).Scan(&before))
	require.Nil(t, before, "a new transaction has no id yet")
	require.NoError(t, tx.QueryRow(ctx, `SELECT events_next_id(), pg_current_xact_id_if_assigned()::text`).Scan(new(int64), &after))
	require.NotNil(t, after, "taking an event id gave it one")
}

// TestEventWriters: a scan lists the transactions running at its read, and
// EventWriters tells those that may still write events (an open
// transaction that inserted one) from those that may not (one with a
// transaction id that never touched events) and from those that ended.
func TestEventWriters(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	tenant := storetest.Tenant(t, db, nil).ID
	xid := func(tx pgx.Tx) int64 {
		t.Helper()
		var id int64
		require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint % 4294967296`).Scan(&id))
		return id
	}
	writer, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = writer.Rollback(ctx) }()
	storetest.Event(t, db, &storetest.EventOpts{Tx: writer, TenantID: tenant})
	other, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = other.Rollback(ctx) }()
	w, o := xid(writer), xid(other)
	later := storetest.Event(t, db, &storetest.EventOpts{TenantID: tenant})

	scan, err := store.ScanEvents(ctx, db.AutoCommit(), 0, store.EventFilter{Scope: store.TenantScope(tenant)}, 10)
	require.NoError(t, err)
	require.Len(t, scan.Events, 1, "the open transaction's event is not committed")
	require.Equal(t, later, scan.Events[0].ID)
	require.Contains(t, scan.Running, w)
	require.Contains(t, scan.Running, o)

	writing, ended, err := store.EventWriters(ctx, db.Pool, []int64{w, o})
	require.NoError(t, err)
	require.Equal(t, []bool{true, false}, []bool{writing, ended}, "the writer may still commit an event")
	writing, ended, err = store.EventWriters(ctx, db.Pool, []int64{o})
	require.NoError(t, err)
	require.Equal(t, []bool{false, false}, []bool{writing, ended}, "a transaction that never touched events")
	require.NoError(t, writer.Commit(ctx))
	writing, ended, err = store.EventWriters(ctx, db.Pool, []int64{w, o})
	require.NoError(t, err)
	require.Equal(t, []bool{false, true}, []bool{writing, ended}, "the writer ended: a read from now on is final")
	writing, ended, err = store.EventWriters(ctx, db.Pool, nil)
	require.NoError(t, err)
	require.Equal(t, []bool{false, false}, []bool{writing, ended})
}
