package store_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// commandsDB returns a database with tenants ten_1 (owning pool_1 with
// n-ok adopted, n-rev adopted and revoked, n-acc accepting) and ten_2
// (owning pool_2 with n-other adopted).
func commandsDB(t *testing.T) (*store.DB, time.Time) {
	t.Helper()
	now := time.Date(2030, 3, 4, 5, 6, 7, 0, time.UTC)
	db := storetest.New(t, clock.NewFake(now))
	storetest.Tenant(t, db, &storetest.TenantOpts{ID: "ten_1", Name: "one"})
	storetest.Tenant(t, db, &storetest.TenantOpts{ID: "ten_2", Name: "two"})
	storetest.Site(t, db, &storetest.SiteOpts{ID: "site_1", Name: "dev-1"})
	storetest.Pool(t, db, &storetest.PoolOpts{ID: "pool_1", SiteID: "site_1", OwnerTenantID: "ten_1", Name: "p"})
	storetest.Pool(t, db, &storetest.PoolOpts{ID: "pool_2", SiteID: "site_1", OwnerTenantID: "ten_2", Name: "q"})
	storetest.Node(t, db, &storetest.NodeOpts{ID: "n-ok", PoolID: "pool_1", State: store.NodeAdopted})
	storetest.Node(t, db, &storetest.NodeOpts{ID: "n-rev", PoolID: "pool_1", State: store.NodeAdopted, RevokedAt: now})
	storetest.Node(t, db, &storetest.NodeOpts{ID: "n-acc", PoolID: "pool_1", State: store.NodeAccepting})
	storetest.Node(t, db, &storetest.NodeOpts{ID: "n-other", PoolID: "pool_2", State: store.NodeAdopted})
	return db, now
}

func queue(t *testing.T, db *store.DB, intent *store.IntentSigner, now time.Time, n store.NewCommand) (store.QueuedCommand, error) {
	t.Helper()
	var out store.QueuedCommand
	err := db.InTx(t.Context(), func(tx pgx.Tx) error {
		var err error
		out, err = store.QueueCommand(t.Context(), tx, intent, now, n)
		return err
	})
	return out, err
}

func countRows(t *testing.T, db *store.DB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.Pool.QueryRow(t.Context(), sql, args...).Scan(&n))
	return n
}

