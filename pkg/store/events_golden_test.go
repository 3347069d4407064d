package store_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// writtenEvent is an events row as text: data is events.data as the watch
// sends it (data::text); message is its hint's subject
// (bc.events.<tenant>.<type>) and the event as the watch sends it, the
// JSON object {"id", "tenantId", "type", "subjectId", "data", "time"} of
// the row.
type writtenEvent struct {
	tenant, typ, subject, data string
	message                    string
}

// writtenEvents returns the events after id after, in id order.
func writtenEvents(t *testing.T, q store.DBTX, after int64) []writtenEvent {
	t.Helper()
	rows, err := q.Query(t.Context(), `SELECT COALESCE(e.tenant_id, ''), e.type, e.subject_id, e.data::text,
			'bc.events.' || COALESCE(e.tenant_id, '') || '.' || e.type || ' ' || jsonb_build_object('id', e.id,
				'tenantId', COALESCE(e.tenant_id, ''), 'type', e.type, 'subjectId', e.subject_id, 'data', e.data,
				'time', to_char(e.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))::text
		FROM events e WHERE e.id > $1 ORDER BY e.id`, after)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (writtenEvent, error) {
		var e writtenEvent
		err := r.Scan(&e.tenant, &e.typ, &e.subject, &e.data, &e.message)
		return e, err
	})
	require.NoError(t, err)
	return out
}

