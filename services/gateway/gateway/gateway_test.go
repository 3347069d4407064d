package gateway_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/gateway/gateway"
)

// noResync keeps the periodic re-read out of tests of pokes.
var noResync = gateway.Config{ResyncInterval: time.Hour}

func TestHelloWelcomeRecordsSession(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{GatewayID: "gw-a", HeartbeatInterval: 7 * time.Second})
	n := e.newNode()

	d, w := e.connect(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "boot-42", AgentVersion: "bcd 1.2.3", ObservedGeneration: 0})
	require.True(t, strings.HasPrefix(w.GetSessionId(), "ses_"), w.GetSessionId())
	require.Equal(t, "gw-a", w.GetGatewayId())
	require.Equal(t, 7*time.Second, w.GetHeartbeatInterval().AsDuration())
	require.EqualValues(t, 1, w.GetSessionEpoch())

	r := e.nodeRow(n.id)
	require.Equal(t, "gw-a", *r.GatewayID)
	require.Equal(t, w.GetSessionId(), *r.SessionID)
	require.EqualValues(t, 1, r.Epoch)
	require.Equal(t, "boot-42", r.BootID)
	require.Equal(t, "bcd 1.2.3", r.Agent)
	require.True(t, r.Reachable)
	require.NotNil(t, r.LastSeen)
	require.Equal(t, 1, g.srv.Sessions())

	// The daemon ends the stream: the session is cleared.
	require.NoError(t, d.stream.CloseRequest())
	require.NoError(t, d.ended())
	eventually(t, func() bool { return e.nodeRow(n.id).SessionID == nil }, "session cleared on stream end")
	r = e.nodeRow(n.id)
	require.Nil(t, r.GatewayID)
	require.True(t, r.Reachable, "reachability is the liveness sweeper's business")
	eventually(t, func() bool { return g.srv.Sessions() == 0 }, "session unregistered")
}

func TestPokedCommandIsDeliveredPromptly(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	e.relay()
	g := e.startGateway(noResync)
	n := e.newNode()
	d, _ := e.connect(g, n, nil)

	cmdID := e.queueCommand(n.id, "inventory.refresh", "user")
	require.NoError(t, e.db.InTx(t.Context(), func(tx pgx.Tx) error {
		return store.PokeNodes(t.Context(), tx, e.db.Now(), n.id)
	}))
	c := d.next().GetCommand()
	require.NotNil(t, c)
	require.Equal(t, cmdID, c.GetCommandId())
	require.Equal(t, "inventory.refresh", c.GetKind())
	require.JSONEq(t, `{"verbose": true}`, string(c.GetArgsJson()))
	require.True(t, c.GetRetrySafe())
	require.NotNil(t, c.GetDeadline())

	row := e.command(cmdID)
	require.Equal(t, "delivered", row.State)
	require.Equal(t, 1, row.Deliveries)
	require.NotNil(t, row.DeliveredAt)
}

// A poke published straight to NATS (no outbox) works too, and a poke naming
// nodes this gateway does not hold is ignored.
func TestDirectPoke(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	cmdID := e.queueCommand(n.id, "logs.collect", "user")
	payload, err := json.Marshal(store.Poke{NodeIDs: []string{"node_unknown", n.id}})
	require.NoError(t, err)
	require.NoError(t, e.nc.Publish(store.SubjectPokeGatewayPrefix+"gw-test", []byte("not json")))
	require.NoError(t, e.nc.Publish(store.SubjectPokeGatewayPrefix+"gw-test", payload))
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
}

// TestPokeCopiesOfOneOutboxRowWakeOnce: the second copy of an outbox row's
// poke (the same store.OutboxIDHeader: the API's direct publish and the
// relay's) wakes no session, so no session claims again; a poke of another
// row, and one that names none, do.
func TestPokeCopiesOfOneOutboxRowWakeOnce(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	// The session's first delivery pass runs after Welcome, before the
	// handler reads the next message: once a heartbeat is answered, it is
	// over, and cannot claim the commands queued below (it would, under
	// load, and row 41's poke would then claim again after the second one
	// was queued).
	d.heartbeat(1, 0)
	require.Equal(t, int64(1), d.nextAck())
	poke := func(row string) {
		t.Helper()
		m := &nats.Msg{Subject: store.SubjectPokeGatewayPrefix + "gw-test", Data: pokeJSON(t, n.id), Header: nats.Header{}}
		if row != "" {
			m.Header.Set(store.OutboxIDHeader, row)
		}
		require.NoError(t, e.nc.PublishMsg(m))
		require.NoError(t, e.nc.Flush())
	}
	first := e.queueCommand(n.id, "logs.collect", "user")
	poke("41")
	require.Equal(t, first, d.next().GetCommand().GetCommandId())

	// A command queued since, which no poke of its own announced: the
	// copy of row 41 does not make the session claim it.
	second := e.queueCommand(n.id, "logs.collect", "user")
	poke("41")
	quiet := realClock.NewTimer(300 * time.Millisecond)
	defer quiet.Stop()
	select {
	case m := <-d.msgs:
		require.FailNow(t, "the copy of a poke woke the session", "%v", m)
	case <-quiet.C():
	}
	poke("42")
	require.Equal(t, second, d.next().GetCommand().GetCommandId())
	third := e.queueCommand(n.id, "logs.collect", "user")
	poke("")
	require.Equal(t, third, d.next().GetCommand().GetCommandId(), "a poke naming no row wakes")
}