func TestQueueCommand(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	intent, err := store.NewIntentSigner(priv)
	require.NoError(t, err)

	q, err := queue(t, db, intent, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_1", NodeID: "n-ok", Kind: store.CommandNodeReboot,
		Deadline: now.Add(time.Minute), RequestID: "r1", CreatedBy: "tok_1"})
	require.NoError(t, err)
	require.False(t, q.Existing)
	require.Equal(t, "queued", q.State)
	require.Equal(t, "ten_1", q.TenantID)
	require.Equal(t, "user", q.Purpose)
	require.False(t, q.RetrySafe, "node.reboot must not be retry-safe")
	require.Equal(t, "r1", q.RequestID)
	require.True(t, q.Deadline.Equal(now.Add(time.Minute)))

	// Signed over what the gateway sends.
	var sig []byte
	require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT signature FROM commands WHERE id = 'cmd_1'`).Scan(&sig))
	msg := store.CommandMessage(store.SessionCommand{ID: "cmd_1", Kind: q.Kind, Args: []byte("{}"), Deadline: q.Deadline,
		RetrySafe: q.RetrySafe})
	msg.Signature = nil
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	require.NoError(t, err)
	require.True(t, pki.VerifyIntent(pub, pki.CommandSigningInput("n-ok", b), sig), "command signature does not verify")

	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM events WHERE type = 'command.queued' AND subject_id = 'cmd_1'
		AND tenant_id = 'ten_1'`))
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM outbox WHERE subject LIKE 'bc.events.%'`), "events have no outbox rows")

	// The same request id returns the first command and writes nothing.
	again, err := queue(t, db, intent, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_2", NodeID: "n-ok", Kind: store.CommandNodeReboot,
		Deadline: now.Add(time.Hour), RequestID: "r1", CreatedBy: "tok_1"})
	require.NoError(t, err)
	require.True(t, again.Existing)
	require.Equal(t, "cmd_1", again.ID)
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM commands`))
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM events WHERE type = 'command.queued'`))

	// Retry-safety per kind.
	for i, kind := range []string{store.CommandDiagNVML, store.CommandInventoryRefresh, store.CommandLogsCollect} {
		c, err := queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_s" + string(rune('a'+i)), NodeID: "n-ok", Kind: kind,
			Deadline: now.Add(time.Minute)})
		require.NoError(t, err)
		require.True(t, c.RetrySafe, kind)
	}

	_, err = queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_3", NodeID: "n-rev", Kind: store.CommandDiagNVML, Deadline: now})
	require.ErrorIs(t, err, store.ErrNodeNotRunnable)
	require.ErrorContains(t, err, "is revoked")
	_, err = queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_4", NodeID: "n-acc", Kind: store.CommandDiagNVML, Deadline: now})
	require.ErrorIs(t, err, store.ErrNodeNotRunnable)
	require.ErrorContains(t, err, "is not adopted (it is accepting)")
	_, err = queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_5", NodeID: "n-missing", Kind: store.CommandDiagNVML, Deadline: now})
	require.ErrorIs(t, err, store.ErrNotFound)
	_, err = queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_6", NodeID: "n-ok", Kind: "rm -rf", Deadline: now})
	require.ErrorContains(t, err, "unknown command kind")
	require.Equal(t, 0, countRows(t, db, `SELECT count(*) FROM commands WHERE id IN ('cmd_3', 'cmd_4', 'cmd_5', 'cmd_6')`))
}

func TestListCommandsScopesAndPages(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	for _, n := range []store.NewCommand{
		{Scope: store.AllTenants, ID: "cmd_a", NodeID: "n-ok", Kind: store.CommandDiagNVML},
		{Scope: store.AllTenants, ID: "cmd_b", NodeID: "n-other", Kind: store.CommandDiagNVML},
		{Scope: store.AllTenants, ID: "cmd_c", NodeID: "n-ok", Kind: store.CommandLogsCollect},
	} {
		n.Deadline = now.Add(time.Minute)
		_, err := queue(t, db, nil, now, n)
		require.NoError(t, err)
	}
	ids := func(cs []store.Command) []string {
		var out []string
		for _, c := range cs {
			out = append(out, c.ID)
		}
		return out
	}
	all, err := store.ListCommands(t.Context(), db.Pool, store.CommandFilter{Scope: store.AllTenants, Limit: 10})
	require.NoError(t, err)
	require.Equal(t, []string{"cmd_c", "cmd_b", "cmd_a"}, ids(all))
	mine, err := store.ListCommands(t.Context(), db.Pool, store.CommandFilter{Scope: store.TenantScope("ten_1"), Limit: 1})
	require.NoError(t, err)
	require.Equal(t, []string{"cmd_c"}, ids(mine))
	next, err := store.ListCommands(t.Context(), db.Pool, store.CommandFilter{Scope: store.TenantScope("ten_1"), Before: "cmd_c", Limit: 5})
	require.NoError(t, err)
	require.Equal(t, []string{"cmd_a"}, ids(next))
	other, err := store.ListCommands(t.Context(), db.Pool, store.CommandFilter{Scope: store.AllTenants, NodeID: "n-other", Limit: 5})
	require.NoError(t, err)
	require.Equal(t, []string{"cmd_b"}, ids(other))
	got, err := store.GetCommand(t.Context(), db.Pool, store.AllTenants, "cmd_b")
	require.NoError(t, err)
	require.Equal(t, "ten_2", got.TenantID)
	_, err = store.GetCommand(t.Context(), db.Pool, store.AllTenants, "cmd_zz")
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestExpireDueCommands(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	for _, n := range []store.NewCommand{
		{Scope: store.AllTenants, ID: "cmd_due", NodeID: "n-ok", Kind: store.CommandDiagNVML, Deadline: now},
		{Scope: store.AllTenants, ID: "cmd_later", NodeID: "n-ok", Kind: store.CommandDiagNVML, Deadline: now.Add(time.Second)},
	} {
		_, err := queue(t, db, nil, now.Add(-time.Hour), n)
		require.NoError(t, err)
	}
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_done", NodeID: "n-other", State: "succeeded",
		Deadline: now.Add(-time.Minute), CreatedAt: now.Add(-time.Hour)})
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_acc", NodeID: "n-acc", Purpose: "acceptance",
		Deadline: now.Add(-time.Hour), CreatedAt: now.Add(-time.Hour)})

	var expired []store.Command
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		var err error
		expired, err = store.ExpireDueCommands(t.Context(), tx, now, 10)
		return err
	}))
	require.Len(t, expired, 1)
	require.Equal(t, "cmd_due", expired[0].ID)
	require.Equal(t, "expired", expired[0].State)
	require.Equal(t, "deadline passed", expired[0].Error)
	require.NotNil(t, expired[0].FinishedAt)
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM events WHERE type = 'command.expired' AND subject_id = 'cmd_due'
		AND tenant_id = 'ten_1'`))
	for id, state := range map[string]string{"cmd_later": "queued", "cmd_done": "succeeded", "cmd_acc": "queued"} {
		c, err := store.GetCommand(t.Context(), db.Pool, store.AllTenants, id)
		require.NoError(t, err)
		require.Equal(t, state, c.State, id)
	}
	// A second pass finds nothing.
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		var err error
		expired, err = store.ExpireDueCommands(t.Context(), tx, now, 10)
		return err
	}))
	require.Empty(t, expired)
}

