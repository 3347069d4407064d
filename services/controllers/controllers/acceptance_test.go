package controllers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protojson"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/bus/bustest"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// start is in a zone far from UTC, so that a time written without .UTC()
// would show.
var start = time.Date(2030, 5, 6, 7, 8, 9, 0, time.FixedZone("IST", 5*3600+1800))

const (
	gatewayID = "gw-test"
	tenantID  = "ten_01JTEST0000000000000000000"
	siteID    = "site_01JTEST000000000000000000"
	h100Pool  = "pool_01JH100000000000000000000"
	l40sPool  = "pool_01JL40S000000000000000000"
	cpuPool   = "pool_01JCPU0000000000000000000"
)

type fixture struct {
	db  *store.DB
	clk *clock.Fake
	acc *controllers.Acceptance
}

// setup returns a database with a tenant, a site and three pools (H100: 8 ×
// H100; L40S: 4 × L40S; CPU: no rules) and an acceptance reconciler on a
// fake clock.
func setup(t testing.TB) *fixture {
	t.Helper()
	clk := clock.NewFake(start)
	db := storetest.New(t, clk)
	ownerAndSite(t, db)
	for _, p := range []storetest.PoolOpts{
		{ID: h100Pool, Name: "h100", GPUModel: "H100", ExpectGPUCount: 8},
		{ID: l40sPool, Name: "l40s", GPUModel: "L40S", ExpectGPUCount: 4},
		{ID: cpuPool, Name: "cpu"},
	} {
		p.SiteID, p.OwnerTenantID = siteID, tenantID
		storetest.Pool(t, db, &p)
	}
	return &fixture{db: db, clk: clk, acc: &controllers.Acceptance{DB: db, Clock: clk}}
}

// ownerAndSite inserts the tenant tenantID and the site siteID.
func ownerAndSite(t testing.TB, db *store.DB) {
	t.Helper()
	storetest.Tenant(t, db, &storetest.TenantOpts{ID: tenantID, Name: "owner"})
	storetest.Site(t, db, &storetest.SiteOpts{ID: siteID, Name: "dev-1"})
}

// addNodes inserts n joining nodes of variant in pool, each with a session on
// gatewayID, and returns their ids.
func (f *fixture) addNodes(t testing.TB, pool, variant string, n int) []string {
	t.Helper()
	out := make([]string, n)
	for i := range out {
		id := ids.New(ids.Node, f.clk.Now())
		out[i] = storetest.Node(t, f.db, &storetest.NodeOpts{ID: id, PoolID: pool, Variant: variant, MachineID: id,
			GatewayID: gatewayID, SessionID: "ses_" + id, Reachable: true}).ID
	}
	return out
}

func (f *fixture) reconcile(t testing.TB) controllers.PassResult {
	t.Helper()
	res, err := f.acc.Reconcile(t.Context())
	require.NoError(t, err)
	return res
}

type command struct {
	ID, State, Kind, Purpose, Error string
	RetrySafe                       bool
	Deadline                        time.Time
}

// commands returns the node's commands, oldest first.
func (f *fixture) commands(t testing.TB, nodeID string) []command {
	t.Helper()
	rows, err := f.db.Pool.Query(t.Context(), `SELECT id, state, kind, purpose, error, retry_safe, deadline
		FROM commands WHERE node_id = $1 ORDER BY created_at, id`, nodeID)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (command, error) {
		var c command
		err := r.Scan(&c.ID, &c.State, &c.Kind, &c.Purpose, &c.Error, &c.RetrySafe, &c.Deadline)
		return c, err
	})
	require.NoError(t, err)
	return out
}

func (f *fixture) lastCommand(t testing.TB, nodeID string) command {
	t.Helper()
	cmds := f.commands(t, nodeID)
	require.NotEmpty(t, cmds, "node %s has no command", nodeID)
	return cmds[len(cmds)-1]
}

// succeed plays the gateway: the node's open acceptance commands succeed
// now with the inventory of a fake machine of variant (machine id = node
// id).
func (f *fixture) succeed(t testing.TB, variant string, nodeIDs ...string) {
	t.Helper()
	f.update(t, f.successes(t, variant, nodeIDs...)...)
}