func TestResyncDeliversWithoutPoke(t *testing.T) {
	t.Parallel()
	fake := clock.NewFake(realClock.Now())
	e := setup(t, options{clock: fake})
	g := e.startGateway(gateway.Config{ResyncInterval: 5 * time.Second, IdleTimeout: time.Hour})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	// The session's first delivery pass runs after Welcome, before the
	// handler reads the next message: once a heartbeat is answered, that
	// pass is over, and a command queued now waits for a poke or a resync.
	d.heartbeat(1, 0)
	require.Equal(t, int64(1), d.nextAck())

	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	require.Equal(t, "queued", e.command(cmdID).State)
	got := make(chan *gatewayv1.Command, 1)
	go func() {
		m, ok := <-d.msgs
		if ok {
			got <- m.GetCommand()
		}
	}()
	var c *gatewayv1.Command
	eventually(t, func() bool {
		select {
		case c = <-got:
			return true
		default:
			fake.Advance(5 * time.Second)
			return false
		}
	}, "the periodic re-read delivers the command")
	require.Equal(t, cmdID, c.GetCommandId())
	require.Equal(t, "delivered", e.command(cmdID).State)
}

func TestNewSessionRedeliversOpenCommands(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	queued := e.queueCommand(n.id, "diag.nvml", "user")
	running := e.insertCommand(storetest.CommandOpts{NodeID: n.id, Kind: store.CommandLogsCollect, State: "running", Deliveries: 1})
	done := e.insertCommand(storetest.CommandOpts{NodeID: n.id, Kind: store.CommandInventoryRefresh, State: "succeeded"})

	d, _ := e.connect(g, n, nil)
	require.Equal(t, queued, d.next().GetCommand().GetCommandId())
	require.Equal(t, running, d.next().GetCommand().GetCommandId())
	require.Equal(t, "delivered", e.command(queued).State)
	r := e.command(running)
	require.Equal(t, "running", r.State, "redelivery never moves a command back")
	require.Equal(t, 2, r.Deliveries)
	require.Equal(t, 0, e.command(done).Deliveries)
}

func TestCommandUpdatesMoveForwardOnly(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	d, _ := e.connect(g, n, nil)
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())

	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_RUNNING, nil, "")
	eventually(t, func() bool { return e.command(cmdID).State == "running" }, "running stored")
	require.Nil(t, e.command(cmdID).FinishedAt)

	result := &gatewayv1.CommandResult{Inventory: &gatewayv1.Inventory{Hostname: "h1", CpuCores: 64, Gpus: []*gatewayv1.Gpu{
		{Index: 0, Uuid: "GPU-1", Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 80 << 30, Healthy: true}}}}
	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, result, "")
	eventually(t, func() bool { return e.command(cmdID).State == "succeeded" }, "succeeded stored")
	row := e.command(cmdID)
	require.NotNil(t, row.FinishedAt)
	want, err := protojson.Marshal(result)
	require.NoError(t, err)
	require.JSONEq(t, string(want), string(row.Result))
	var back gatewayv1.CommandResult
	require.NoError(t, protojson.Unmarshal(row.Result, &back))
	require.True(t, proto.Equal(result, &back))

	// Late and contradicting updates change nothing; an update of a command
	// of another node or of no command is ignored.
	other := e.newNode()
	otherCmd := e.queueCommand(other.id, "diag.nvml", "user")
	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_FAILED, nil, "boom")
	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_RUNNING, nil, "")
	d.update(otherCmd, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, nil, "")
	d.update("cmd_missing", gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, nil, "")
	d.observed(5) // processed after the updates: a marker that they were handled
	eventually(t, func() bool { return e.nodeRow(n.id).Observed == 5 }, "report stored")
	after := e.command(cmdID)
	require.Equal(t, "succeeded", after.State)
	require.Equal(t, "", after.Error)
	require.Equal(t, row.FinishedAt, after.FinishedAt)
	require.Equal(t, "queued", e.command(otherCmd).State)

	// A failure stores its error.
	failing := e.queueCommand(n.id, "logs.collect", "user")
	require.NoError(t, e.nc.Publish(store.SubjectPokeGatewayPrefix+"gw-test", pokeJSON(t, n.id)))
	require.Equal(t, failing, d.next().GetCommand().GetCommandId())
	d.update(failing, gatewayv1.CommandState_COMMAND_STATE_FAILED, nil, "journal lost; not retry-safe")
	eventually(t, func() bool { return e.command(failing).State == "failed" }, "failed stored")
	require.Equal(t, "journal lost; not retry-safe", e.command(failing).Error)
}