func TestApplySessionCommandUpdateWritesCommandEvents(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	for _, id := range []string{"cmd_ok", "cmd_bad"} {
		_, err := queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: id, NodeID: "n-ok", Kind: store.CommandDiagNVML, Deadline: now.Add(time.Minute)})
		require.NoError(t, err)
	}
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_acc", NodeID: "n-acc", Purpose: "acceptance", State: "delivered",
		Deadline: now, CreatedAt: now})
	apply := func(node, id, state string) store.SessionCommandUpdated {
		var out store.SessionCommandUpdated
		require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
			var err error
			outs, err := store.ApplySessionCommandUpdates(t.Context(), tx, []store.SessionCommandUpdate{{NodeID: node, CommandID: id,
				State: state, Error: map[bool]string{true: "boom"}[state == "failed"], Now: now}})
			if err == nil {
				out = outs[0]
			}
			return err
		}))
		return out
	}
	require.True(t, apply("n-ok", "cmd_ok", "running").Applied)
	require.True(t, apply("n-ok", "cmd_ok", "succeeded").Terminal)
	require.True(t, apply("n-ok", "cmd_bad", "failed").Terminal)
	require.False(t, apply("n-ok", "cmd_ok", "succeeded").Applied, "a repeated terminal update was applied")
	require.True(t, apply("n-acc", "cmd_acc", "succeeded").Acceptance)

	type ev struct{ Type, Subject, Tenant string }
	rows, err := db.Pool.Query(t.Context(), `SELECT type, subject_id, tenant_id FROM events WHERE type LIKE 'command.%'
		AND type <> 'command.queued' ORDER BY id`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ev])
	require.NoError(t, err)
	require.Equal(t, []ev{{"command.succeeded", "cmd_ok", "ten_1"}, {"command.failed", "cmd_bad", "ten_1"}}, got)
}

