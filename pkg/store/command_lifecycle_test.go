package store_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// lifecycleBatch is how many commands one step of the lifecycle tests and
// benchmark carries: what the API's and the gateway's batchers gather under
// load.
const lifecycleBatch = 10

// lifecycleFixture is a fleet of lifecycleBatch adopted nodes with a live
// session on one gateway, one command of each queued, claimed and finished
// per step.
type lifecycleFixture struct {
	db    *store.DB
	fleet *storetest.Fleet
}

func newLifecycleFixture(tb testing.TB) lifecycleFixture {
	tb.Helper()
	db := storetest.New(tb, clock.New())
	fleet := storetest.NewFleetWith(tb, db, storetest.FleetOpts{Name: "life", GPUs: make([]int, lifecycleBatch),
		Node: func(_ int, o *storetest.NodeOpts) { o.GatewayID = "gw_life" }})
	return lifecycleFixture{db: db, fleet: fleet}
}

// queue queues one command on each node as the API does (AutoCommit, with
// a request id and an audit row each) and returns their ids.
func (f lifecycleFixture) queue(tb testing.TB, round int) []string {
	tb.Helper()
	now := f.db.Now()
	cmds := make([]store.NewCommand, len(f.fleet.Nodes))
	out := make([]string, len(cmds))
	for i, node := range f.fleet.Nodes {
		out[i] = ids.New(ids.Command, now)
		cmds[i] = store.NewCommand{ID: out[i], NodeID: node, Kind: store.CommandDiagNVML, Deadline: now.Add(time.Minute),
			RequestID: fmt.Sprintf("req-%d-%d", round, i), CreatedBy: "tok_life", Scope: store.AllTenants,
			Audit: &store.AuditEntry{TenantID: f.fleet.OwnerID, TokenID: "tok_life", Role: "tenant-admin",
				Procedure: "/bc.compute.v1.CommandService/RunCommand"}}
	}
	res, err := store.QueueCommands(tb.Context(), f.db.AutoCommit(), nil, now, cmds)
	require.NoError(tb, err)
	for i, r := range res {
		require.NoError(tb, r.Err)
		require.False(tb, r.Existing)
		require.Equal(tb, out[i], r.ID)
	}
	return out
}

// claim claims every node's queued commands as the gateway does and checks
// it got cmds, one per node.
func (f lifecycleFixture) claim(tb testing.TB, cmds []string) {
	tb.Helper()
	reqs := make([]store.ClaimRequest, len(f.fleet.Nodes))
	for i, node := range f.fleet.Nodes {
		reqs[i] = store.ClaimRequest{NodeID: node, SessionID: "ses_fleet", Known: 1}
	}
	out, err := store.ClaimSessionDeliveries(tb.Context(), f.db.AutoCommit(), f.db.Now(), reqs)
	require.NoError(tb, err)
	for i, d := range out {
		require.True(tb, d.Current)
		require.Len(tb, d.Commands, 1)
		require.Equal(tb, cmds[i], d.Commands[0].ID)
	}
}

// apply reports every command succeeded as the gateway does.
func (f lifecycleFixture) apply(tb testing.TB, cmds []string) {
	tb.Helper()
	now := f.db.Now()
	us := make([]store.SessionCommandUpdate, len(cmds))
	for i, id := range cmds {
		us[i] = store.SessionCommandUpdate{NodeID: f.fleet.Nodes[i], CommandID: id, State: "succeeded",
			Result: []byte(`{"diag":{}}`), Now: now}
	}
	out, err := store.ApplySessionCommandUpdates(tb.Context(), f.db.AutoCommit(), us)
	require.NoError(tb, err)
	for _, o := range out {
		require.True(tb, o.Applied)
		require.True(tb, o.Terminal)
	}
}