// TestEventsAsWatchersReceiveThem drives every store function that writes
// an event, for every event type and every shape of its data, and pins
// what it wrote: the events row's data and the event as the watch sends
// them, and the hints published after the commit (one per tenant and type,
// with no payload), and that no event has an outbox row. A change of an
// event's JSON shows here, so that it is deliberate.
func TestEventsAsWatchersReceiveThem(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2030, 5, 6, 7, 8, 9, 123456000, time.UTC)
	clk := clock.NewFake(t0)
	db := storetest.New(t, clk)
	ctx := t.Context()
	var (
		mu    sync.Mutex
		hints []string
	)
	db.PokeVia(func(subject string, payload []byte, _ int64) error {
		if strings.HasPrefix(subject, store.SubjectEvents+".") {
			mu.Lock()
			defer mu.Unlock()
			if len(payload) != 0 {
				return fmt.Errorf("hint %s has a payload: %q", subject, payload)
			}
			hints = append(hints, subject)
		}
		return nil
	})
	var last int64
	// step runs fn in a transaction at the clock's time plus d and checks
	// the events it wrote and the hints its commit published.
	step := func(name string, d time.Duration, fn func(ctx context.Context, tx pgx.Tx, now time.Time) error, want ...writtenEvent) {
		t.Helper()
		clk.Advance(d)
		require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error { return fn(ctx, tx, db.Now()) }), name)
		got := writtenEvents(t, db.Pool, last)
		if len(want) == 0 {
			require.Empty(t, got, name)
		} else {
			require.Equal(t, want, got, name)
		}
		var wantHints []string
		for _, w := range want {
			if h, _, _ := strings.Cut(w.message, " "); !slices.Contains(wantHints, h) {
				wantHints = append(wantHints, h)
			}
		}
		mu.Lock()
		published := hints
		hints = nil
		mu.Unlock()
		require.ElementsMatch(t, wantHints, published, "%s: the hints, each once", name)
		if len(got) > 0 {
			require.NoError(t, db.Pool.QueryRow(ctx, `SELECT max(id) FROM events`).Scan(&last))
		}
		var outboxed int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE subject LIKE 'bc.events.%'`).Scan(&outboxed))
		require.Zero(t, outboxed, "%s: events have no outbox rows", name)
	}

	step("fixtures", 0, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		for _, ten := range []string{"ten_owner", "ten_user"} {
			if err := store.CreateTenant(ctx, tx, store.Tenant{ID: ten, Name: ten, CreatedAt: now}); err != nil {
				return err
			}
		}
		if err := store.CreateSite(ctx, tx, store.Site{ID: "site_1", Name: "site", Region: "r", CreatedAt: now}); err != nil {
			return err
		}
		if err := store.CreatePool(ctx, tx, store.Pool{ID: "pool_1", SiteID: "site_1", OwnerTenantID: "ten_owner", Name: "p",
			Kind: "metal-host", CreatedAt: now}); err != nil {
			return err
		}
		_, err := store.UpsertOffer(ctx, tx, store.AllTenants, store.Offer{PoolID: "pool_1", TenantID: "ten_user", GPUQuota: 100, CreatedAt: now, UpdatedAt: now})
		if err != nil {
			return err
		}
		for _, n := range []string{"node_a", "node_b", "node_c"} {
			if err := store.CreateNode(ctx, tx, store.NewNode{ID: n, PoolID: "pool_1", Hostname: n, CreatedAt: now}); err != nil {
				return err
			}
		}
		return nil
	})

	step("node.joined", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		return store.RecordNodesJoined(ctx, tx, now, []string{"node_b", "node_a", "node_c"})
	},
		writtenEvent{"ten_owner", "node.joined", "node_a", `{"nodeId": "node_a"}`,
			`bc.events.ten_owner.node.joined {"id": 1, "data": {"nodeId": "node_a"}, "time": "2030-05-06T07:08:10.123456Z", "type": "node.joined", "tenantId": "ten_owner", "subjectId": "node_a"}`},
		writtenEvent{"ten_owner", "node.joined", "node_b", `{"nodeId": "node_b"}`,
			`bc.events.ten_owner.node.joined {"id": 2, "data": {"nodeId": "node_b"}, "time": "2030-05-06T07:08:10.123456Z", "type": "node.joined", "tenantId": "ten_owner", "subjectId": "node_b"}`},
		writtenEvent{"ten_owner", "node.joined", "node_c", `{"nodeId": "node_c"}`,
			`bc.events.ten_owner.node.joined {"id": 3, "data": {"nodeId": "node_c"}, "time": "2030-05-06T07:08:10.123456Z", "type": "node.joined", "tenantId": "ten_owner", "subjectId": "node_c"}`},
	)
	step("node.adopted, node.acceptance_failed", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		if _, err := store.MarkNodesAccepting(ctx, tx, now, []string{"node_a", "node_b", "node_c"}); err != nil {
			return err
		}
		devices := []store.NodeDevice{{Index: 0, UUID: "GPU-0", Model: "H100", Healthy: true},
			{Index: 1, UUID: "GPU-1", Model: "H100", Healthy: true}}
		if _, err := store.AdoptNodes(ctx, tx, nil, now, []store.Adoption{
			{NodeID: "node_c", PoolID: "pool_1", OwnerTenantID: "ten_owner", Spec: []byte(`{}`), Inventory: []byte(`{}`), Devices: devices},
			{NodeID: "node_a", PoolID: "pool_1", OwnerTenantID: "ten_owner", Spec: []byte(`{}`), Inventory: []byte(`{}`), Devices: devices},
		}); err != nil {
			return err
		}
		_, err := store.FailAcceptance(ctx, tx, now, []store.AcceptanceFailure{
			{NodeID: "node_b", PoolID: "pool_1", OwnerTenantID: "ten_owner", Reason: "expected 8 GPUs, found 2"}})
		return err
	},
		writtenEvent{"ten_owner", "node.adopted", "node_c", `{"gpus": 2, "nodeId": "node_c", "poolId": "pool_1"}`,
			`bc.events.ten_owner.node.adopted {"id": 4, "data": {"gpus": 2, "nodeId": "node_c", "poolId": "pool_1"}, "time": "2030-05-06T07:08:11.123456Z", "type": "node.adopted", "tenantId": "ten_owner", "subjectId": "node_c"}`},
		writtenEvent{"ten_owner", "node.adopted", "node_a", `{"gpus": 2, "nodeId": "node_a", "poolId": "pool_1"}`,
			`bc.events.ten_owner.node.adopted {"id": 5, "data": {"gpus": 2, "nodeId": "node_a", "poolId": "pool_1"}, "time": "2030-05-06T07:08:11.123456Z", "type": "node.adopted", "tenantId": "ten_owner", "subjectId": "node_a"}`},
		writtenEvent{"ten_owner", "node.acceptance_failed", "node_b", `{"nodeId": "node_b", "poolId": "pool_1", "reason": "expected 8 GPUs, found 2"}`,
			`bc.events.ten_owner.node.acceptance_failed {"id": 6, "data": {"nodeId": "node_b", "poolId": "pool_1", "reason": "expected 8 GPUs, found 2"}, "time": "2030-05-06T07:08:11.123456Z", "type": "node.acceptance_failed", "tenantId": "ten_owner", "subjectId": "node_b"}`},
	)
	// The gateway opens sessions with OpenSessions, a batch at a time (the
	// next step but one opens one with OpenSessions).
	openSessions := func(ctx context.Context, tx pgx.Tx, now time.Time, gw string, sessions map[string]string) error {
		var reqs []store.OpenSessionRequest
		for _, n := range slices.Sorted(maps.Keys(sessions)) {
			serial := fmt.Sprintf("%x", sha256.Sum256([]byte(sessions[n])))[:16]
			if err := store.CreateNodeCert(ctx, tx, store.NewNodeCert{Serial: serial, NodeID: n, PublicKeySHA256: []byte(serial),
				NotBefore: now, NotAfter: now.Add(time.Hour), CreatedAt: now}); err != nil {
				return err
			}
			reqs = append(reqs, store.OpenSessionRequest{Serial: serial, OpenSessionParams: store.OpenSessionParams{NodeID: n,
				GatewayID: gw, SessionID: sessions[n], BootID: "boot", Now: now}})
		}
		res, err := store.OpenSessions(ctx, tx, reqs)
		if err != nil {
			return err
		}
		for i, r := range res {
			if !r.Opened {
				return fmt.Errorf("session of %s not opened", reqs[i].NodeID)
			}
		}
		// The certificates were for this step only: the revocations below
		// count the nodes' certificates.
		_, err = tx.Exec(ctx, `DELETE FROM node_certs WHERE node_id = ANY($1) AND created_at = $2`,
			slices.Collect(maps.Keys(sessions)), now)
		return err
	}
	step("node.reachable by a new session", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		return openSessions(ctx, tx, now, "gw-1", map[string]string{"node_a": "ses_node_a", "node_c": "ses_node_c"})
	},
		writtenEvent{"ten_owner", "node.reachable", "node_a", `{"nodeId": "node_a", "gatewayId": "gw-1", "sessionId": "ses_node_a"}`,
			`bc.events.ten_owner.node.reachable {"id": 7, "data": {"nodeId": "node_a", "gatewayId": "gw-1", "sessionId": "ses_node_a"}, "time": "2030-05-06T07:08:12.123456Z", "type": "node.reachable", "tenantId": "ten_owner", "subjectId": "node_a"}`},
		writtenEvent{"ten_owner", "node.reachable", "node_c", `{"nodeId": "node_c", "gatewayId": "gw-1", "sessionId": "ses_node_c"}`,
			`bc.events.ten_owner.node.reachable {"id": 8, "data": {"nodeId": "node_c", "gatewayId": "gw-1", "sessionId": "ses_node_c"}, "time": "2030-05-06T07:08:12.123456Z", "type": "node.reachable", "tenantId": "ten_owner", "subjectId": "node_c"}`},
	)
	step("node.unreachable", time.Minute, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := store.SweepUnreachable(ctx, tx, now, 30*time.Second, 10)
		return err
	},
		writtenEvent{"ten_owner", "node.unreachable", "node_a", `{"nodeId": "node_a", "timeoutSeconds": 30}`,
			`bc.events.ten_owner.node.unreachable {"id": 9, "data": {"nodeId": "node_a", "timeoutSeconds": 30}, "time": "2030-05-06T07:09:12.123456Z", "type": "node.unreachable", "tenantId": "ten_owner", "subjectId": "node_a"}`},
		writtenEvent{"ten_owner", "node.unreachable", "node_c", `{"nodeId": "node_c", "timeoutSeconds": 30}`,
			`bc.events.ten_owner.node.unreachable {"id": 10, "data": {"nodeId": "node_c", "timeoutSeconds": 30}, "time": "2030-05-06T07:09:12.123456Z", "type": "node.unreachable", "tenantId": "ten_owner", "subjectId": "node_c"}`},
	)
	step("node.reachable by a message", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := store.RecordSessionLastSeen(ctx, tx, []store.SessionLastSeen{{NodeID: "node_a", SessionID: "ses_node_a", At: now}})
		return err
	},
		writtenEvent{"ten_owner", "node.reachable", "node_a", `{"nodeId": "node_a", "sessionId": "ses_node_a"}`,
			`bc.events.ten_owner.node.reachable {"id": 11, "data": {"nodeId": "node_a", "sessionId": "ses_node_a"}, "time": "2030-05-06T07:09:13.123456Z", "type": "node.reachable", "tenantId": "ten_owner", "subjectId": "node_a"}`},
	)
	step("node.reachable by a new session, heard before", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := storetest.OpenSession(t, tx, store.OpenSessionParams{NodeID: "node_c", GatewayID: "gw-2", SessionID: "ses_c2",
			BootID: "boot", Now: now})
		return err
	},
		writtenEvent{"ten_owner", "node.reachable", "node_c", `{"nodeId": "node_c", "gatewayId": "gw-2", "sessionId": "ses_c2", "previousLastSeen": "2030-05-06T07:08:12.123456Z"}`,
			`bc.events.ten_owner.node.reachable {"id": 12, "data": {"nodeId": "node_c", "gatewayId": "gw-2", "sessionId": "ses_c2", "previousLastSeen": "2030-05-06T07:08:12.123456Z"}, "time": "2030-05-06T07:09:14.123456Z", "type": "node.reachable", "tenantId": "ten_owner", "subjectId": "node_c"}`},
	)
	step("node.cordoned, node.uncordoned", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		if _, err := store.CordonNode(ctx, tx, store.AllTenants, now, "node_a", "maintenance"); err != nil {
			return err
		}
		_, err := store.UncordonNode(ctx, tx, store.AllTenants, now, "node_a")
		return err
	},
		writtenEvent{"ten_owner", "node.cordoned", "node_a", `{"nodeId": "node_a", "reason": "maintenance"}`,
			`bc.events.ten_owner.node.cordoned {"id": 13, "data": {"nodeId": "node_a", "reason": "maintenance"}, "time": "2030-05-06T07:09:15.123456Z", "type": "node.cordoned", "tenantId": "ten_owner", "subjectId": "node_a"}`},
		writtenEvent{"ten_owner", "node.uncordoned", "node_a", `{"nodeId": "node_a", "previousReason": "maintenance"}`,
			`bc.events.ten_owner.node.uncordoned {"id": 14, "data": {"nodeId": "node_a", "previousReason": "maintenance"}, "time": "2030-05-06T07:09:15.123456Z", "type": "node.uncordoned", "tenantId": "ten_owner", "subjectId": "node_a"}`},
	)
	step("node.spec_refused", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		return store.RecordSpecRefused(ctx, tx, now, "node_a", 3, "unsigned")
	},
		writtenEvent{"ten_owner", "node.spec_refused", "node_a", `{"nodeId": "node_a", "reason": "unsigned", "generation": 3}`,
			`bc.events.ten_owner.node.spec_refused {"id": 15, "data": {"nodeId": "node_a", "reason": "unsigned", "generation": 3}, "time": "2030-05-06T07:09:16.123456Z", "type": "node.spec_refused", "tenantId": "ten_owner", "subjectId": "node_a"}`},
	)
	step("command.queued", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		var cmds []store.NewCommand
		for i, c := range []struct {
			node     string
			deadline time.Duration
		}{{"node_a", time.Minute}, {"node_a", time.Minute}, {"node_a", time.Minute}, {"node_a", time.Minute}, {"node_c", time.Hour}} {
			cmds = append(cmds, store.NewCommand{Scope: store.AllTenants, ID: fmt.Sprintf("cmd_%d", i+1), NodeID: c.node, Kind: store.CommandLogsCollect,
				Deadline: now.Add(c.deadline).Add(789 * time.Nanosecond), CreatedBy: "tok_1"})
		}
		_, err := store.QueueCommands(ctx, tx, nil, now, cmds)
		return err
	},
		writtenEvent{"ten_owner", "command.queued", "cmd_1", `{"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_1"}`,
			`bc.events.ten_owner.command.queued {"id": 16, "data": {"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_1"}, "time": "2030-05-06T07:09:17.123456Z", "type": "command.queued", "tenantId": "ten_owner", "subjectId": "cmd_1"}`},
		writtenEvent{"ten_owner", "command.queued", "cmd_2", `{"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_2"}`,
			`bc.events.ten_owner.command.queued {"id": 17, "data": {"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_2"}, "time": "2030-05-06T07:09:17.123456Z", "type": "command.queued", "tenantId": "ten_owner", "subjectId": "cmd_2"}`},
		writtenEvent{"ten_owner", "command.queued", "cmd_3", `{"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_3"}`,
			`bc.events.ten_owner.command.queued {"id": 18, "data": {"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_3"}, "time": "2030-05-06T07:09:17.123456Z", "type": "command.queued", "tenantId": "ten_owner", "subjectId": "cmd_3"}`},
		writtenEvent{"ten_owner", "command.queued", "cmd_4", `{"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_4"}`,
			`bc.events.ten_owner.command.queued {"id": 19, "data": {"kind": "logs.collect", "nodeId": "node_a", "deadline": "2030-05-06T07:10:17.123456Z", "commandId": "cmd_4"}, "time": "2030-05-06T07:09:17.123456Z", "type": "command.queued", "tenantId": "ten_owner", "subjectId": "cmd_4"}`},
		writtenEvent{"ten_owner", "command.queued", "cmd_5", `{"kind": "logs.collect", "nodeId": "node_c", "deadline": "2030-05-06T08:09:17.123456Z", "commandId": "cmd_5"}`,
			`bc.events.ten_owner.command.queued {"id": 20, "data": {"kind": "logs.collect", "nodeId": "node_c", "deadline": "2030-05-06T08:09:17.123456Z", "commandId": "cmd_5"}, "time": "2030-05-06T07:09:17.123456Z", "type": "command.queued", "tenantId": "ten_owner", "subjectId": "cmd_5"}`},
	)
	step("command.succeeded, command.failed", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := store.ApplySessionCommandUpdates(ctx, tx, []store.SessionCommandUpdate{
			{NodeID: "node_a", CommandID: "cmd_1", State: "succeeded", Result: []byte(`{"ok": true}`), Now: now},
			{NodeID: "node_a", CommandID: "cmd_2", State: "failed", Error: "boom", Now: now.Add(time.Millisecond)},
		})
		return err
	},
		writtenEvent{"ten_owner", "command.succeeded", "cmd_1", `{"kind": "logs.collect", "state": "succeeded", "nodeId": "node_a", "commandId": "cmd_1"}`,
			`bc.events.ten_owner.command.succeeded {"id": 21, "data": {"kind": "logs.collect", "state": "succeeded", "nodeId": "node_a", "commandId": "cmd_1"}, "time": "2030-05-06T07:09:18.123456Z", "type": "command.succeeded", "tenantId": "ten_owner", "subjectId": "cmd_1"}`},
		writtenEvent{"ten_owner", "command.failed", "cmd_2", `{"kind": "logs.collect", "error": "boom", "state": "failed", "nodeId": "node_a", "commandId": "cmd_2"}`,
			`bc.events.ten_owner.command.failed {"id": 22, "data": {"kind": "logs.collect", "error": "boom", "state": "failed", "nodeId": "node_a", "commandId": "cmd_2"}, "time": "2030-05-06T07:09:18.124456Z", "type": "command.failed", "tenantId": "ten_owner", "subjectId": "cmd_2"}`},
	)
	step("command.expired by a late update", time.Minute, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := store.ApplySessionCommandUpdates(ctx, tx, []store.SessionCommandUpdate{
			{NodeID: "node_a", CommandID: "cmd_3", State: "succeeded", Now: now}})
		return err
	},
		writtenEvent{"ten_owner", "command.expired", "cmd_3", `{"kind": "logs.collect", "error": "deadline passed", "state": "expired", "nodeId": "node_a", "commandId": "cmd_3"}`,
			`bc.events.ten_owner.command.expired {"id": 23, "data": {"kind": "logs.collect", "error": "deadline passed", "state": "expired", "nodeId": "node_a", "commandId": "cmd_3"}, "time": "2030-05-06T07:10:18.123456Z", "type": "command.expired", "tenantId": "ten_owner", "subjectId": "cmd_3"}`},
	)
	step("command.expired by the reconciler", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := store.ExpireDueCommands(ctx, tx, now, 10)
		return err
	},
		writtenEvent{"ten_owner", "command.expired", "cmd_4", `{"kind": "logs.collect", "error": "deadline passed", "state": "expired", "nodeId": "node_a", "commandId": "cmd_4"}`,
			`bc.events.ten_owner.command.expired {"id": 24, "data": {"kind": "logs.collect", "error": "deadline passed", "state": "expired", "nodeId": "node_a", "commandId": "cmd_4"}, "time": "2030-05-06T07:10:19.123456Z", "type": "command.expired", "tenantId": "ten_owner", "subjectId": "cmd_4"}`},
	)
	reserve := func(ctx context.Context, tx pgx.Tx, now time.Time, id string, gpus int32) error {
		_, err := store.CreateReservation(ctx, tx, now, store.NewReservation{ID: id, TenantID: "ten_user", PoolID: "pool_1",
			GPUs: gpus, StartAt: now, EndAt: now.Add(time.Hour), CreatedBy: "tok_1"})
		return err
	}
	step("reservation.created, reservation.failed at once", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		for i, gpus := range []int32{2, 8, 1, 1, 1, 1} {
			if err := reserve(ctx, tx, now, fmt.Sprintf("res_%d", i+1), gpus); err != nil {
				return err
			}
		}
		return nil
	},
		writtenEvent{"ten_user", "reservation.created", "res_1", `{"gpus": 2, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_1"}`,
			`bc.events.ten_user.reservation.created {"id": 25, "data": {"gpus": 2, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_1"}, "time": "2030-05-06T07:10:20.123456Z", "type": "reservation.created", "tenantId": "ten_user", "subjectId": "res_1"}`},
		writtenEvent{"ten_user", "reservation.created", "res_2", `{"gpus": 8, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_2"}`,
			`bc.events.ten_user.reservation.created {"id": 26, "data": {"gpus": 8, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_2"}, "time": "2030-05-06T07:10:20.123456Z", "type": "reservation.created", "tenantId": "ten_user", "subjectId": "res_2"}`},
		writtenEvent{"ten_user", "reservation.failed", "res_2", `{"reason": "no node of pool pool_1 has 8 GPUs (largest: 2)", "reservationId": "res_2"}`,
			`bc.events.ten_user.reservation.failed {"id": 27, "data": {"reason": "no node of pool pool_1 has 8 GPUs (largest: 2)", "reservationId": "res_2"}, "time": "2030-05-06T07:10:20.123456Z", "type": "reservation.failed", "tenantId": "ten_user", "subjectId": "res_2"}`},
		writtenEvent{"ten_user", "reservation.created", "res_3", `{"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_3"}`,
			`bc.events.ten_user.reservation.created {"id": 28, "data": {"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_3"}, "time": "2030-05-06T07:10:20.123456Z", "type": "reservation.created", "tenantId": "ten_user", "subjectId": "res_3"}`},
		writtenEvent{"ten_user", "reservation.created", "res_4", `{"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_4"}`,
			`bc.events.ten_user.reservation.created {"id": 29, "data": {"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_4"}, "time": "2030-05-06T07:10:20.123456Z", "type": "reservation.created", "tenantId": "ten_user", "subjectId": "res_4"}`},
		writtenEvent{"ten_user", "reservation.created", "res_5", `{"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_5"}`,
			`bc.events.ten_user.reservation.created {"id": 30, "data": {"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_5"}, "time": "2030-05-06T07:10:20.123456Z", "type": "reservation.created", "tenantId": "ten_user", "subjectId": "res_5"}`},
		writtenEvent{"ten_user", "reservation.created", "res_6", `{"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_6"}`,
			`bc.events.ten_user.reservation.created {"id": 31, "data": {"gpus": 1, "endAt": "2030-05-06T08:10:20.123456Z", "poolId": "pool_1", "startAt": "2030-05-06T07:10:20.123456Z", "reservationId": "res_6"}, "time": "2030-05-06T07:10:20.123456Z", "type": "reservation.created", "tenantId": "ten_user", "subjectId": "res_6"}`},
	)
	step("reservation.bound", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := store.PlaceReservations(ctx, tx, nil, now, []store.Placement{
			{ReservationID: "res_1", TenantID: "ten_user", NodeID: "node_a", Devices: []int32{0, 1}, Lower: now, Upper: now.Add(time.Hour)},
			{ReservationID: "res_6", TenantID: "ten_user", NodeID: "node_c", Devices: []int32{1}, Lower: now, Upper: now.Add(time.Hour)},
		})
		return err
	},
		writtenEvent{"ten_user", "reservation.bound", "res_1", `{"nodeId": "node_a", "deviceIndexes": [0, 1], "reservationId": "res_1"}`,
			`bc.events.ten_user.reservation.bound {"id": 32, "data": {"nodeId": "node_a", "deviceIndexes": [0, 1], "reservationId": "res_1"}, "time": "2030-05-06T07:10:21.123456Z", "type": "reservation.bound", "tenantId": "ten_user", "subjectId": "res_1"}`},
		writtenEvent{"ten_user", "reservation.bound", "res_6", `{"nodeId": "node_c", "deviceIndexes": [1], "reservationId": "res_6"}`,
			`bc.events.ten_user.reservation.bound {"id": 33, "data": {"nodeId": "node_c", "deviceIndexes": [1], "reservationId": "res_6"}, "time": "2030-05-06T07:10:21.123456Z", "type": "reservation.bound", "tenantId": "ten_user", "subjectId": "res_6"}`},
	)
	step("reservation.active", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		_, err := store.ActivateReservation(ctx, tx, now, "node_a", "res_1", []string{"nvidia.com/gpu=0", "nvidia.com/gpu=1"}, 2)
		return err
	},
		writtenEvent{"ten_user", "reservation.active", "res_1", `{"nodeId": "node_a", "binding": ["nvidia.com/gpu=0", "nvidia.com/gpu=1"], "generation": 2, "reservationId": "res_1"}`,
			`bc.events.ten_user.reservation.active {"id": 34, "data": {"nodeId": "node_a", "binding": ["nvidia.com/gpu=0", "nvidia.com/gpu=1"], "generation": 2, "reservationId": "res_1"}, "time": "2030-05-06T07:10:22.123456Z", "type": "reservation.active", "tenantId": "ten_user", "subjectId": "res_1"}`},
	)
	step("reservation.released, reservation.expired", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		if _, err := store.EndReservation(ctx, tx, nil, store.AllTenants, now, "res_1", store.ReservationReleased); err != nil {
			return err
		}
		_, err := store.EndReservation(ctx, tx, nil, store.AllTenants, now, "res_3", store.ReservationExpired)
		return err
	},
		writtenEvent{"ten_user", "reservation.released", "res_1", `{"from": "active", "nodeId": "node_a", "reservationId": "res_1"}`,
			`bc.events.ten_user.reservation.released {"id": 35, "data": {"from": "active", "nodeId": "node_a", "reservationId": "res_1"}, "time": "2030-05-06T07:10:23.123456Z", "type": "reservation.released", "tenantId": "ten_user", "subjectId": "res_1"}`},
		writtenEvent{"ten_user", "reservation.expired", "res_3", `{"from": "pending", "nodeId": "", "reservationId": "res_3"}`,
			`bc.events.ten_user.reservation.expired {"id": 36, "data": {"from": "pending", "nodeId": "", "reservationId": "res_3"}, "time": "2030-05-06T07:10:23.123456Z", "type": "reservation.expired", "tenantId": "ten_user", "subjectId": "res_3"}`},
	)
	step("reservation.failed by the scheduler", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		if _, err := store.FailReservations(ctx, tx, now, []store.ReservationFailure{
			{ID: "res_4", TenantID: "ten_user", Reason: "no node has 1 free GPU"}}); err != nil {
			return err
		}
		_, err := store.FailNeverPlaced(ctx, tx, now, []string{"res_5"})
		return err
	},
		writtenEvent{"ten_user", "reservation.failed", "res_4", `{"reason": "no node has 1 free GPU", "reservationId": "res_4"}`,
			`bc.events.ten_user.reservation.failed {"id": 37, "data": {"reason": "no node has 1 free GPU", "reservationId": "res_4"}, "time": "2030-05-06T07:10:24.123456Z", "type": "reservation.failed", "tenantId": "ten_user", "subjectId": "res_4"}`},
		writtenEvent{"ten_user", "reservation.failed", "res_5", `{"reason": "never placed: no node had 1 free GPUs before its end time", "reservationId": "res_5"}`,
			`bc.events.ten_user.reservation.failed {"id": 38, "data": {"reason": "never placed: no node had 1 free GPUs before its end time", "reservationId": "res_5"}, "time": "2030-05-06T07:10:24.123456Z", "type": "reservation.failed", "tenantId": "ten_user", "subjectId": "res_5"}`},
	)
	step("node.revoked, command.failed, reservation.failed by the revocation", time.Second,
		// node_c holds the certificate its session opened with (the
		// step "node.reachable by a new session"): the revocation revokes it.
		func(ctx context.Context, tx pgx.Tx, now time.Time) error {
			if _, err := store.RevokeNode(ctx, tx, store.AllTenants, now, "node_c", "stolen"); err != nil {
				return err
			}
			_, err := store.FailNodeReservations(ctx, tx, nil, now, "node_c", "node revoked: stolen")
			return err
		},
		writtenEvent{"ten_owner", "command.failed", "cmd_5", `{"kind": "logs.collect", "error": "node revoked before the command finished", "state": "failed", "nodeId": "node_c", "commandId": "cmd_5"}`,
			`bc.events.ten_owner.command.failed {"id": 39, "data": {"kind": "logs.collect", "error": "node revoked before the command finished", "state": "failed", "nodeId": "node_c", "commandId": "cmd_5"}, "time": "2030-05-06T07:10:25.123456Z", "type": "command.failed", "tenantId": "ten_owner", "subjectId": "cmd_5"}`},
		writtenEvent{"ten_owner", "node.revoked", "node_c", `{"nodeId": "node_c", "reason": "stolen", "certificatesRevoked": 1}`,
			`bc.events.ten_owner.node.revoked {"id": 40, "data": {"nodeId": "node_c", "reason": "stolen", "certificatesRevoked": 1}, "time": "2030-05-06T07:10:25.123456Z", "type": "node.revoked", "tenantId": "ten_owner", "subjectId": "node_c"}`},
		writtenEvent{"ten_user", "reservation.failed", "res_6", `{"nodeId": "node_c", "reason": "node revoked: stolen", "reservationId": "res_6"}`,
			`bc.events.ten_user.reservation.failed {"id": 41, "data": {"nodeId": "node_c", "reason": "node revoked: stolen", "reservationId": "res_6"}, "time": "2030-05-06T07:10:25.123456Z", "type": "reservation.failed", "tenantId": "ten_user", "subjectId": "res_6"}`},
	)
	step("node.ssh_refused", time.Second, func(ctx context.Context, tx pgx.Tx, now time.Time) error {
		return store.RecordSSHRefused(ctx, tx, now, store.SSHRefusal{NodeID: "node_a", Reason: "expired", KeyID: "tok_1 on node_a",
			User: "root"})
	},
		writtenEvent{"ten_owner", "node.ssh_refused", "node_a", `{"user": "root", "keyId": "tok_1 on node_a", "nodeId": "node_a", "reason": "expired"}`,
			`bc.events.ten_owner.node.ssh_refused {"id": 42, "data": {"user": "root", "keyId": "tok_1 on node_a", "nodeId": "node_a", "reason": "expired"}, "time": "2030-05-06T07:10:26.123456Z", "type": "node.ssh_refused", "tenantId": "ten_owner", "subjectId": "node_a"}`},
	)
	var types []string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT array_agg(DISTINCT type ORDER BY type) FROM events`).Scan(&types))
	require.Equal(t, store.EventTypes, types, "every event type is pinned")
}

// TestEventDataKeys pins, for every event type, the data type that builds
// its data and the keys of its JSON object; a type whose data omits a key
// when it is empty has a row without it and one with it.
func TestEventDataKeys(t *testing.T) {
	t.Parallel()
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	pinned := map[string]bool{}
	for _, c := range []struct {
		data store.EventData
		typ  string
		keys []string
	}{
		{store.NodeJoinedData{NodeID: "n"}, store.EventNodeJoined, []string{"nodeId"}},
		{store.NodeAdoptedData{NodeID: "n"}, store.EventNodeAdopted, []string{"gpus", "nodeId", "poolId"}},
		{store.NodeAcceptanceFailedData{NodeID: "n"}, store.EventNodeAcceptanceFailed, []string{"nodeId", "poolId", "reason"}},
		{store.NodeCordonedData{NodeID: "n"}, store.EventNodeCordoned, []string{"nodeId", "reason"}},
		{store.NodeUncordonedData{NodeID: "n"}, store.EventNodeUncordoned, []string{"nodeId", "previousReason"}},
		{store.NodeUnreachableData{NodeID: "n"}, store.EventNodeUnreachable, []string{"nodeId", "timeoutSeconds"}},
		{store.NodeReachableData{NodeID: "n"}, store.EventNodeReachable, []string{"nodeId", "sessionId"}},
		{store.NodeReachableData{NodeID: "n", GatewayID: "gw", PreviousLastSeen: &at}, store.EventNodeReachable,
			[]string{"gatewayId", "nodeId", "previousLastSeen", "sessionId"}},
		{store.NodeRevokedData{NodeID: "n"}, store.EventNodeRevoked, []string{"certificatesRevoked", "nodeId", "reason"}},
		{store.NodeSpecRefusedData{NodeID: "n"}, store.EventNodeSpecRefused, []string{"generation", "nodeId", "reason"}},
		{store.NodeSSHRefusedData{NodeID: "n"}, store.EventNodeSSHRefused, []string{"keyId", "nodeId", "reason", "user"}},
		{store.CommandQueuedData{CommandID: "c"}, store.EventCommandQueued, []string{"commandId", "deadline", "kind", "nodeId"}},
		{store.CommandEndedData{CommandID: "c", State: "succeeded"}, store.EventCommandSucceeded,
			[]string{"commandId", "kind", "nodeId", "state"}},
		{store.CommandEndedData{CommandID: "c", State: "failed", Error: "e"}, store.EventCommandFailed,
			[]string{"commandId", "error", "kind", "nodeId", "state"}},
		{store.CommandEndedData{CommandID: "c", State: "expired", Error: "e"}, store.EventCommandExpired,
			[]string{"commandId", "error", "kind", "nodeId", "state"}},
		{store.ReservationCreatedData{ReservationID: "r"}, store.EventReservationCreated,
			[]string{"endAt", "gpus", "poolId", "reservationId", "startAt"}},
		{store.ReservationFailedData{ReservationID: "r"}, store.EventReservationFailed, []string{"reason", "reservationId"}},
		{store.ReservationFailedData{ReservationID: "r", NodeID: "n"}, store.EventReservationFailed,
			[]string{"nodeId", "reason", "reservationId"}},
		{store.ReservationBoundData{ReservationID: "r"}, store.EventReservationBound, []string{"deviceIndexes", "nodeId", "reservationId"}},
		{store.ReservationActiveData{ReservationID: "r"}, store.EventReservationActive,
			[]string{"binding", "generation", "nodeId", "reservationId"}},
		{store.ReservationEndedData{ReservationID: "r", State: store.ReservationReleased}, store.EventReservationReleased,
			[]string{"from", "nodeId", "reservationId"}},
		{store.ReservationEndedData{ReservationID: "r", State: store.ReservationExpired}, store.EventReservationExpired,
			[]string{"from", "nodeId", "reservationId"}},
	} {
		pinned[c.typ] = true
		t.Run(fmt.Sprintf("%s %v", c.typ, c.keys), func(t *testing.T) {
			typ, subject := store.EventOf(c.data)
			require.Equal(t, c.typ, typ)
			require.NotEmpty(t, subject)
			b, err := json.Marshal(c.data)
			require.NoError(t, err)
			var obj map[string]any
			require.NoError(t, json.Unmarshal(b, &obj))
			want := map[string]bool{}
			for _, k := range c.keys {
				want[k] = true
			}
			got := map[string]bool{}
			for k := range obj {
				got[k] = true
			}
			require.Equal(t, want, got, "%s", b)
		})
	}
	require.Len(t, pinned, len(store.EventTypes), "every event type is pinned")
}

// TestCommandEndedDataSQL checks that the SQL that builds CommandEndedData
// in ApplySessionCommandUpdates writes what the Go type does.
func TestCommandEndedDataSQL(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	for _, d := range []store.CommandEndedData{
		{CommandID: "cmd_1", NodeID: "node_1", Kind: store.CommandDiagNVML, State: "succeeded"},
		{CommandID: "cmd_2", NodeID: "node_2", Kind: store.CommandNodeReboot, State: "failed", Error: `no "reboot" <here>`},
	} {
		b, err := json.Marshal(d)
		require.NoError(t, err)
		var fromGo, fromSQL string
		require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT $1::jsonb::text`, string(b)).Scan(&fromGo))
		require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT (`+store.CommandEndedDataSQL+`)::text
			FROM (VALUES ($1, $2, $3, $4, $5)) AS c(id, node_id, kind, state, error)`,
			d.CommandID, d.NodeID, d.Kind, d.State, d.Error).Scan(&fromSQL))
		require.Equal(t, fromGo, fromSQL)
	}
}