// TestApplySessionCommandUpdatesLeaveUnchangedRowsUnlocked: an update that
// does not move its command forward (a repeated report, a terminal one
// answered again from the daemon's journal) neither waits for nor takes the
// command's row lock: with another transaction holding it, the batch still
// applies its other updates at once (lock_timeout would fail it otherwise)
// and writes nothing for the unchanged command.
func TestApplySessionCommandUpdatesLeaveUnchangedRowsUnlocked(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	ctx := t.Context()
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_done", NodeID: "n-ok", State: "succeeded", CreatedAt: now})
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_running", NodeID: "n-ok", State: "running", CreatedAt: now})
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_new", NodeID: "n-ok", State: "delivered", CreatedAt: now})
	holder, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT id FROM commands WHERE id IN ('cmd_done', 'cmd_running') FOR UPDATE`)
	require.NoError(t, err)

	var out []store.SessionCommandUpdated
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '2s'`); err != nil {
			return err
		}
		var err error
		out, err = store.ApplySessionCommandUpdates(ctx, tx, []store.SessionCommandUpdate{
			{NodeID: "n-ok", CommandID: "cmd_done", State: "succeeded", Result: []byte(`{"again":true}`), Now: now},
			{NodeID: "n-ok", CommandID: "cmd_running", State: "delivered", Now: now},
			{NodeID: "n-ok", CommandID: "cmd_new", State: "running", Now: now}})
		return err
	}))
	require.False(t, out[0].Applied)
	require.False(t, out[1].Applied)
	require.True(t, out[2].Applied)
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM commands WHERE id = 'cmd_done' AND result IS NULL`),
		"the repeated terminal report changed nothing")
}

// TestApplySessionCommandUpdatesAfterTheDeadline: a command must finish
// before its deadline, whether or not the expiry reconciler ran first. A
// terminal report at or after the deadline records it expired (a success
// keeps its result), with the command.expired event and NATS message the
// reconciler would have written; a daemon's "received too late" failure is
// expired whatever its time; an on-time report is recorded as it came.
func TestApplySessionCommandUpdatesAfterTheDeadline(t *testing.T) {
	t.Parallel()
	require.Equal(t, daemon.ErrTextExpired, store.CommandErrTextExpired, "the daemon's and the store's text must agree")
	db, now := commandsDB(t)
	ctx := t.Context()
	deadline := now.Add(time.Minute)
	for _, id := range []string{"cmd_late_ok", "cmd_ok", "cmd_too_late", "cmd_late_bad", "cmd_at", "cmd_reaped"} {
		_, err := queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: id, NodeID: "n-ok", Kind: store.CommandDiagNVML, Deadline: deadline})
		require.NoError(t, err)
	}
	storetest.Command(t, db, &storetest.CommandOpts{ID: "cmd_acc", NodeID: "n-acc", Purpose: "acceptance", State: "running",
		Deadline: deadline, CreatedAt: now, DeliveredAt: now})
	// Every user command but cmd_too_late was started.
	var running []store.SessionCommandUpdate
	for _, id := range []string{"cmd_late_ok", "cmd_ok", "cmd_late_bad", "cmd_at", "cmd_reaped"} {
		running = append(running, store.SessionCommandUpdate{NodeID: "n-ok", CommandID: id, State: "running", Now: now})
	}
	_, err := store.ApplySessionCommandUpdates(ctx, db.Pool, running)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `DELETE FROM outbox`)
	require.NoError(t, err)

	late, early := deadline.Add(20*time.Second), deadline.Add(-30*time.Second)
	u := func(id, state, errText string, at time.Time) store.SessionCommandUpdate {
		var result []byte
		if state == "succeeded" {
			result = []byte(`{"output": "` + id + `"}`)
		}
		node := "n-ok"
		if id == "cmd_acc" {
			node = "n-acc"
		}
		return store.SessionCommandUpdate{NodeID: node, CommandID: id, State: state, Result: result, Error: errText, Now: at}
	}
	var out []store.SessionCommandUpdated
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		out, err = store.ApplySessionCommandUpdates(ctx, tx, []store.SessionCommandUpdate{
			u("cmd_late_ok", "succeeded", "", late),
			u("cmd_ok", "succeeded", "", early),
			u("cmd_too_late", "failed", daemon.ErrTextExpired, early),
			u("cmd_late_bad", "failed", "boom", late),
			u("cmd_at", "succeeded", "", deadline),
			u("cmd_acc", "succeeded", "", late),
		})
		return err
	}))
	expired := store.SessionCommandUpdated{Applied: true, Terminal: true, State: "expired"}
	require.Equal(t, []store.SessionCommandUpdated{
		expired,
		{Applied: true, Terminal: true, State: "succeeded"},
		expired,
		expired,
		expired,
		{Applied: true, Terminal: true, Acceptance: true, State: "expired"},
	}, ofCommands(t, out, store.CommandDiagNVML, now))

	for id, want := range map[string]struct{ state, err string }{
		"cmd_late_ok":  {"expired", "deadline passed"},
		"cmd_ok":       {"succeeded", ""},
		"cmd_too_late": {"expired", daemon.ErrTextExpired},
		"cmd_late_bad": {"expired", "deadline passed"},
		"cmd_at":       {"expired", "deadline passed"},
		"cmd_acc":      {"expired", "deadline passed"},
	} {
		c, err := store.GetCommand(ctx, db.Pool, store.AllTenants, id)
		require.NoError(t, err)
		require.Equal(t, want.state, c.State, id)
		require.Equal(t, want.err, c.Error, id)
		require.NotNil(t, c.FinishedAt, id)
		if id == "cmd_late_ok" || id == "cmd_ok" {
			require.JSONEq(t, `{"output": "`+id+`"}`, string(c.Result), "%s: the result is kept", id)
		}
	}

	// The reconciler expires the last one: its event is the model.
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.ExpireDueCommands(ctx, tx, late, 10)
		return err
	}))
	type ev struct {
		Type, Subject string
		Data          []byte
	}
	rows, err := db.Pool.Query(ctx, `SELECT type, subject_id, data FROM events WHERE type LIKE 'command.%'
		AND type <> 'command.queued' AND tenant_id = 'ten_1' ORDER BY subject_id`)
	require.NoError(t, err)
	evs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ev])
	require.NoError(t, err)
	data := func(id, state, errText string) string {
		return `{"commandId": "` + id + `", "nodeId": "n-ok", "kind": "diag.nvml", "state": "` + state + `"` +
			map[bool]string{true: `, "error": "` + errText + `"`}[errText != ""] + `}`
	}
	want := []struct{ typ, id, data string }{
		{"command.expired", "cmd_at", data("cmd_at", "expired", "deadline passed")},
		{"command.expired", "cmd_late_bad", data("cmd_late_bad", "expired", "deadline passed")},
		{"command.expired", "cmd_late_ok", data("cmd_late_ok", "expired", "deadline passed")},
		{"command.succeeded", "cmd_ok", data("cmd_ok", "succeeded", "")},
		{"command.expired", "cmd_reaped", data("cmd_reaped", "expired", "deadline passed")},
		{"command.expired", "cmd_too_late", data("cmd_too_late", "expired", daemon.ErrTextExpired)},
	}
	require.Len(t, evs, len(want), "one event per user command, none for the acceptance check")
	for i, w := range want {
		require.Equal(t, w.typ, evs[i].Type, w.id)
		require.Equal(t, w.id, evs[i].Subject)
		require.JSONEq(t, w.data, string(evs[i].Data), w.id)
	}

	// The events have no outbox rows (their hints are published after the
	// commit); the acceptance check pokes the controllers, whose reconciler
	// retries an expired check.
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM outbox WHERE subject LIKE 'bc.events.%'`))
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM outbox WHERE subject = $1`, store.SubjectPokeControllers))
}

// TestQueueCommandsBatch queues one batch mixing good commands, refusals
// and repeated request ids: each command gets its own answer, the refused
// ones write nothing, a request id repeated in the batch or used before
// answers the first command, and the gateways get one poke each.
func TestQueueCommandsBatch(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	ctx := t.Context()
	for _, n := range []struct{ id, gw string }{{"n-gw-a", "gw-a"}, {"n-gw-a2", "gw-a"}, {"n-gw-b", "gw-b"}} {
		storetest.Node(t, db, &storetest.NodeOpts{ID: n.id, PoolID: "pool_1", State: store.NodeAdopted, GatewayID: n.gw})
	}
	before, err := queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_0", NodeID: "n-ok", Kind: store.CommandDiagNVML,
		Deadline: now.Add(time.Minute), RequestID: "old"})
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `DELETE FROM outbox`)
	require.NoError(t, err)

	// tenant "" is every tenant's scope (a root administrator's).
	cmd := func(id, node, kind, req, tenant string) store.NewCommand {
		scope := store.AllTenants
		if tenant != "" {
			scope = store.TenantScope(tenant)
		}
		return store.NewCommand{ID: id, NodeID: node, Kind: kind, Deadline: now.Add(time.Minute), RequestID: req,
			CreatedBy: "tok_1", Scope: scope}
	}
	batch := []store.NewCommand{
		cmd("cmd_a", "n-gw-a", store.CommandDiagNVML, "", "ten_1"),
		cmd("cmd_b", "n-gw-b", store.CommandLogsCollect, "same", ""),
		cmd("cmd_c", "n-rev", store.CommandDiagNVML, "", ""),           // revoked
		cmd("cmd_d", "n-acc", store.CommandDiagNVML, "", ""),           // not adopted
		cmd("cmd_e", "n-other", store.CommandDiagNVML, "", "ten_1"),    // another tenant's
		cmd("cmd_f", "n-none", store.CommandDiagNVML, "", ""),          // unknown node
		cmd("cmd_g", "n-gw-b", store.CommandNodeReboot, "same", ""),    // repeats cmd_b's request id
		cmd("cmd_h", "n-ok", store.CommandDiagNVML, "old", ""),         // request id used before the batch
		cmd("cmd_i", "n-gw-a2", store.CommandInventoryRefresh, "", ""), // same gateway as cmd_a
		cmd("cmd_j", "n-gw-a", "rm -rf", "", ""),                       // unknown kind
		cmd("cmd_k", "n-gw-a", store.CommandDiagNVML, "", ""),          // a second command on cmd_a's node
	}
	var res []store.QueueResult
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		res, err = store.QueueCommands(ctx, tx, nil, now, batch)
		return err
	}))
	require.Len(t, res, len(batch))
	for _, i := range []int{0, 1, 8, 10} {
		require.NoError(t, res[i].Err, batch[i].ID)
		require.False(t, res[i].Existing, batch[i].ID)
		require.Equal(t, batch[i].ID, res[i].ID)
		require.Equal(t, "queued", res[i].State)
		require.Equal(t, "ten_1", res[i].TenantID)
	}
	require.Equal(t, "gw-a", res[0].GatewayID)
	require.Equal(t, "gw-b", res[1].GatewayID)
	// Each names its gateway's poke row (OutboxIDHeader of a direct publish).
	for _, r := range res[:2] {
		var row int64
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT id FROM outbox WHERE subject = $1`,
			store.SubjectPokeGatewayPrefix+r.GatewayID).Scan(&row))
		require.Equal(t, row, r.PokeID, r.GatewayID)
	}
	require.ErrorIs(t, res[2].Err, store.ErrNodeNotRunnable)
	require.ErrorContains(t, res[2].Err, "revoked")
	require.ErrorIs(t, res[3].Err, store.ErrNodeNotRunnable)
	require.ErrorContains(t, res[3].Err, "not adopted (it is accepting)")
	require.ErrorIs(t, res[4].Err, store.ErrNotFound)
	require.ErrorIs(t, res[5].Err, store.ErrNotFound)
	require.NoError(t, res[6].Err)
	require.True(t, res[6].Existing)
	require.Equal(t, "cmd_b", res[6].ID)
	require.Equal(t, store.CommandLogsCollect, res[6].Kind)
	require.NoError(t, res[7].Err)
	require.True(t, res[7].Existing)
	require.Equal(t, before.ID, res[7].ID)
	require.ErrorContains(t, res[9].Err, "unknown command kind")

	var ids []string
	rows, err := db.Pool.Query(ctx, `SELECT id FROM commands ORDER BY id`)
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"cmd_0", "cmd_a", "cmd_b", "cmd_i", "cmd_k"}, ids)
	require.Equal(t, 4, countRows(t, db, `SELECT count(*) FROM events WHERE type = 'command.queued'
		AND subject_id = ANY('{cmd_a,cmd_b,cmd_i,cmd_k}')`))
	rows, err = db.Pool.Query(ctx, `SELECT subject, payload FROM outbox WHERE subject LIKE 'bc.poke.%' ORDER BY subject`)
	require.NoError(t, err)
	pokes := map[string][]string{}
	for rows.Next() {
		var subject string
		var payload []byte
		require.NoError(t, rows.Scan(&subject, &payload))
		var p store.Poke
		require.NoError(t, json.Unmarshal(payload, &p), "%s", payload)
		pokes[subject] = p.NodeIDs
	}
	require.NoError(t, rows.Err())
	require.Equal(t, map[string][]string{"bc.poke.gw.gw-a": {"n-gw-a", "n-gw-a2"}, "bc.poke.gw.gw-b": {"n-gw-b"}}, pokes)

	// The event is what the watch sends: id, tenant, type, subject, data
	// and time.
	var (
		evID                 int64
		tenant, typ, subject string
		data                 map[string]any
		created              time.Time
	)
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT id, tenant_id, type, subject_id, data, created_at FROM events
		WHERE subject_id = 'cmd_k'`).Scan(&evID, &tenant, &typ, &subject, &data, &created))
	require.NotZero(t, evID)
	require.Equal(t, "ten_1", tenant)
	require.Equal(t, store.EventCommandQueued, typ)
	require.Equal(t, "cmd_k", subject)
	require.Equal(t, "n-gw-a", data["nodeId"])
	require.True(t, now.Equal(created), "time %s", created)
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM outbox WHERE subject LIKE 'bc.events.%'`), "events have no outbox rows")
}