func TestAcceptanceTerminalUpdatePokesControllers(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	pokes, err := e.nc.SubscribeSync(store.SubjectPokeControllers)
	require.NoError(t, err)
	require.NoError(t, e.nc.Flush())
	g := e.startGateway(noResync)
	n := e.newNode()
	cmdID := e.queueCommand(n.id, "diag.nvml", "acceptance")
	user := e.queueCommand(n.id, "inventory.refresh", "user")
	d, _ := e.connect(g, n, nil)
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
	require.Equal(t, user, d.next().GetCommand().GetCommandId())

	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_RUNNING, nil, "")
	d.update(user, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, nil, "")
	eventually(t, func() bool { return e.command(user).State == "succeeded" }, "user command done")
	require.Equal(t, 0, e.outboxCount(store.SubjectPokeControllers), "only an acceptance command's terminal update pokes")

	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, &gatewayv1.CommandResult{Inventory: &gatewayv1.Inventory{}}, "")
	eventually(t, func() bool { return e.command(cmdID).State == "succeeded" }, "acceptance command done")
	require.Equal(t, 1, e.outboxCount(store.SubjectPokeControllers))

	// A repeated terminal update does not poke again.
	d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, nil, "")
	d.observed(1)
	eventually(t, func() bool { return e.nodeRow(n.id).Observed == 1 }, "marker handled")
	require.Equal(t, 1, e.outboxCount(store.SubjectPokeControllers))

	// The relay (started only now: it deletes the rows it publishes)
	// delivers the poke.
	e.relay()
	m, err := pokes.NextMsg(waitFor)
	require.NoError(t, err)
	var p store.Poke
	require.NoError(t, json.Unmarshal(m.Data, &p))
	require.Equal(t, []string{n.id}, p.NodeIDs)
	eventually(t, func() bool {
		var rows int
		err := e.db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE subject = $1`,
			store.SubjectPokeControllers).Scan(&rows)
		return err == nil && rows == 0
	}, "published poke deleted")
}

func TestDesiredStateAndObservedGeneration(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	e.relay()
	g := e.startGateway(noResync)
	n := e.newNodeWith(storetest.NodeOpts{SpecGeneration: 2, Spec: `{"labels": {"rack": "r1"}}`}, time.Time{})

	d, _ := e.connect(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "b", ObservedGeneration: 1})
	ds := d.next().GetDesiredState()
	require.NotNil(t, ds)
	require.EqualValues(t, 2, ds.GetGeneration())
	require.Equal(t, map[string]string{"rack": "r1"}, ds.GetSpec().GetLabels())
	require.EqualValues(t, 1, e.nodeRow(n.id).Observed, "hello's observed generation is stored")

	d.observed(2)
	eventually(t, func() bool { return e.nodeRow(n.id).Observed == 2 }, "observed generation stored")
	d.observed(1)
	d.heartbeat(1, 1)

	// A new generation is sent after its poke; an older report never lowers
	// the stored generation. Here a reservation placed on devices 0 and 1
	// makes it (RebuildNodeSpecs pokes the node's gateway).
	storetest.Reservation(t, e.db, &storetest.ReservationOpts{TenantID: e.tenantID, PoolID: e.poolID, GPUs: 2,
		State: store.ReservationBinding, NodeID: n.id, DeviceIndexes: []int32{0, 1}})
	require.NoError(t, e.db.InTx(t.Context(), func(tx pgx.Tx) error {
		_, err := store.RebuildNodeSpecs(t.Context(), tx, nil, e.db.Now(), []string{n.id})
		return err
	}))
	ds = d.next().GetDesiredState()
	require.NotNil(t, ds)
	require.EqualValues(t, 3, ds.GetGeneration())
	require.Len(t, ds.GetSpec().GetAllocations(), 1)
	require.Equal(t, []int32{0, 1}, ds.GetSpec().GetAllocations()[0].GetDeviceIndexes())
	require.EqualValues(t, 2, e.nodeRow(n.id).Observed)

	// Once sent, a generation is not sent again in this session: the next
	// message after a poke is the command, not the spec.
	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	require.NoError(t, e.nc.Publish(store.SubjectPokeGatewayPrefix+"gw-test", pokeJSON(t, n.id)))
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
}

// TestAllocationBoundActivates: a daemon's AllocationBound turns its binding
// reservation active with the binding, a reservation.active event and the
// created→active latency in bc.reservations.activation, when its generation
// carries the reservation; a stale generation, another node's report and an
// unknown reservation change nothing and the session goes on. The reports
// of many sessions at once are written in batches
// (store.ActivateReservations), each activated once.
func TestAllocationBoundActivates(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	m, err := telemetry.NewMetrics(t.Context(), telemetry.ExporterPrometheus, "gateway")
	require.NoError(t, err)
	e.metrics = m
	g := e.startGateway(noResync)
	bound := func(id string, gen int64, cdi ...string) *gatewayv1.SessionRequest {
		return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
			Report: &gatewayv1.Report_AllocationBound{AllocationBound: &gatewayv1.AllocationBound{ReservationId: id,
				CdiDevices: cdi, Generation: gen}}}}}
	}
	state := func(id string) (string, []string) {
		var (
			st      string
			binding []string
		)
		require.NoError(t, e.db.Pool.QueryRow(t.Context(), `SELECT state, binding FROM reservations WHERE id = $1`, id).
			Scan(&st, &binding))
		return st, binding
	}
	const sessions = 12
	var (
		daemons []*daemon
		resIDs  []string
	)
	for range sessions {
		n := e.newNodeWith(storetest.NodeOpts{SpecGeneration: 2}, time.Time{})
		d, _ := e.connect(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "b", ObservedGeneration: 2})
		r := storetest.Reservation(t, e.db, &storetest.ReservationOpts{TenantID: e.tenantID, PoolID: e.poolID, GPUs: 1,
			State: store.ReservationBinding, NodeID: n.id, SpecGeneration: 2})
		daemons, resIDs = append(daemons, d), append(resIDs, r.ID)
	}

	// Stale, foreign and unknown reports change nothing.
	d0 := daemons[0]
	d0.send(bound(resIDs[0], 1, "nvidia.com/gpu=0"))
	d0.send(bound(resIDs[1], 2, "nvidia.com/gpu=0"))
	d0.send(bound("res_01JUNKNOWN000000000000000", 2))
	d0.heartbeat(1, 2)
	require.Equal(t, int64(1), d0.nextAck(), "the session goes on")
	st, _ := state(resIDs[0])
	require.Equal(t, store.ReservationBinding, st)

	// Every session reports at once.
	var wg sync.WaitGroup
	for i, d := range daemons {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.send(bound(resIDs[i], 2, fmt.Sprintf("nvidia.com/gpu=%d", i)))
		}()
	}
	wg.Wait()
	for i, id := range resIDs {
		eventually(t, func() bool { st, _ := state(id); return st == store.ReservationActive }, "reservation "+id+" active")
		_, binding := state(id)
		require.Equal(t, []string{fmt.Sprintf("nvidia.com/gpu=%d", i)}, binding)
	}
	var events int
	require.NoError(t, e.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM events WHERE type = $1 AND subject_id = ANY($2)`,
		store.EventReservationActive, resIDs).Scan(&events))
	require.Equal(t, sessions, events)
	// A report again, now that it is active, changes nothing.
	d0.send(bound(resIDs[0], 3, "nvidia.com/gpu=7"))
	d0.heartbeat(2, 3)
	require.Equal(t, int64(2), d0.nextAck())
	_, binding := state(resIDs[0])
	require.Equal(t, []string{"nvidia.com/gpu=0"}, binding)

	rec := httptest.NewRecorder()
	m.Handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	var count string
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		if strings.HasPrefix(line, "bc_reservations_activation_seconds_count") {
			count = line[strings.LastIndex(line, " ")+1:]
		}
	}
	require.Equal(t, fmt.Sprint(sessions), count, "one latency per activation")
}