// successes are the updates of succeed.
func (f *fixture) successes(t testing.TB, variant string, nodeIDs ...string) []store.SessionCommandUpdate {
	t.Helper()
	updates := make([]store.SessionCommandUpdate, len(nodeIDs))
	for i, n := range nodeIDs {
		m, err := fakehw.New(variant, n)
		require.NoError(t, err)
		b, err := protojson.Marshal(&gatewayv1.CommandResult{Inventory: m.Inventory()})
		require.NoError(t, err)
		updates[i] = store.SessionCommandUpdate{NodeID: n, CommandID: f.lastCommand(t, n).ID, State: "succeeded", Result: b,
			Now: f.clk.Now()}
	}
	return updates
}

// succeedPastDeadline is succeed for commands whose deadline has passed:
// they succeed all the same. Raw SQL: the gateway records such an answer
// as expired (store.ApplySessionCommandUpdates), and this is the state the
// reconciler must still judge by the result, a success finished after the
// deadline.
func (f *fixture) succeedPastDeadline(t testing.TB, variant string, nodeIDs ...string) {
	t.Helper()
	var cmdIDs, results []string
	for _, u := range f.successes(t, variant, nodeIDs...) {
		cmdIDs, results = append(cmdIDs, u.CommandID), append(results, string(u.Result))
	}
	_, err := f.db.Pool.Exec(t.Context(), `UPDATE commands c SET state = 'succeeded', result = u.result::jsonb, finished_at = $3,
			updated_at = $3
		FROM unnest($1::text[], $2::text[]) AS u(id, result) WHERE c.id = u.id`, cmdIDs, results, f.clk.Now())
	require.NoError(t, err)
}

// update plays the gateway: it records the daemons' command updates
// (store.ApplySessionCommandUpdates) and requires each applied.
func (f *fixture) update(t testing.TB, updates ...store.SessionCommandUpdate) {
	t.Helper()
	out, err := store.ApplySessionCommandUpdates(t.Context(), f.db.Pool, updates)
	require.NoError(t, err)
	for i, o := range out {
		require.True(t, o.Applied, "update %d: %+v", i, updates[i])
	}
}

// deliver plays the gateway: it delivers the queued commands of nodes over
// their sessions (store.ClaimSessionDeliveries).
func (f *fixture) deliver(t testing.TB, nodeIDs ...string) {
	t.Helper()
	reqs := make([]store.ClaimRequest, len(nodeIDs))
	for i, n := range nodeIDs {
		reqs[i] = store.ClaimRequest{NodeID: n, SessionID: "ses_" + n}
	}
	_, err := store.ClaimSessionDeliveries(t.Context(), f.db.Pool, f.clk.Now(), reqs)
	require.NoError(t, err)
}

type node struct {
	State, Reason             string
	SpecGeneration            int64
	AdoptedAt                 *time.Time
	Spec, Inventory           []byte
	Devices                   int
	DeviceUUIDs               []string
	AdoptedEvents, FailEvents int
}

// state returns the node's provision state, "" on error (for use inside
// require.Eventually, whose condition runs on another goroutine).
func (f *fixture) state(id string) string {
	var s string
	_ = f.db.Pool.QueryRow(context.Background(), `SELECT provision_state FROM nodes WHERE id = $1`, id).Scan(&s)
	return s
}

func (f *fixture) node(t *testing.T, id string) node {
	t.Helper()
	var n node
	err := f.db.Pool.QueryRow(t.Context(), `SELECT provision_state, provision_reason, spec_generation, adopted_at,
			spec, inventory,
			(SELECT count(*) FROM node_devices WHERE node_id = n.id),
			(SELECT COALESCE(array_agg(uuid ORDER BY device_index), '{}') FROM node_devices WHERE node_id = n.id),
			(SELECT count(*) FROM events WHERE subject_id = n.id AND type = 'node.adopted' AND tenant_id = $2),
			(SELECT count(*) FROM events WHERE subject_id = n.id AND type = 'node.acceptance_failed' AND tenant_id = $2)
		FROM nodes n WHERE id = $1`, id, tenantID).Scan(&n.State, &n.Reason, &n.SpecGeneration, &n.AdoptedAt,
		&n.Spec, &n.Inventory, &n.Devices, &n.DeviceUUIDs, &n.AdoptedEvents, &n.FailEvents)
	require.NoError(t, err)
	return n
}