// TestQueueCommandsAudit queues in a transaction of its own (AutoCommit)
// with audit rows: a queued command and a request id answered with the
// command of the same kind get theirs; a refusal and a request id used for
// another kind get none (the caller refuses that one).
func TestQueueCommandsAudit(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	ctx := t.Context()
	_, err := queue(t, db, nil, now, store.NewCommand{Scope: store.AllTenants, ID: "cmd_0", NodeID: "n-ok", Kind: store.CommandDiagNVML,
		Deadline: now.Add(time.Minute), RequestID: "old"})
	require.NoError(t, err)
	audit := func() *store.AuditEntry {
		return &store.AuditEntry{TenantID: "ten_1", TokenID: "tok_1", Role: "tenant-admin", Procedure: "/run"}
	}
	cmd := func(id, node, kind, req string) store.NewCommand {
		return store.NewCommand{Scope: store.AllTenants, ID: id, NodeID: node, Kind: kind, Deadline: now.Add(time.Minute),
			RequestID: req, CreatedBy: "tok_1", Audit: audit()}
	}
	res, err := store.QueueCommands(ctx, db.AutoCommit(), nil, now, []store.NewCommand{
		cmd("cmd_a", "n-ok", store.CommandLogsCollect, ""),
		cmd("cmd_b", "n-ok", store.CommandDiagNVML, "old"),
		cmd("cmd_c", "n-ok", store.CommandNodeReboot, "old"),
		cmd("cmd_d", "n-rev", store.CommandDiagNVML, ""),
	})
	require.NoError(t, err)
	require.NoError(t, res[0].Err)
	require.True(t, res[1].Existing)
	require.Equal(t, "cmd_0", res[1].ID)
	require.True(t, res[2].Existing)
	require.Equal(t, store.CommandDiagNVML, res[2].Kind)
	require.ErrorIs(t, res[3].Err, store.ErrNodeNotRunnable)

	rows, err := db.Pool.Query(ctx, `SELECT target || ' ' || detail || ' ' || tenant_id || ' ' || token_id || ' ' || procedure
		|| ' ' || outcome FROM audit ORDER BY id`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{
		"cmd_a queued logs.collect on n-ok ten_1 tok_1 /run ok",
		"cmd_0 request_id old: cmd_0 already queued ten_1 tok_1 /run ok",
	}, got)
	// Committed: visible to another connection, with its event.
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM commands WHERE id = 'cmd_a'`))
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM events WHERE subject_id = 'cmd_a'`))
}