// A daemon that already has the spec gets no DesiredState on Hello.
func TestNoDesiredStateWhenDaemonIsCurrent(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNodeWith(storetest.NodeOpts{SpecGeneration: 4, ObservedGeneration: 4, Spec: `{}`}, time.Time{})
	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	d, _ := e.connect(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "b", ObservedGeneration: 4})
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
	// A daemon that lost its state (reports 0) gets the spec again even
	// though the database says 4 was observed.
	d.close()
	d2, _ := e.connect(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "b2", ObservedGeneration: 0})
	m := d2.next()
	if m.GetCommand() != nil { // redelivered in-flight command first
		m = d2.next()
	}
	require.EqualValues(t, 4, m.GetDesiredState().GetGeneration())
}

func TestHeartbeatsUpdateLastSeen(t *testing.T) {
	t.Parallel()
	start := realClock.Now().Truncate(time.Second)
	fake := clock.NewFake(start)
	e := setup(t, options{clock: fake})
	g := e.startGateway(gateway.Config{FlushInterval: time.Second, IdleTimeout: time.Hour, ResyncInterval: time.Hour})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	require.True(t, e.nodeRow(n.id).LastSeen.Equal(start))

	// Half a heartbeat interval (5 s) after the open's.
	fake.Advance(6 * time.Second)
	d.heartbeat(1, 0)
	d.heartbeat(2, 0)
	eventually(t, func() bool {
		fake.Advance(10 * time.Millisecond) // fires the flush ticker once it is due
		ls := e.nodeRow(n.id).LastSeen
		return ls != nil && !ls.Before(start.Add(6*time.Second))
	}, "last_seen follows heartbeats")

	// The generation a heartbeat reports is flushed with it.
	d.heartbeat(3, 6)
	eventually(t, func() bool {
		fake.Advance(time.Second)
		return e.nodeRow(n.id).Observed == 6
	}, "heartbeat's observed generation stored")
}