// pokedNodes returns, per gateway poke row in the outbox, the node ids.
func (f *fixture) pokedNodes(t *testing.T) map[string]int {
	t.Helper()
	rows, err := f.db.Pool.Query(t.Context(), `SELECT payload FROM outbox WHERE subject = $1`,
		store.SubjectPokeGatewayPrefix+gatewayID)
	require.NoError(t, err)
	payloads, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	require.NoError(t, err)
	out := map[string]int{}
	for _, p := range payloads {
		var poke store.Poke
		require.NoError(t, json.Unmarshal(p, &poke))
		for _, n := range poke.NodeIDs {
			out[n]++
		}
	}
	return out
}

func TestAdoptsHealthyNode(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]

	require.Equal(t, controllers.PassResult{Started: 1}, f.reconcile(t))
	require.Equal(t, store.NodeAccepting, f.node(t, n).State)
	cmds := f.commands(t, n)
	require.Len(t, cmds, 1)
	require.Equal(t, "diag.nvml", cmds[0].Kind)
	require.Equal(t, "acceptance", cmds[0].Purpose)
	require.Equal(t, "queued", cmds[0].State)
	require.True(t, cmds[0].RetrySafe)
	require.True(t, cmds[0].Deadline.Equal(start.Add(controllers.DefaultAcceptanceTimeout)), "deadline %s", cmds[0].Deadline)
	require.NoError(t, ids.Check(ids.Command, cmds[0].ID))
	require.Equal(t, map[string]int{n: 1}, f.pokedNodes(t), "the gateway was not poked for the command")

	// Nothing to do until the node answers.
	require.Equal(t, controllers.PassResult{}, f.reconcile(t))

	f.clk.Advance(time.Second)
	f.succeed(t, fakehw.VariantHGXH100, n)
	require.Equal(t, controllers.PassResult{Adopted: 1}, f.reconcile(t))

	got := f.node(t, n)
	require.Equal(t, store.NodeAdopted, got.State)
	require.Empty(t, got.Reason)
	require.EqualValues(t, 1, got.SpecGeneration)
	require.NotNil(t, got.AdoptedAt)
	require.True(t, got.AdoptedAt.Equal(start.Add(time.Second)))
	var spec gatewayv1.NodeSpec
	require.NoError(t, protojson.Unmarshal(got.Spec, &spec))
	require.Equal(t, map[string]string{controllers.LabelPool: h100Pool, controllers.LabelSite: siteID}, spec.GetLabels())
	require.Empty(t, spec.GetAllocations())
	var inv gatewayv1.Inventory
	require.NoError(t, protojson.Unmarshal(got.Inventory, &inv))
	require.Len(t, inv.GetGpus(), 8)
	require.Equal(t, 8, got.Devices)
	for i, u := range got.DeviceUUIDs {
		require.Equal(t, fakehw.GPUUUID(n, int32(i)), u)
	}
	require.Equal(t, 1, got.AdoptedEvents)
	require.Equal(t, 0, got.FailEvents)
	require.Equal(t, map[string]int{n: 2}, f.pokedNodes(t), "the gateway was not poked for DesiredState")
	var schedPokes int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE subject = $1`,
		store.SubjectPokeScheduler).Scan(&schedPokes))
	require.Equal(t, 1, schedPokes)

	// Adopted nodes are left alone.
	require.Equal(t, controllers.PassResult{}, f.reconcile(t))
	require.Len(t, f.commands(t, n), 1)
}

// TestResultWithUnknownFields: a result with fields this version does not
// know (written by a newer gateway or daemon during a rolling upgrade) is
// judged by the fields it knows: the node is adopted with its GPUs.
func TestResultWithUnknownFields(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	require.Equal(t, controllers.PassResult{Started: 1}, f.reconcile(t))
	u := f.successes(t, fakehw.VariantHGXH100, n)[0]
	var doc map[string]any
	require.NoError(t, json.Unmarshal(u.Result, &doc))
	doc["fromTheFuture"] = map[string]any{"a": 1}
	inv := doc["inventory"].(map[string]any)
	inv["nvlinkTopology"] = "full-mesh"
	inv["gpus"].([]any)[0].(map[string]any)["eccErrors"] = 0
	b, err := json.Marshal(doc)
	require.NoError(t, err)
	u.Result = b
	f.update(t, u)
	require.Equal(t, controllers.PassResult{Adopted: 1}, f.reconcile(t))
	got := f.node(t, n)
	require.Equal(t, store.NodeAdopted, got.State, got.Reason)
	require.Equal(t, 8, got.Devices)
}

// TestVariantsAgainstPools runs each fake variant through acceptance in each
// pool in one pass.
func TestVariantsAgainstPools(t *testing.T) {
	t.Parallel()
	f := setup(t)
	tests := []struct {
		pool, variant string
		state, reason string
		devices       int
	}{
		{h100Pool, fakehw.VariantHGXH100, store.NodeAdopted, "", 8},
		// A failed node keeps the GPUs it reported, for operators to see.
		{h100Pool, fakehw.VariantHGXH100GPUMissing, store.NodeAcceptanceFailed, "expected 8 GPUs, found 7", 7},
		{h100Pool, fakehw.VariantL40S, store.NodeAcceptanceFailed,
			`expected H100 GPUs, found "NVIDIA L40S" (GPUs 0, 1, 2, 3); expected 8 GPUs, found 4`, 4},
		{h100Pool, fakehw.VariantCPU, store.NodeAcceptanceFailed,
			"expected H100 GPUs, found no GPUs; expected 8 GPUs, found 0", 0},
		{l40sPool, fakehw.VariantL40S, store.NodeAdopted, "", 4},
		{cpuPool, fakehw.VariantCPU, store.NodeAdopted, "", 0},
		{cpuPool, fakehw.VariantHGXH100GPUMissing, store.NodeAdopted, "", 7},
	}
	nodes := make([]string, len(tests))
	for i, tc := range tests {
		nodes[i] = f.addNodes(t, tc.pool, tc.variant, 1)[0]
	}
	require.Equal(t, len(tests), f.reconcile(t).Started)
	for i, tc := range tests {
		f.succeed(t, tc.variant, nodes[i])
	}
	res := f.reconcile(t)
	require.Equal(t, 4, res.Adopted)
	require.Equal(t, 3, res.Failed)
	for i, tc := range tests {
		got := f.node(t, nodes[i])
		require.Equal(t, tc.state, got.State, "%s in %s", tc.variant, tc.pool)
		require.Equal(t, tc.reason, got.Reason, "%s in %s", tc.variant, tc.pool)
		require.Equal(t, tc.devices, got.Devices, "%s in %s", tc.variant, tc.pool)
		if tc.state == store.NodeAdopted {
			require.EqualValues(t, 1, got.SpecGeneration)
			require.Equal(t, [2]int{1, 0}, [2]int{got.AdoptedEvents, got.FailEvents})
		} else {
			require.EqualValues(t, 0, got.SpecGeneration)
			require.Nil(t, got.AdoptedAt)
			require.Equal(t, [2]int{0, 1}, [2]int{got.AdoptedEvents, got.FailEvents})
			// The inventory found is kept for the operator.
			var inv gatewayv1.Inventory
			require.NoError(t, protojson.Unmarshal(got.Inventory, &inv))
			m, err := fakehw.New(tc.variant, nodes[i])
			require.NoError(t, err)
			require.Len(t, inv.GetGpus(), m.GPUCount())
			var reported []string
			for _, g := range inv.GetGpus() {
				reported = append(reported, g.GetUuid())
			}
			require.ElementsMatch(t, reported, got.DeviceUUIDs, "the devices are the GPUs reported")
		}
	}
	// The event carries the reason.
	var data []byte
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT data FROM events WHERE subject_id = $1`, nodes[1]).Scan(&data))
	require.JSONEq(t, fmt.Sprintf(`{"nodeId":%q,"poolId":%q,"reason":"expected 8 GPUs, found 7"}`, nodes[1], h100Pool),
		string(data))
}

