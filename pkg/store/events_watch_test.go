package store_test

import (
	"encoding/json"
	"fmt"
	"os"
	"strconv"
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

// TestScanWritersSeesTransactionsPastXmax: a transaction that took its
// transaction id after another's, then an event id before the other took
// one and committed, is running at a read that returns the other's event
// and not its own, yet is not in the read's snapshot's list (its id is the
// snapshot's xmax or above: no transaction with an id as high had ended).
// ScanWriters names it, so that the watch holds the read for it rather
// than delivering past its event, and tells when it ended after the read.
// Not parallel: a transaction of another test with a higher id ending in
// between would put it in the list and leave this path untried.
func TestScanWritersSeesTransactionsPastXmax(t *testing.T) {
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	tenant := storetest.Tenant(t, db, nil).ID
	mark := storetest.Event(t, db, &storetest.EventOpts{TenantID: tenant})
	xid := func(tx pgx.Tx) int64 {
		t.Helper()
		var id int64
		require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint % 4294967296`).Scan(&id))
		return id
	}
	first, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = first.Rollback(ctx) }()
	xid(first)
	slow, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = slow.Rollback(ctx) }()
	lower := storetest.Event(t, db, &storetest.EventOpts{Tx: slow, TenantID: tenant})
	slowID := xid(slow)
	higher := storetest.Event(t, db, &storetest.EventOpts{Tx: first, TenantID: tenant})
	require.NoError(t, first.Commit(ctx))
	require.Less(t, lower, higher)

	for _, scope := range []store.Scope{store.TenantScope(tenant), store.AllTenants} {
		scan, err := store.ScanEvents(ctx, db.AutoCommit(), mark, store.EventFilter{Scope: scope}, 10)
		require.NoError(t, err)
		require.Len(t, scan.Events, 1, "the slow transaction's event is not committed")
		require.Equal(t, higher, scan.Events[0].ID)
		writing, _, held, err := store.ScanWriters(ctx, db.Pool, scan)
		require.NoError(t, err)
		require.True(t, writing, "the slow transaction may still commit an event below the read's")
		require.Contains(t, held, slowID)
		writing, _, err = store.EventWriters(ctx, db.Pool, held)
		require.NoError(t, err)
		require.True(t, writing, "a hold for held waits for the slow transaction")
	}

	scan, err := store.ScanEvents(ctx, db.AutoCommit(), mark, store.EventFilter{Scope: store.AllTenants}, 10)
	require.NoError(t, err)
	require.NoError(t, slow.Commit(ctx))
	writing, ended, held, err := store.ScanWriters(ctx, db.Pool, scan)
	require.NoError(t, err)
	require.Equal(t, []bool{false, true}, []bool{writing, ended},
		"the slow transaction ended after the read: the read was not final (held %v)", held)
}

// TestScanEventsGenericPlans: the watch's reads, every tenant's and one
// tenant's, on AutoCommit's connections (generic plans, seq scans off) with
// plans made while events was nearly empty, as when a watch opens on a new
// deployment, stay cheap as the table grows: a walk of the index from the
// cursor that reads no more rows than the batch, never compiled by JIT.
// With seq scans off, the one scan a read cannot avoid (event_retention,
// whose maximum the read of every tenant takes) is costed above 10^10, and
// a plan that costly is JIT-compiled at every execution: some 200 ms per
// read, however few rows it returns, while the read itself takes well under
// a millisecond.
func TestScanEventsGenericPlans(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	tenant := storetest.Tenant(t, db, nil).ID
	first := storetest.Event(t, db, &storetest.EventOpts{TenantID: tenant})

	conn, err := db.GenericPool().Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	const limit = 100
	reads := []struct {
		name, params, sql, args, index string
	}{
		{"scan_all_events", "bigint, text[], text[], boolean, int", store.ScanAllEventsSQL,
			fmt.Sprintf("%d, '{}', '{}', true, %d", first, limit), "events_pkey"},
		{"scan_tenant_events", "text, bigint, text[], text[], boolean, int", store.ScanEventsSQL,
			fmt.Sprintf("'%s', %d, '{}', '{}', true, %d", tenant, first, limit), "events_tenant_idx"},
	}
	for _, r := range reads {
		_, err := conn.Exec(ctx, "PREPARE "+r.name+" ("+r.params+") AS "+r.sql)
		require.NoError(t, err)
		defer func() { _, _ = conn.Exec(ctx, "DEALLOCATE "+r.name) }()
		// The first execution makes the generic plan, which the
		// connection keeps.
		_, err = conn.Exec(ctx, "EXECUTE "+r.name+" ("+r.args+")")
		require.NoError(t, err)
	}

	events := make([]store.NewEvent, 2000)
	for i := range events {
		events[i] = store.NewEvent{TenantID: tenant,
			Data: store.NodeCordonedData{NodeID: fmt.Sprintf("node-%d", i), Reason: "plan test"}}
	}
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error { return store.WriteEvents(ctx, tx, db.Now(), events...) }))

	for _, r := range reads {
		var out string
		require.NoError(t, conn.QueryRow(ctx,
			"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE "+r.name+" ("+r.args+")").Scan(&out))
		var explained []map[string]json.RawMessage
		require.NoError(t, json.Unmarshal([]byte(out), &explained))
		require.Len(t, explained, 1)
		_, jit := explained[0]["JIT"]
		require.False(t, jit, "%s is JIT-compiled at every execution:\n%s", r.name, out)
		var root planNode
		require.NoError(t, json.Unmarshal(explained[0]["Plan"], &root))
		var scans []planNode
		root.walk(func(n planNode) {
			if n.Relation == "events" {
				scans = append(scans, n)
			}
		})
		require.Len(t, scans, 1, "%s reads events once:\n%s", r.name, out)
		scan := scans[0]
		require.Equal(t, r.index, scan.Index, "%s walks %s:\n%s", r.name, r.index, out)
		require.Equal(t, 1.0, scan.Loops, "%s:\n%s", r.name, out)
		require.Equal(t, float64(limit), scan.Rows, "%s returns a batch:\n%s", r.name, out)
		require.Zero(t, scan.RemovedByFilter, "%s reads no row it does not return:\n%s", r.name, out)
	}
}

// planNode is a node of EXPLAIN (ANALYZE, FORMAT JSON)'s plan.
type planNode struct {
	Type            string     `json:"Node Type"`
	Relation        string     `json:"Relation Name"`
	Index           string     `json:"Index Name"`
	Rows            float64    `json:"Actual Rows"`
	Loops           float64    `json:"Actual Loops"`
	RemovedByFilter float64    `json:"Rows Removed by Filter"`
	Plans           []planNode `json:"Plans"`
}

// walk calls fn with n and every node below it.
func (n planNode) walk(fn func(planNode)) {
	fn(n)
	for _, c := range n.Plans {
		c.walk(fn)
	}
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

// BenchmarkScanEvents times the events watch's read of every tenant's
// events (ScanEvents with AllTenants, a batch of 500, on AutoCommit as the
// API's watch runs it) from the middle of BETTER_COMPUTE_BENCH_EVENTS
// (100,000) events, on a connection whose plan was made while events held
// one row, as when a watch opens on a new deployment:
// `cd pkg && go test -run '^$' -bench BenchmarkScanEvents -benchtime 200x ./store/`.
func BenchmarkScanEvents(b *testing.B) {
	total := 100_000
	if v, err := strconv.Atoi(os.Getenv("BETTER_COMPUTE_BENCH_EVENTS")); err == nil && v > 0 {
		total = v
	}
	db := storetest.New(b, clock.New())
	ctx := b.Context()
	tenant := storetest.Tenant(b, db, nil).ID
	first := storetest.Event(b, db, &storetest.EventOpts{TenantID: tenant})
	all := store.EventFilter{Scope: store.AllTenants}
	_, err := store.ScanEvents(ctx, db.AutoCommit(), first, all, 500)
	require.NoError(b, err)
	for done := 0; done < total; done += 1000 {
		events := make([]store.NewEvent, min(1000, total-done))
		for i := range events {
			events[i] = store.NewEvent{TenantID: tenant,
				Data: store.NodeCordonedData{NodeID: fmt.Sprintf("node-%d", done+i), Reason: "benchmark"}}
		}
		require.NoError(b, db.InTx(ctx, func(tx pgx.Tx) error { return store.WriteEvents(ctx, tx, db.Now(), events...) }))
	}
	b.ResetTimer()
	for range b.N {
		scan, err := store.ScanEvents(ctx, db.AutoCommit(), first+int64(total/2), all, 500)
		require.NoError(b, err)
		require.Len(b, scan.Events, 500)
	}
}