// TestLastSeenCoalesced: a session's hearings less than half a heartbeat
// interval after the last one written (its open, then each written) are not
// written, unless they report a generation above the one written; the first
// one past it is. A join's burst of messages wrote its node's last_seen at
// every flush.
func TestLastSeenCoalesced(t *testing.T) {
	t.Parallel()
	start := realClock.Now().Truncate(time.Second)
	fake := clock.NewFake(start)
	e := setup(t, options{clock: fake})
	g := e.startGateway(gateway.Config{FlushInterval: time.Second, HeartbeatInterval: 10 * time.Second, IdleTimeout: time.Hour,
		ResyncInterval: time.Hour})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	require.True(t, e.nodeRow(n.id).LastSeen.Equal(start))
	seq := int64(0)
	// hear sends two heartbeats reporting gen at start+at (the clock is
	// before it) and waits for a flush a second later (on a tick of the
	// flush's, a whole second after start).
	hear := func(at time.Duration, gen int64) {
		t.Helper()
		fake.Set(start.Add(at))
		seq++
		d.heartbeat(seq, gen)
		require.Equal(t, seq, d.nextAck())
		// The handler records after the acknowledgement: a second
		// heartbeat's acknowledgement comes after the first's record.
		seq++
		d.heartbeat(seq, gen)
		require.Equal(t, seq, d.nextAck())
		flushed := start.Add(at + time.Second + store.GatewayPresenceTTL)
		eventually(t, func() bool {
			fake.Advance(10 * time.Millisecond)
			var expires time.Time
			require.NoError(t, e.db.Pool.QueryRow(t.Context(), `SELECT expires_at FROM leases WHERE name = 'gateway.gw-test'`).
				Scan(&expires))
			return !expires.Before(flushed)
		}, "a flush after the heartbeats")
	}
	seen := func() time.Time {
		t.Helper()
		ls := e.nodeRow(n.id).LastSeen
		require.NotNil(t, ls)
		return ls.UTC()
	}

	hear(3*time.Second, 0)
	require.Equal(t, start.UTC(), seen(), "3 s after the open: not written")
	hear(4500*time.Millisecond, 6)
	require.Equal(t, start.Add(4500*time.Millisecond).UTC(), seen(), "a higher generation is written at once")
	require.EqualValues(t, 6, e.nodeRow(n.id).Observed)
	hear(8*time.Second, 6)
	require.Equal(t, start.Add(4500*time.Millisecond).UTC(), seen(), "3.5 s after the last written: not written")
	hear(10500*time.Millisecond, 6)
	require.Equal(t, start.Add(10500*time.Millisecond).UTC(), seen(), "6 s after: written")
}

// TestHeartbeatsAreAcknowledged: Welcome says the gateway acknowledges
// heartbeats, and it answers each with its seq, so that a daemon can tell a
// gateway that stopped answering (hung, paused) from an idle one. Commands
// delivered meanwhile still arrive.
func TestHeartbeatsAreAcknowledged(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, w := e.connect(g, n, nil)
	require.NotEmpty(t, w.GetSessionId())
	for seq := int64(1); seq <= 3; seq++ {
		d.heartbeat(seq, 0)
		require.Equal(t, seq, d.nextAck())
	}
	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	require.NoError(t, e.nc.Publish(store.SubjectPokeGatewayPrefix+"gw-test", mustJSON(t, store.Poke{NodeIDs: []string{n.id}})))
	for seq := int64(4); seq <= 40; seq++ {
		d.heartbeat(seq, 0)
	}
	require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
	// Heartbeats are answered in order; one that met a delivery being sent
	// may go unanswered (the delivery answered it), those after are
	// answered again.
	last, seq := int64(3), int64(40)
	var disorder []int64
	var sendErr error
	eventually(t, func() bool {
		seq++
		if sendErr = d.stream.Send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Heartbeat{
			Heartbeat: &gatewayv1.Heartbeat{Seq: seq},
		}}); sendErr != nil {
			return true
		}
		for {
			select {
			case a := <-d.acks:
				if a <= last {
					disorder = append(disorder, a)
				}
				last = a
				continue
			default:
			}
			return last > 40
		}
	}, "heartbeats after the delivery are answered")
	require.NoError(t, sendErr)
	require.Empty(t, disorder, "acks out of order")
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

func TestCertificateForAnotherNodeIsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	a, b := e.newNode(), e.newNode()
	d := e.open(g, a, &gatewayv1.Hello{NodeId: b.id, BootId: "x"})
	err := d.ended()
	require.Equal(t, connect.CodePermissionDenied, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "hello.node_id")
	require.Nil(t, e.nodeRow(b.id).SessionID)
	require.Nil(t, e.nodeRow(a.id).SessionID)
	require.EqualValues(t, 0, e.nodeRow(b.id).Epoch)
}

func TestUnknownOrRevokedCertificateIsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)

	unknown := e.newUnrecordedNode()
	d := e.open(g, unknown, &gatewayv1.Hello{NodeId: unknown.id})
	err := d.ended()
	require.Equal(t, connect.CodeUnauthenticated, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "not known")
	require.Nil(t, e.nodeRow(unknown.id).SessionID)

	revoked := e.newNodeWith(storetest.NodeOpts{}, e.db.Now())
	d = e.open(g, revoked, &gatewayv1.Hello{NodeId: revoked.id})
	err = d.ended()
	require.Equal(t, connect.CodeUnauthenticated, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "revoked")
	require.Nil(t, e.nodeRow(revoked.id).SessionID)

	// A certificate recorded for another node (serial reuse) is refused.
	other := e.newNode()
	spoof := e.newUnrecordedNode()
	storetest.NodeCert(t, e.db, &storetest.NodeCertOpts{NodeID: other.id, Serial: certSerial(spoof),
		PublicKeySHA256: pki.PublicKeySHA256(other.cert.Leaf), NotBefore: other.cert.Leaf.NotBefore,
		NotAfter: other.cert.Leaf.NotAfter})
	d = e.open(g, spoof, &gatewayv1.Hello{NodeId: spoof.id})
	err = d.ended()
	require.Equal(t, connect.CodeUnauthenticated, connectCode(err), "%v", err)
}

func TestBadFirstMessage(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d := e.open(g, n, nil)
	d.heartbeat(1, 0)
	err := d.ended()
	require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "hello")

	d = e.open(g, n, &gatewayv1.Hello{})
	err = d.ended()
	require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "hello.node_id")

	// A second Hello ends the session.
	d, _ = e.connect(g, n, nil)
	d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Hello{Hello: &gatewayv1.Hello{NodeId: n.id}}})
	err = d.ended()
	require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
}

func TestStreamWithoutHelloIsClosed(t *testing.T) {
	t.Parallel()
	fake := clock.NewFake(realClock.Now())
	e := setup(t, options{clock: fake})
	g := e.startGateway(gateway.Config{ResyncInterval: time.Second, HelloTimeout: 5 * time.Second, IdleTimeout: 20 * time.Second})
	// A framed session's connection opens with the reader's first
	// Receive, and sends nothing.
	silent := e.open(g, e.newNode(), nil)
	// Over Connect, Send(nil) opens the stream with headers only.
	n := e.newNode()
	silentConnect := e.openWith(e.client(g, n.cert), nil)
	require.NoError(t, silentConnect.stream.Send(nil))
	quiet, _ := e.connect(g, e.newNode(), nil)
	var silentErr, silentConnectErr, quietErr error
	eventually(t, func() bool {
		fake.Advance(time.Second)
		select {
		case silentErr = <-silent.err:
		case silentConnectErr = <-silentConnect.err:
		case quietErr = <-quiet.err:
		default:
		}
		return silentErr != nil && silentConnectErr != nil && quietErr != nil
	}, "streams without hello and silent sessions are closed")
	for _, err := range []error{silentErr, silentConnectErr} {
		require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err), "%v", err)
		require.Contains(t, err.Error(), "hello")
	}
	require.Equal(t, connect.CodeDeadlineExceeded, connectCode(quietErr), "%v", quietErr)
	require.Contains(t, quietErr.Error(), "idle")
}

func TestReconnectSupersedesOldSession(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	first, w1 := e.connect(g, n, nil)
	second, w2 := e.connect(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "boot-2"})
	require.EqualValues(t, 1, w1.GetSessionEpoch())
	require.EqualValues(t, 2, w2.GetSessionEpoch())
	require.NotEqual(t, w1.GetSessionId(), w2.GetSessionId())

	err := first.ended()
	require.Equal(t, connect.CodeAborted, connectCode(err), "%v", err)
	r := e.nodeRow(n.id)
	require.Equal(t, w2.GetSessionId(), *r.SessionID, "the old session's end leaves the new one")
	require.EqualValues(t, 2, r.Epoch)
	require.Equal(t, "boot-2", r.BootID)
	require.Equal(t, 1, g.srv.Sessions())

	cmdID := e.queueCommand(n.id, "diag.nvml", "user")
	require.NoError(t, e.nc.Publish(store.SubjectPokeGatewayPrefix+"gw-test", pokeJSON(t, n.id)))
	require.Equal(t, cmdID, second.next().GetCommand().GetCommandId())
}

func TestTakeoverByAnotherGateway(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	e.relay()
	ga := e.startGateway(gateway.Config{GatewayID: "gw-a", ResyncInterval: 100 * time.Millisecond})
	gb := e.startGateway(gateway.Config{GatewayID: "gw-b", ResyncInterval: time.Hour})
	n := e.newNode()
	onA, wa := e.connect(ga, n, nil)
	onB, wb := e.connect(gb, n, nil)
	require.EqualValues(t, wa.GetSessionEpoch()+1, wb.GetSessionEpoch())

	// Gateway A notices on its next re-read and ends its stream, without
	// clearing B's session.
	err := onA.ended()
	require.Equal(t, connect.CodeAborted, connectCode(err), "%v", err)
	eventually(t, func() bool { return ga.srv.Sessions() == 0 }, "A dropped its session")
	r := e.nodeRow(n.id)
	require.Equal(t, "gw-b", *r.GatewayID)
	require.Equal(t, wb.GetSessionId(), *r.SessionID)

	// Pokes now go to B.
	cmdID := e.queueCommand(n.id, "inventory.refresh", "user")
	require.NoError(t, e.db.InTx(t.Context(), func(tx pgx.Tx) error {
		return store.PokeNodes(t.Context(), tx, e.db.Now(), n.id)
	}))
	require.Equal(t, cmdID, onB.next().GetCommand().GetCommandId())
}