func TestFailedCommand(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	f.reconcile(t)
	f.update(t, store.SessionCommandUpdate{NodeID: n, CommandID: f.lastCommand(t, n).ID, State: "failed",
		Error: "nvml: driver not loaded", Now: f.clk.Now()})
	require.Equal(t, controllers.PassResult{Failed: 1}, f.reconcile(t))
	got := f.node(t, n)
	require.Equal(t, store.NodeAcceptanceFailed, got.State)
	require.Equal(t, "diag.nvml failed: nvml: driver not loaded", got.Reason)
	require.Equal(t, 1, got.FailEvents)
	require.Len(t, f.commands(t, n), 1, "a failed command was retried")
}

// TestExpiredCommandRetriedThenFailed: a node that never answers gets three
// commands, each expired at its deadline, then fails.
func TestExpiredCommandRetriedThenFailed(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	f.reconcile(t)
	f.deliver(t, n)

	f.clk.Advance(controllers.DefaultAcceptanceTimeout - time.Microsecond)
	require.Equal(t, controllers.PassResult{}, f.reconcile(t), "expired before the deadline")

	for attempt := 2; attempt <= 3; attempt++ {
		f.clk.Advance(time.Microsecond)
		require.Equal(t, controllers.PassResult{Retried: 1}, f.reconcile(t))
		cmds := f.commands(t, n)
		require.Len(t, cmds, attempt)
		require.Equal(t, "expired", cmds[attempt-2].State)
		require.Equal(t, "delivered but not started before the deadline", cmds[attempt-2].Error)
		require.Equal(t, "queued", cmds[attempt-1].State)
		require.True(t, cmds[attempt-1].Deadline.Equal(f.clk.Now().Add(controllers.DefaultAcceptanceTimeout)))
		require.Equal(t, store.NodeAccepting, f.node(t, n).State)
		require.Equal(t, attempt, f.pokedNodes(t)[n], "the retry was not poked")
		// The gateway delivers it; the node stays silent.
		f.deliver(t, n)
		f.clk.Advance(controllers.DefaultAcceptanceTimeout - time.Microsecond)
	}
	f.clk.Advance(time.Microsecond)
	require.Equal(t, controllers.PassResult{Failed: 1}, f.reconcile(t))
	got := f.node(t, n)
	require.Equal(t, store.NodeAcceptanceFailed, got.State)
	require.Equal(t, "diag.nvml was delivered but did not start within 2m0s (3 attempts)", got.Reason)
	require.Equal(t, 1, got.FailEvents)
	for _, c := range f.commands(t, n) {
		require.Equal(t, "expired", c.State)
	}
}