// TestCommandLifecycleStatements: a batch of lifecycleBatch commands is
// queued in one statement (the commands, their command.queued events, the
// gateway's poke and the audit rows), claimed for delivery in one (the
// sessions' nodes with the claim of their commands) and finished in one
// (the commands, their command.succeeded events), whatever the batch's
// size; the events have no outbox rows, and each statement publishes one
// hint for the events of the batch (one tenant, one type). Not parallel:
// the counter sees every statement of the process.
func TestCommandLifecycleStatements(t *testing.T) {
	f := newLifecycleFixture(t)
	ctx := t.Context()
	var (
		mu        sync.Mutex
		published []string
	)
	f.db.PokeVia(func(subject string, _ []byte, _ int64) error {
		mu.Lock()
		defer mu.Unlock()
		published = append(published, subject)
		return nil
	})
	step := func(name string, limit int, fn func(), hints ...string) {
		t.Helper()
		stmts := storetest.CountStatements()
		fn()
		stmts.Stop()
		sent := callerStatements(stmts.SQL())
		require.LessOrEqual(t, len(sent), limit, "%s:\n%s", name, strings.Join(sent, "\n---\n"))
		mu.Lock()
		defer mu.Unlock()
		require.Equal(t, hints, published, "%s: the hints published", name)
		published = nil
	}
	hint := func(typ string) string { return store.SubjectEvents + "." + f.fleet.OwnerID + "." + typ }
	var cmds []string
	step("queue", 1, func() { cmds = f.queue(t, 0) }, hint(store.EventCommandQueued))
	step("claim", 1, func() { f.claim(t, cmds) })
	step("apply", 1, func() { f.apply(t, cmds) }, hint(store.EventCommandSucceeded))

	// What each command promises was written: its row in its end state,
	// two events, one audit row, and one poke of the gateway for the
	// batch; no outbox row for the events.
	count := func(sql string, args ...any) int {
		var n int
		require.NoError(t, f.db.Pool.QueryRow(ctx, sql, args...).Scan(&n))
		return n
	}
	require.Equal(t, lifecycleBatch, count(`SELECT count(*) FROM commands WHERE id = ANY($1) AND state = 'succeeded'
		AND deliveries = 1 AND delivered_at IS NOT NULL AND finished_at IS NOT NULL AND result IS NOT NULL`, cmds))
	require.Equal(t, 2*lifecycleBatch, count(`SELECT count(*) FROM events WHERE subject_id = ANY($1)`, cmds))
	require.Equal(t, lifecycleBatch, count(`SELECT count(*) FROM events WHERE subject_id = ANY($1) AND type = $2`,
		cmds, store.EventCommandSucceeded))
	require.Equal(t, lifecycleBatch, count(`SELECT count(*) FROM audit WHERE target = ANY($1)`, cmds))
	require.Zero(t, count(`SELECT count(*) FROM outbox WHERE subject LIKE $1`, store.SubjectEvents+".%"))
	require.Equal(t, 1, count(`SELECT count(*) FROM outbox WHERE subject = $1`, store.SubjectPokeGatewayPrefix+"gw_life"))
}

// callerStatements drops from sql the outbox notifier's NOTIFY
// (store.OutboxChannel): its own goroutine sends it, coalesced, after the
// statement that wrote outbox rows returned, on another connection and
// outside the caller's round trips, so it lands in whichever step runs then.
func callerStatements(sql []string) []string {
	var out []string
	for _, s := range sql {
		if !strings.Contains(s, "pg_notify('"+store.OutboxChannel+"'") {
			out = append(out, s)
		}
	}
	return out
}

// BenchmarkCommandLifecycle runs the three writes of a command's life for a
// batch of lifecycleBatch commands, one per node, as the API and the gateway
// issue them: queue (QueueCommands), claim for delivery
// (ClaimSessionDeliveries) and the terminal update (ApplySessionCommandUpdates).
// One op is one batch through all three; statements/op counts what the
// callers sent (not the outbox notifier's NOTIFY), queue-, claim- and
// apply-ns/op split the op's time by step.
func BenchmarkCommandLifecycle(b *testing.B) {
	f := newLifecycleFixture(b)
	clk := clock.New()
	var queue, claim, apply time.Duration
	stmts := storetest.CountStatements()
	b.ResetTimer()
	for i := range b.N {
		t0 := clk.Now()
		cmds := f.queue(b, i)
		t1 := clk.Now()
		f.claim(b, cmds)
		t2 := clk.Now()
		f.apply(b, cmds)
		t3 := clk.Now()
		queue, claim, apply = queue+t1.Sub(t0), claim+t2.Sub(t1), apply+t3.Sub(t2)
	}
	b.StopTimer()
	stmts.Stop()
	n := float64(b.N)
	b.ReportMetric(float64(len(callerStatements(stmts.SQL())))/n, "statements/op")
	b.ReportMetric(float64(queue.Nanoseconds())/n, "queue-ns/op")
	b.ReportMetric(float64(claim.Nanoseconds())/n, "claim-ns/op")
	b.ReportMetric(float64(apply.Nanoseconds())/n, "apply-ns/op")
}