// The old gateway's stream ending after a takeover (the daemon closes it)
// does not clear the new session.
func TestOldStreamEndAfterTakeover(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	ga := e.startGateway(gateway.Config{GatewayID: "gw-a", ResyncInterval: time.Hour})
	gb := e.startGateway(gateway.Config{GatewayID: "gw-b", ResyncInterval: time.Hour})
	n := e.newNode()
	onA, _ := e.connect(ga, n, nil)
	_, wb := e.connect(gb, n, nil)
	require.NoError(t, onA.stream.CloseRequest())
	// A's stream ends either way: by the daemon's close, or first by A's
	// delivery (woken at its Welcome) finding that B superseded it — a race
	// both orders of which are correct.
	if err := onA.ended(); err != nil {
		require.Equal(t, connect.CodeAborted, connectCode(err), "%v", err)
		require.Contains(t, err.Error(), "superseded")
	}
	eventually(t, func() bool { return ga.srv.Sessions() == 0 }, "A closed its session")
	r := e.nodeRow(n.id)
	require.Equal(t, "gw-b", *r.GatewayID)
	require.Equal(t, wb.GetSessionId(), *r.SessionID)
}

func TestShutdownClearsSessions(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	d.heartbeat(1, 0)
	require.EqualValues(t, 1, d.nextAck())
	g.stop()
	// The end of the stream says why.
	err := d.ended()
	require.Equal(t, connect.CodeUnavailable, connectCode(err), "%v", err)
	require.Contains(t, err.Error(), "shutting down")
	r := e.nodeRow(n.id)
	require.Nil(t, r.SessionID)
	require.Nil(t, r.GatewayID)
}

func TestPlainClientIsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	// TLS without a client certificate fails the handshake.
	var p http.Protocols
	p.SetHTTP2(true)
	tr := &http.Transport{TLSClientConfig: e.clientTLSWithoutCert(), Protocols: &p}
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr}).Get("https://" + g.addr + "/")
	if resp != nil {
		resp.Body.Close()
	}
	require.Error(t, err)
}

func TestHealth(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	hln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	e.startGateway(gateway.Config{Probes: service.Probes{HealthListener: hln}, ResyncInterval: time.Hour})
	eventually(t, func() bool {
		resp, err := http.Get("http://" + hln.Addr().String() + "/healthz")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode == http.StatusOK && strings.TrimSpace(string(b)) == "ok"
	}, "healthz answers ok")
}

func pokeJSON(t *testing.T, nodeIDs ...string) []byte {
	t.Helper()
	b, err := json.Marshal(store.Poke{NodeIDs: nodeIDs})
	require.NoError(t, err)
	return b
}

// TestFenceWhenFlushesHang holds a lock that blocks every last_seen flush
// (the presence write in the same transaction waits on it): a hung flush
// must count as a failed one (store.GatewayFlushTimeout), so the gateway
// aborts its sessions within store.GatewayFenceAfter plus a flush interval
// and a flush timeout, long
// before its presence (store.GatewayPresenceTTL) expires and the sweeper
// may judge its nodes (I4). Without a bound on the flush the gateway would
// keep hearing from nodes it can no longer vouch for.
func TestFenceWhenFlushesHang(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{})
	n := e.newNode()
	d, _ := e.connect(g, n, nil)
	d.heartbeat(1, 0)
	eventually(t, func() bool { return e.nodeRow(n.id).LastSeen != nil }, "the first flush")

	tx, err := e.db.Pool.Begin(t.Context())
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(t.Context(), `LOCK TABLE leases IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	locked := realClock.Now()
	// Heartbeats keep coming; the gateway must still fence, well before its
	// presence expires.
	hb := realClock.NewTicker(500 * time.Millisecond)
	defer hb.Stop()
	deadline := realClock.NewTimer(store.GatewayPresenceTTL - store.MinLivenessTimeout)
	defer deadline.Stop()
	for seq := int64(2); g.srv.Sessions() > 0; seq++ {
		select {
		case <-deadline.C():
			require.FailNow(t, "the gateway still holds its session", "%s after the lock", clock.Since(realClock, locked))
		case <-hb.C():
			// The fence may end the stream between the check and the send.
			_ = d.stream.Send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Heartbeat{Heartbeat: &gatewayv1.Heartbeat{Seq: seq}}})
		}
	}
	t.Logf("fenced %s after the lock", clock.Since(realClock, locked).Round(time.Millisecond))
	require.Error(t, d.ended(), "the fenced session ends with an error")
}

// TestFailedSessionCloseIsWrittenAgain ends a session while a lock blocks
// the write that clears it (nodes.session_id), so that the write times out:
// once the database is back, resync writes it again, and the node has no
// live session left that no gateway holds (the liveness sweeper never
// judges a node whose session a present gateway holds).
func TestFailedSessionCloseIsWrittenAgain(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(gateway.Config{ResyncInterval: 200 * time.Millisecond})
	n := e.newNode()
	d, w := e.connect(g, n, nil)
	eventually(t, func() bool { s := e.nodeRow(n.id).SessionID; return s != nil && *s == w.GetSessionId() }, "the session is recorded")

	tx, err := e.db.Pool.Begin(t.Context())
	require.NoError(t, err)
	_, err = tx.Exec(t.Context(), `LOCK TABLE nodes IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	d.close()
	// The close waits on the lock for its 5 s and gives up.
	require.Eventually(t, func() bool { return g.srv.Sessions() == 0 }, waitFor, 20*time.Millisecond)
	require.NoError(t, clock.Sleep(t.Context(), realClock, 6*time.Second))
	require.NoError(t, tx.Rollback(t.Context()))
	eventually(t, func() bool { return e.nodeRow(n.id).SessionID == nil }, "the close is written again")
}