// TestExpiryReasonsByState: an acceptance command that runs out of time
// says what happened by the state it was in: still queued (never
// delivered: the node was not connected), delivered (never started) or
// running (started, not finished); the node that fails says the same of its
// last command.
func TestExpiryReasonsByState(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f.acc.Attempts = 2
	nodes := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 3)
	queued, delivered, running := nodes[0], nodes[1], nodes[2]
	// begin plays the gateway and the daemon: the node's queued command is
	// delivered and starts.
	begin := func(node string) {
		f.deliver(t, node)
		f.update(t, store.SessionCommandUpdate{NodeID: node, CommandID: f.lastCommand(t, node).ID, State: "running",
			Now: f.clk.Now()})
	}
	f.reconcile(t)
	for attempt := 1; attempt <= 2; attempt++ {
		f.deliver(t, delivered)
		begin(running)
		f.clk.Advance(controllers.DefaultAcceptanceTimeout)
		res := f.reconcile(t)
		for node, want := range map[string]string{
			queued:    "not delivered before the deadline: the node was not connected",
			delivered: "delivered but not started before the deadline",
			running:   "started but not finished before the deadline",
		} {
			cmds := f.commands(t, node)
			last := cmds[attempt-1]
			require.Equal(t, "expired", last.State, "attempt %d of %s", attempt, node)
			require.Equal(t, want, last.Error, "attempt %d of %s", attempt, node)
		}
		if attempt == 1 {
			require.Equal(t, controllers.PassResult{Retried: 3}, res)
		} else {
			require.Equal(t, controllers.PassResult{Retried: 1, Failed: 2}, res)
		}
	}
	got := f.node(t, delivered)
	require.Equal(t, store.NodeAcceptanceFailed, got.State)
	require.Equal(t, "diag.nvml was delivered but did not start within 2m0s (2 attempts)", got.Reason)
	got = f.node(t, running)
	require.Equal(t, store.NodeAcceptanceFailed, got.State)
	require.Equal(t, "diag.nvml started but did not finish within 2m0s (2 attempts)", got.Reason)
	// Undelivered commands do not count: the node without a session is
	// still accepting, with a fresh command.
	require.Equal(t, store.NodeAccepting, f.node(t, queued).State)
	require.Equal(t, "queued", f.lastCommand(t, queued).State)

	// One delivered attempt is enough with Attempts 1, and the reason says
	// so in the singular.
	f.acc.Attempts = 1
	begin(queued)
	f.clk.Advance(controllers.DefaultAcceptanceTimeout)
	require.Equal(t, controllers.PassResult{Failed: 1}, f.reconcile(t))
	require.Equal(t, "diag.nvml started but did not finish within 2m0s (1 attempt)", f.node(t, queued).Reason)
}