// TestApplySessionCommandUpdatesPassesResultsAsTheyAre: the results of a
// batch of command updates go to the statement as the bytes the gateway
// encoded, not copied into strings first: a batch whose updates carry
// results (a diag result is about 1.5 kB) allocates no more, per update,
// than one whose updates carry none, but for the growth of pgx's buffers.
func TestApplySessionCommandUpdatesPassesResultsAsTheyAre(t *testing.T) {
	f := newLifecycleFixture(t)
	ctx := t.Context()
	cmds := f.queue(t, 0)
	f.claim(t, cmds)
	result := []byte(`{"output": "` + strings.Repeat("x", 1500) + `"}`)
	const n = 100
	batch := func(result []byte) []store.SessionCommandUpdate {
		us := make([]store.SessionCommandUpdate, 0, n)
		for i := range n {
			node := i % len(cmds)
			us = append(us, store.SessionCommandUpdate{NodeID: f.fleet.Nodes[node], CommandID: fmt.Sprintf("%s-%d", cmds[node], i),
				State: "succeeded", Result: result, Now: f.db.Now()})
		}
		return us
	}
	allocs := func(us []store.SessionCommandUpdate) float64 {
		return testing.AllocsPerRun(10, func() {
			// Commands that do not exist: the statement is sent whole and
			// applies nothing, so every run sends the same.
			_, err := store.ApplySessionCommandUpdates(ctx, f.db.AutoCommit(), us)
			require.NoError(t, err)
		})
	}
	with, without := allocs(batch(result)), allocs(batch(nil))
	require.Less(t, with-without, float64(n)/4, "allocations of %d updates with results %.0f, without %.0f", n, with, without)
}

// TestCommandResultCompressedWithLZ4: a result that puts its command's row
// over PostgreSQL's TOAST threshold (2 kB), a logs.collect of 40 journal
// lines here (a diag.nvml result of 8 GPUs is 1.7 kB of jsonb, with a
// signed command's other columns at the threshold), is compressed in the
// terminal update that writes it: with lz4 (migration 000028), which took
// half of pglz's CPU for such a result, and it reads back as written.
func TestCommandResultCompressedWithLZ4(t *testing.T) {
	f := newLifecycleFixture(t)
	ctx := t.Context()
	cmd := storetest.Command(t, f.db, &storetest.CommandOpts{NodeID: f.fleet.Nodes[0], Kind: store.CommandLogsCollect,
		State: "delivered"})
	var lines []string
	for i := range 40 {
		lines = append(lines, fmt.Sprintf("Dec 07 20:%02d:00 gpu-01 nvidia-persistenced[%d]: device 0000:%02x:00.0 persistence mode enabled",
			i, 1200+i, 16+i%8))
	}
	result, err := json.Marshal(map[string]string{"output": strings.Join(lines, "\n") + "\n"})
	require.NoError(t, err)
	out, err := store.ApplySessionCommandUpdates(ctx, f.db.AutoCommit(), []store.SessionCommandUpdate{{NodeID: f.fleet.Nodes[0],
		CommandID: cmd.ID, State: "succeeded", Result: result, Now: f.db.Now()}})
	require.NoError(t, err)
	require.True(t, out[0].Applied)
	var (
		compression string
		stored      int
		same        bool
	)
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT COALESCE(pg_column_compression(result), ''), pg_column_size(result),
		result = $2::jsonb FROM commands WHERE id = $1`, cmd.ID, string(result)).Scan(&compression, &stored, &same))
	require.Equal(t, "lz4", compression, "the result is compressed, with lz4")
	require.Less(t, stored, len(result)/2)
	require.True(t, same, "the result reads back as written")
}