// TestTextWithNUL: PostgreSQL's text and jsonb hold no NUL, which daemon
// strings may carry. gateway.proto's rules refuse a NUL (a control
// character) in every string of a Session message, free text or id, so no
// such string reaches the database: the session ends with InvalidArgument
// naming the field, nothing of the message is stored, and the other
// sessions of the gateway go on (the update batcher writes many sessions'
// updates in one statement, which one bad string would fail for all).
// Before, each failed its database write and ended the session with
// Unavailable.
func TestTextWithNUL(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	// in is e for subtest t: its helpers fail t.
	in := func(t *testing.T) *env { c := *e; c.t = t; return &c }
	bystander, _ := e.connect(g, e.newNode(), nil)

	t.Run("hello", func(t *testing.T) {
		e := in(t)
		n := e.newNode()
		d := e.open(g, n, &gatewayv1.Hello{NodeId: n.id, BootId: "boot\x00-1", AgentVersion: "bcd\x00/1"})
		err := d.ended()
		require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
		require.Contains(t, err.Error(), "hello.boot_id")
		require.Contains(t, err.Error(), "hello.agent_version")
		row := e.nodeRow(n.id)
		require.Empty(t, row.BootID, "nothing of the hello is stored")
	})

	t.Run("command update", func(t *testing.T) {
		e := in(t)
		n := e.newNode()
		cmdID := e.queueCommand(n.id, "logs.collect", "user")
		d, _ := e.connect(g, n, nil)
		require.Equal(t, cmdID, d.next().GetCommand().GetCommandId())
		d.update(cmdID, gatewayv1.CommandState_COMMAND_STATE_FAILED,
			&gatewayv1.CommandResult{Output: "out\x00put", Inventory: &gatewayv1.Inventory{Hostname: "h\x00"}}, "boom\x00")
		err := d.ended()
		require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
		for _, field := range []string{"command_update.error", "command_update.result.output", "command_update.result.inventory.hostname"} {
			require.Contains(t, err.Error(), field)
		}
		require.NotEqual(t, "failed", e.command(cmdID).State, "nothing of the update is stored")
	})

	t.Run("spec refusal", func(t *testing.T) {
		e := in(t)
		n := e.newNode()
		d, _ := e.connect(g, n, nil)
		d.send(&gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
			Report: &gatewayv1.Report_SpecRefused{SpecRefused: &gatewayv1.SpecRefused{Generation: 4, Reason: "bad\x00sig"}}}}})
		err := d.ended()
		require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
		require.Contains(t, err.Error(), "report.spec_refused.reason")
		var n64 int
		require.NoError(t, e.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM events WHERE type = $1 AND subject_id = $2`,
			store.EventNodeSpecRefused, n.id).Scan(&n64))
		require.Zero(t, n64, "nothing of the refusal is stored")
	})

	for _, tc := range []struct {
		name, field string
		msg         *gatewayv1.SessionRequest
	}{
		{"command id", "command_update.command_id", &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{
			CommandUpdate: &gatewayv1.CommandUpdate{CommandId: "cmd_\x00", State: gatewayv1.CommandState_COMMAND_STATE_RUNNING}}}},
		{"reservation id", "report.allocation_bound.reservation_id", &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{
			Report: &gatewayv1.Report{Report: &gatewayv1.Report_AllocationBound{AllocationBound: &gatewayv1.AllocationBound{
				ReservationId: "res_\x00", Generation: 1}}}}}},
		{"cdi device", "report.allocation_bound.cdi_devices[1]", &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{
			Report: &gatewayv1.Report{Report: &gatewayv1.Report_AllocationBound{AllocationBound: &gatewayv1.AllocationBound{
				ReservationId: "res_01JNUL0000000000000000000", CdiDevices: []string{"nvidia.com/gpu=0", "nvidia.com/gpu=\x00"},
				Generation: 1}}}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := in(t)
			n := e.newNode()
			d, _ := e.connect(g, n, nil)
			d.send(tc.msg)
			err := d.ended()
			require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
			require.Contains(t, err.Error(), tc.field)
		})
	}

	// The other session of the gateway went on through all of it.
	bystander.heartbeat(1, 0)
	require.Equal(t, int64(1), bystander.nextAck())
}