// TestUndeliveredAttemptsDoNotCount: a node with no session (it joined during
// a gateway outage) never receives its acceptance command; each expires and
// is replaced, but it is not failed for silence it had no chance to break.
func TestUndeliveredAttemptsDoNotCount(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	f.reconcile(t)
	for range 5 {
		f.clk.Advance(controllers.DefaultAcceptanceTimeout)
		require.Equal(t, controllers.PassResult{Retried: 1}, f.reconcile(t))
	}
	require.Equal(t, store.NodeAccepting, f.node(t, n).State)
	require.Len(t, f.commands(t, n), 6)

	// Once it connects and answers, it is adopted.
	f.succeed(t, fakehw.VariantHGXH100, n)
	require.Equal(t, controllers.PassResult{Adopted: 1}, f.reconcile(t))
}

// TestLateAnswerWins: a command that succeeded after its deadline but before
// the reconciler looked is evaluated, not expired.
func TestLateAnswerWins(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	f.reconcile(t)
	f.clk.Advance(controllers.DefaultAcceptanceTimeout + time.Second)
	f.succeedPastDeadline(t, fakehw.VariantHGXH100, n)
	require.Equal(t, controllers.PassResult{Adopted: 1}, f.reconcile(t))
	require.Equal(t, "succeeded", f.lastCommand(t, n).State)
}

// TestAnswerAfterExpiryIgnored: once a command is expired and replaced, only
// the replacement counts.
func TestAnswerAfterExpiryIgnored(t *testing.T) {
	t.Parallel()
	f := setup(t)
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	f.reconcile(t)
	first := f.lastCommand(t, n).ID
	f.clk.Advance(controllers.DefaultAcceptanceTimeout)
	require.Equal(t, controllers.PassResult{Retried: 1}, f.reconcile(t))
	// The gateway never moves a command out of a terminal state, so a late
	// failure of the first command changes nothing.
	out, err := store.ApplySessionCommandUpdates(t.Context(), f.db.Pool, []store.SessionCommandUpdate{
		{NodeID: n, CommandID: first, State: "failed", Now: f.clk.Now()}})
	require.NoError(t, err)
	require.False(t, out[0].Applied)
	require.Equal(t, controllers.PassResult{}, f.reconcile(t))
	f.succeed(t, fakehw.VariantHGXH100, n)
	require.Equal(t, controllers.PassResult{Adopted: 1}, f.reconcile(t))
}