// TestQueueCommandsDuplicatesInOneBatch: two calls of one batch with the
// same node and request id are one call only when they come from the same
// scope: another tenant's call is refused as NotFound (it neither receives
// the owner's command nor makes the owner's call fail), and each call of the
// same scope that the batch answers writes its own audit row.
func TestQueueCommandsDuplicatesInOneBatch(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	ctx := t.Context()
	cmd := func(id, tenant, token string) store.NewCommand {
		return store.NewCommand{Scope: store.TenantScope(tenant), ID: id, NodeID: "n-ok", Kind: store.CommandDiagNVML,
			Deadline: now.Add(time.Minute), RequestID: "same", CreatedBy: token,
			Audit: &store.AuditEntry{TenantID: tenant, TokenID: token, Role: "tenant-admin", Procedure: "/run"}}
	}
	for _, order := range [][]string{{"owner", "foreign", "owner2"}, {"foreign", "owner", "owner2"}} {
		t.Run(order[0]+" first", func(t *testing.T) {
			_, err := db.Pool.Exec(ctx, `DELETE FROM commands; DELETE FROM audit`)
			require.NoError(t, err)
			byName := map[string]store.NewCommand{
				"owner":   cmd("cmd_o_"+order[0], "ten_1", "tok_1"),
				"owner2":  cmd("cmd_o2_"+order[0], "ten_1", "tok_2"),
				"foreign": cmd("cmd_f_"+order[0], "ten_2", "tok_9"),
			}
			batch := make([]store.NewCommand, len(order))
			for i, name := range order {
				batch[i] = byName[name]
			}
			res, err := store.QueueCommands(ctx, db.AutoCommit(), nil, now, batch)
			require.NoError(t, err)
			got := map[string]store.QueueResult{}
			for i, name := range order {
				got[name] = res[i]
			}
			require.NoError(t, got["owner"].Err)
			require.Equal(t, byName["owner"].ID, got["owner"].ID, "the owner's call queued its command")
			require.ErrorIs(t, got["foreign"].Err, store.ErrNotFound, "another tenant's node reads as missing")
			require.Empty(t, got["foreign"].ID)
			require.NoError(t, got["owner2"].Err)
			require.True(t, got["owner2"].Existing)
			require.Equal(t, byName["owner"].ID, got["owner2"].ID, "the same tenant's repeat gets the same command")

			rows, err := db.Pool.Query(ctx, `SELECT token_id || ' ' || target || ' ' || outcome FROM audit ORDER BY id`)
			require.NoError(t, err)
			audit, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			require.ElementsMatch(t, []string{"tok_1 " + byName["owner"].ID + " ok", "tok_2 " + byName["owner"].ID + " ok"}, audit,
				"one row per call answered (the refused call's is the interceptor's)")
			require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM commands`))
		})
	}
}

// TestQueueCommandsKeepTraceparent: a command keeps the trace context of
// the call that queued it, and so does its gateway poke's outbox row, which
// TakeOutbox returns with it and the gateway's claim hands on
// (docs/architecture.md, "Traces"); a command queued without one has none.
func TestQueueCommandsKeepTraceparent(t *testing.T) {
	t.Parallel()
	db, now := commandsDB(t)
	ctx := t.Context()
	storetest.Node(t, db, &storetest.NodeOpts{ID: "n-gw", PoolID: "pool_1", State: store.NodeAdopted, GatewayID: "gw-a",
		SessionID: "ses_1"})
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	res, err := store.QueueCommands(ctx, db.AutoCommit(), nil, now, []store.NewCommand{
		{Scope: store.AllTenants, ID: "cmd_t", NodeID: "n-gw", Kind: store.CommandDiagNVML, Deadline: now.Add(time.Minute),
			Traceparent: tp},
		{Scope: store.AllTenants, ID: "cmd_u", NodeID: "n-ok", Kind: store.CommandDiagNVML, Deadline: now.Add(time.Minute)},
	})
	require.NoError(t, err)
	require.NoError(t, res[0].Err)
	require.NoError(t, res[1].Err)

	rows, err := db.Pool.Query(ctx, `SELECT id || ' ' || traceparent FROM commands ORDER BY id`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"cmd_t " + tp, "cmd_u "}, got)

	var pokes []store.OutboxMessage
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		msgs, err := store.TakeOutbox(ctx, tx, 0, 100)
		for _, m := range msgs {
			if strings.HasPrefix(m.Subject, store.SubjectPokeGatewayPrefix) {
				pokes = append(pokes, m)
			}
		}
		return err
	}))
	require.Len(t, pokes, 1)
	require.Equal(t, "bc.poke.gw.gw-a", pokes[0].Subject)
	require.Equal(t, tp, pokes[0].Traceparent)

	d, err := store.ClaimSessionDeliveries(ctx, db.Pool, now, []store.ClaimRequest{{NodeID: "n-gw", SessionID: "ses_1"}})
	require.NoError(t, err)
	require.Len(t, d[0].Commands, 1)
	require.Equal(t, tp, d[0].Commands[0].Traceparent)
}