// TestConcurrentReconcilers: two reconcilers racing over many nodes give
// each node exactly one acceptance command and one outcome.
func TestConcurrentReconcilers(t *testing.T) {
	t.Parallel()
	f := setup(t)
	nodes := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 300)
	accs := []*controllers.Acceptance{
		{DB: f.db, Clock: f.clk, Batch: 40},
		{DB: f.db, Clock: f.clk, Batch: 40},
	}
	race := func() controllers.PassResult {
		var mu sync.Mutex
		var total controllers.PassResult
		var wg sync.WaitGroup
		for _, a := range accs {
			wg.Go(func() {
				for range 3 {
					res, err := a.Reconcile(t.Context())
					if err != nil {
						t.Error(err)
						return
					}
					mu.Lock()
					total.Started += res.Started
					total.Adopted += res.Adopted
					total.Failed += res.Failed
					total.Retried += res.Retried
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		return total
	}
	require.Equal(t, controllers.PassResult{Started: len(nodes)}, race())
	var cmds, perNodeMax int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT count(*), max(n) FROM
		(SELECT count(*) AS n FROM commands GROUP BY node_id) c`).Scan(&cmds, &perNodeMax))
	require.Equal(t, len(nodes), cmds)
	require.Equal(t, 1, perNodeMax)

	f.succeed(t, fakehw.VariantHGXH100, nodes...)
	require.Equal(t, controllers.PassResult{Adopted: len(nodes)}, race())
	var adopted, events int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT
		(SELECT count(*) FROM nodes WHERE provision_state = 'adopted'),
		(SELECT count(*) FROM events WHERE type = 'node.adopted')`).Scan(&adopted, &events))
	require.Equal(t, len(nodes), adopted)
	require.Equal(t, len(nodes), events)
}

// TestThousandNodes: 1,000 joining nodes are all started and adopted by one
// pass each, with their devices recorded. The rate is measured by
// BenchmarkAcceptance1000, not asserted here.
func TestThousandNodes(t *testing.T) {
	t.Parallel()
	f := setup(t)
	nodes := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1000)
	require.Equal(t, controllers.PassResult{Started: 1000}, f.reconcile(t))
	f.succeed(t, fakehw.VariantHGXH100, nodes...)
	require.Equal(t, controllers.PassResult{Adopted: 1000}, f.reconcile(t))
	var devices int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM node_devices`).Scan(&devices))
	require.Equal(t, 8000, devices)
}

// BenchmarkAcceptance1000 reports how many nodes per second of reconciler
// time the acceptance passes start and adopt, 1,000 nodes at a time (target:
// well over 167 nodes/s, the adoption rate `make bench` aims at end to end).
func BenchmarkAcceptance1000(b *testing.B) {
	wall := clock.New()
	var took time.Duration
	for b.Loop() {
		b.StopTimer()
		f := setup(b)
		nodes := f.addNodes(b, h100Pool, fakehw.VariantHGXH100, 1000)
		b.StartTimer()
		began := wall.Now()
		require.Equal(b, controllers.PassResult{Started: 1000}, f.reconcile(b))
		took += clock.Since(wall, began)
		b.StopTimer()
		f.succeed(b, fakehw.VariantHGXH100, nodes...)
		b.StartTimer()
		began = wall.Now()
		require.Equal(b, controllers.PassResult{Adopted: 1000}, f.reconcile(b))
		took += clock.Since(wall, began)
	}
	b.ReportMetric(float64(1000*b.N)/took.Seconds(), "nodes/s")
}

func startNATS(t *testing.T) (*server.Server, *nats.Conn) {
	t.Helper()
	s, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(s.Shutdown)
	nc, err := nats.Connect(s.ClientURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return s, nc
}

// TestRunWakesOnPoke: with polling effectively off (a fake clock that does
// not move), a poke on bc.poke.controllers starts a pass.
func TestRunWakesOnPoke(t *testing.T) {
	t.Parallel()
	f := setup(t)
	_, nc := startNATS(t)
	acc := &controllers.Acceptance{DB: f.db, NC: nc, Clock: f.clk}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- acc.Run(ctx) }()

	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	require.Eventually(t, func() bool {
		_ = nc.Publish(store.SubjectPokeControllers, nil) // until Run has subscribed
		return f.state(n) == store.NodeAccepting
	}, 10*time.Second, 50*time.Millisecond)

	f.succeed(t, fakehw.VariantHGXH100, n)
	require.NoError(t, nc.Publish(store.SubjectPokeControllers, nil))
	require.Eventually(t, func() bool { return f.state(n) == store.NodeAdopted }, 10*time.Second, 20*time.Millisecond)
	cancel()
	require.NoError(t, <-errc)
}

// TestRunPolls: without pokes, the reconciler looks every Interval.
func TestRunPolls(t *testing.T) {
	t.Parallel()
	f := setup(t)
	acc := &controllers.Acceptance{DB: f.db, Clock: f.clk, Interval: time.Second}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- acc.Run(ctx) }()
	n := f.addNodes(t, h100Pool, fakehw.VariantHGXH100, 1)[0]
	require.Eventually(t, func() bool {
		f.clk.Advance(time.Second)
		return f.state(n) == store.NodeAccepting
	}, 10*time.Second, 20*time.Millisecond)
	cancel()
	require.NoError(t, <-errc)
}

// TestServer runs the whole service on the real clock: the joinservice's
// outbox poke reaches the reconciler through the relay and NATS, the
// gateway's poke arrives on NATS, /healthz answers, and shutdown releases
// the lease.
func TestServer(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	now := db.Now()
	ownerAndSite(t, db)
	storetest.Pool(t, db, &storetest.PoolOpts{ID: h100Pool, SiteID: siteID, OwnerTenantID: tenantID, Name: "h100", GPUModel: "H100",
		ExpectGPUCount: 8})
	ns, nc := startNATS(t)
	gwPokes, err := nc.SubscribeSync(store.SubjectPokeGatewayPrefix + gatewayID)
	require.NoError(t, err)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv, err := controllers.New(controllers.Config{Probes: service.Probes{HealthListener: ln}, ReconcileInterval: time.Hour, Leases: service.Leases{Holder: "replica-1"}},
		controllers.Deps{DB: db, NC: nc})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- srv.Run(ctx) }()

	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := hc.Get("http://" + ln.Addr().String() + "/healthz")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))

	// Wait for the lease and the reconciler's subscription (besides the
	// test's own), so that the pokes below wake it: it polls only hourly.
	require.Eventually(t, func() bool { return srv.LeaseHeld() && ns.NumSubscriptions() >= 2 },
		10*time.Second, 10*time.Millisecond)

	// What joinservice does: create the node (here with its session on the
	// gateway already) and poke the controllers.
	n := storetest.Node(t, db, &storetest.NodeOpts{PoolID: h100Pool, GatewayID: gatewayID, SessionID: "ses_x", CreatedAt: now}).ID
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		return store.Enqueue(t.Context(), tx, now, store.SubjectPokeControllers, nil)
	}))
	msg, err := gwPokes.NextMsg(10 * time.Second)
	require.NoError(t, err, "the gateway was not poked with the acceptance command")
	var poke store.Poke
	require.NoError(t, json.Unmarshal(msg.Data, &poke))
	require.Equal(t, []string{n}, poke.NodeIDs)

	// What the gateway does: store the result and poke the controllers
	// (store.ApplySessionCommandUpdates does both).
	m, err := fakehw.New(fakehw.VariantHGXH100, n)
	require.NoError(t, err)
	result, err := protojson.Marshal(&gatewayv1.CommandResult{Inventory: m.Inventory()})
	require.NoError(t, err)
	cmds, err := store.ListCommands(t.Context(), db.Pool, store.CommandFilter{Scope: store.AllTenants, NodeID: n, Limit: 1})
	require.NoError(t, err)
	require.Len(t, cmds, 1)
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		_, err := store.ApplySessionCommandUpdates(t.Context(), tx, []store.SessionCommandUpdate{{NodeID: n,
			CommandID: cmds[0].ID, State: "succeeded", Result: result, Now: db.Now()}})
		return err
	}))
	_, err = gwPokes.NextMsg(10 * time.Second)
	require.NoError(t, err, "the gateway was not poked for DesiredState")
	got, err := store.GetNode(t.Context(), db.Pool, store.AllTenants, n)
	require.NoError(t, err)
	require.Equal(t, store.NodeAdopted, got.ProvisionState)
	require.EqualValues(t, 1, got.SpecGeneration)
	require.Len(t, got.Devices, 8)

	lease, err := store.GetLease(t.Context(), db.Pool, controllers.LeaseAcceptance)
	require.NoError(t, err)
	require.Equal(t, "replica-1", lease.Holder)
	cancel()
	require.NoError(t, <-errc)
	_, err = store.GetLease(t.Context(), db.Pool, controllers.LeaseAcceptance)
	require.ErrorIs(t, err, store.ErrNotFound, "shutdown did not release the lease")
}
