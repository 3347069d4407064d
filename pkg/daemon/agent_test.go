package daemon_test

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
)

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// countingHW counts how often each command kind ran; run, when set, runs
// the commands instead of the fake machine.
type countingHW struct {
	*fakehw.Machine
	runs map[string]int
	run  func(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error)
}

func (c *countingHW) Run(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error) {
	c.runs[kind]++
	if c.run != nil {
		return c.run(kind, args)
	}
	return c.Machine.Run(kind, args)
}

// harness drives one Agent with a hand-moved clock and an in-memory
// transport that records what the Agent sends.
type harness struct {
	t       *testing.T
	a       *daemon.Agent
	hw      *countingHW
	j       *daemon.MemoryJournal
	cfg     daemon.Config
	seed    uint64
	now     time.Time
	timer   time.Time
	session uint64 // last dialed session
	sent    []*gatewayv1.SessionRequest
	log     []string
	closed  []daemon.Effect
	reboots []string
	csrs    int             // EffectMakeCSR seen
	certs   []daemon.Effect // EffectCertificate seen
	stops   []daemon.Effect // EffectStop seen
	// manualAcks: the test answers heartbeats itself (ackHeartbeats), or
	// not at all (a silent gateway). Otherwise the harness answers each as
	// a live gateway does, and the sent heartbeat stays in sent.
	manualAcks bool
}

func newHarness(t *testing.T, cfg daemon.Config, seed uint64) *harness {
	t.Helper()
	m, err := fakehw.New("hgx-h100", "machine-1")
	require.NoError(t, err)
	h := &harness{t: t, hw: &countingHW{Machine: m, runs: map[string]int{}}, j: daemon.NewMemoryJournal(), now: t0, seed: seed}
	if cfg.NodeID == "" {
		cfg.NodeID = "node_1"
	}
	h.cfg = cfg
	h.a, err = daemon.New(cfg, h.hw, h.j, rand.New(rand.NewPCG(seed, 1)))
	require.NoError(t, err)
	return h
}

// restart replaces the Agent by a new one on the same hardware and journal,
// as after a crash, and starts it.
func (h *harness) restart() {
	var err error
	h.a, err = daemon.New(h.cfg, h.hw, h.j, rand.New(rand.NewPCG(h.seed, 2)))
	require.NoError(h.t, err)
	h.timer = time.Time{}
	h.apply(h.a.Start(h.now))
}

func (h *harness) apply(effects []daemon.Effect) {
	var acks []int64
	for _, e := range effects {
		h.log = append(h.log, h.now.Sub(t0).String()+" "+e.String())
		switch e.Kind {
		case daemon.EffectSend:
			require.Equal(h.t, h.session, e.Session, "send on a session other than the last dialed")
			h.sent = append(h.sent, e.Msg)
			if hb := e.Msg.GetHeartbeat(); hb != nil && !h.manualAcks {
				acks = append(acks, hb.GetSeq())
			}
		case daemon.EffectDial:
			h.session = e.Session
		case daemon.EffectClose:
			h.closed = append(h.closed, e)
		case daemon.EffectTimer:
			h.timer = e.At
		case daemon.EffectReboot:
			h.reboots = append(h.reboots, e.BootID)
		case daemon.EffectMakeCSR:
			h.csrs++
		case daemon.EffectCertificate:
			h.certs = append(h.certs, e)
		case daemon.EffectStop:
			h.stops = append(h.stops, e)
		}
	}
	for _, seq := range acks {
		h.receive(&gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_HeartbeatAck{HeartbeatAck: &gatewayv1.HeartbeatAck{Seq: seq}}})
	}
}

// advance moves the clock by d, calling Tick whenever the requested timer
// comes due on the way.
func (h *harness) advance(d time.Duration) {
	end := h.now.Add(d)
	for !h.timer.IsZero() && !h.timer.After(end) {
		h.now = h.timer
		h.timer = time.Time{}
		h.apply(h.a.Tick(h.now))
	}
	h.now = end
}

// take returns and forgets what was sent.
func (h *harness) take() []*gatewayv1.SessionRequest {
	s := h.sent
	h.sent = nil
	return s
}

func (h *harness) connect() {
	h.apply(h.a.Connected(h.now, h.session))
}

func (h *harness) receive(m *gatewayv1.SessionResponse) {
	h.apply(h.a.Receive(h.now, h.session, m))
}

func (h *harness) welcome(hb time.Duration) {
	h.receive(&gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Welcome{Welcome: &gatewayv1.Welcome{
		SessionId: "ses_1", GatewayId: "gw-1", HeartbeatInterval: durationpb.New(hb), SessionEpoch: 1,
	}}})
}

// establish starts (if idle), connects and welcomes, and drops the Hello.
func (h *harness) establish() *gatewayv1.Hello {
	if h.a.Status().State == daemon.StateIdle {
		h.apply(h.a.Start(h.now))
	}
	require.Equal(h.t, daemon.StateDialing, h.a.Status().State)
	h.take()
	h.connect()
	sent := h.take()
	require.Len(h.t, sent, 1)
	hello := sent[0].GetHello()
	require.NotNil(h.t, hello)
	h.welcome(10 * time.Second)
	require.Equal(h.t, daemon.StateEstablished, h.a.Status().State)
	return hello
}

func (h *harness) disconnect() {
	h.apply(h.a.Disconnected(h.now, h.session, errors.New("stream reset")))
}

// redial waits for the backoff to pass and establishes a new session.
func (h *harness) redial() *gatewayv1.Hello {
	require.Equal(h.t, daemon.StateBackoff, h.a.Status().State)
	h.advance(h.a.Status().NextDial.Sub(h.now))
	return h.establish()
}

func cmd(id, kind string, deadline time.Time, retrySafe bool) *gatewayv1.SessionResponse {
	c := &gatewayv1.Command{CommandId: id, Kind: kind, RetrySafe: retrySafe}
	if !deadline.IsZero() {
		c.Deadline = timestamppb.New(deadline)
	}
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Command{Command: c}}
}

func desired(gen int64, allocs map[string][]int32, order ...string) *gatewayv1.SessionResponse {
	spec := &gatewayv1.NodeSpec{}
	for _, r := range order {
		spec.Allocations = append(spec.Allocations, &gatewayv1.Allocation{ReservationId: r, DeviceIndexes: allocs[r]})
	}
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_DesiredState{DesiredState: &gatewayv1.DesiredState{Generation: gen, Spec: spec}}}
}

func updates(msgs []*gatewayv1.SessionRequest) []*gatewayv1.CommandUpdate {
	var out []*gatewayv1.CommandUpdate
	for _, m := range msgs {
		if u := m.GetCommandUpdate(); u != nil {
			out = append(out, u)
		}
	}
	return out
}

func describe(msgs []*gatewayv1.SessionRequest) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = daemon.DescribeRequest(m)
	}
	return out
}

const (
	running   = gatewayv1.CommandState_COMMAND_STATE_RUNNING
	succeeded = gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED
	failed    = gatewayv1.CommandState_COMMAND_STATE_FAILED
)

func TestNewValidates(t *testing.T) {
	t.Parallel()
	m, err := fakehw.New("cpu", "m")
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(1, 1))
	j := daemon.NewMemoryJournal()
	_, err = daemon.New(daemon.Config{}, m, j, r)
	require.ErrorContains(t, err, "node id")
	_, err = daemon.New(daemon.Config{NodeID: "n"}, nil, j, r)
	require.ErrorContains(t, err, "hardware")
	_, err = daemon.New(daemon.Config{NodeID: "n"}, m, nil, r)
	require.ErrorContains(t, err, "journal")
	_, err = daemon.New(daemon.Config{NodeID: "n"}, m, j, nil)
	require.ErrorContains(t, err, "rand")
}

func TestHelloWelcomeHeartbeats(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{AgentVersion: "test-1"}, 1)
	h.apply(h.a.Start(h.now))
	require.Equal(t, uint64(1), h.session)
	require.Equal(t, daemon.StateDialing, h.a.Status().State)
	require.Nil(t, h.a.Start(h.now), "second Start does nothing")

	h.connect()
	require.Equal(t, daemon.StateHello, h.a.Status().State)
	sent := h.take()
	require.Len(t, sent, 1)
	hello := sent[0].GetHello()
	require.Equal(t, "node_1", hello.GetNodeId())
	require.Equal(t, h.hw.BootID(), hello.GetBootId())
	require.Equal(t, "test-1", hello.GetAgentVersion())
	require.Zero(t, hello.GetObservedGeneration())
	require.Empty(t, hello.GetJournal())

	h.welcome(5 * time.Second)
	st := h.a.Status()
	require.Equal(t, daemon.StateEstablished, st.State)
	require.Equal(t, "ses_1", st.SessionID)
	require.Equal(t, 5*time.Second, h.a.HeartbeatInterval())
	require.Equal(t, h.now.Add(5*time.Second), h.timer)

	h.advance(4 * time.Second)
	require.Empty(t, h.take())
	h.advance(1 * time.Second)
	beats := h.take()
	require.Len(t, beats, 1)
	require.Equal(t, int64(1), beats[0].GetHeartbeat().GetSeq())
	require.True(t, beats[0].GetHeartbeat().GetSentAt().AsTime().Equal(h.now))
	h.advance(10 * time.Second)
	beats = h.take()
	require.Len(t, beats, 2)
	require.Equal(t, int64(3), beats[1].GetHeartbeat().GetSeq())

	// A second Welcome is ignored; so are messages of another session.
	h.welcome(time.Second)
	require.Equal(t, 5*time.Second, h.a.HeartbeatInterval())
	require.Nil(t, h.a.Receive(h.now, 99, cmd("cmd_x", "diag.nvml", time.Time{}, true)))
	require.Nil(t, h.a.Disconnected(h.now, 99, nil))
	require.Equal(t, daemon.StateEstablished, h.a.Status().State)
}

func TestWelcomeWithoutIntervalUsesDefault(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{DefaultHeartbeat: 3 * time.Second}, 1)
	h.apply(h.a.Start(h.now))
	h.connect()
	h.receive(&gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Welcome{Welcome: &gatewayv1.Welcome{SessionId: "s"}}})
	require.Equal(t, 3*time.Second, h.a.HeartbeatInterval())
}

func TestHelloTimeoutReconnects(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{HelloTimeout: 2 * time.Second}, 1)
	h.apply(h.a.Start(h.now))
	h.connect()
	h.take()
	h.advance(2 * time.Second)
	require.Len(t, h.closed, 1)
	require.Equal(t, uint64(1), h.closed[0].Session)
	require.Contains(t, h.closed[0].Reason, "no Welcome")
	require.Equal(t, daemon.StateBackoff, h.a.Status().State)
	h.advance(250 * time.Millisecond)
	require.Equal(t, uint64(2), h.session)
	require.Equal(t, daemon.StateDialing, h.a.Status().State)
	// A late Connected of the old session is closed as stale.
	effects := h.a.Connected(h.now, 1)
	require.Equal(t, daemon.EffectClose, effects[0].Kind)
	require.Equal(t, uint64(1), effects[0].Session)
	require.Equal(t, daemon.StateDialing, h.a.Status().State)
}

func TestCommandRunsOnceAcrossRedelivery(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	id := ids.New(ids.Command, h.now)
	deadline := h.now.Add(time.Hour)

	h.receive(cmd(id, "diag.nvml", deadline, false))
	u := updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, running, u[0].GetState())
	e, ok := h.j.Get(id)
	require.True(t, ok, "journaled before it runs")
	require.Equal(t, running, e.State)
	require.Equal(t, 1, h.a.Status().Running)

	// Redelivered while running: RUNNING again, not a second run.
	h.receive(cmd(id, "diag.nvml", deadline, false))
	u = updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, running, u[0].GetState())

	h.advance(fakehw.DefaultDurations().ByKind["diag.nvml"])
	u = updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, succeeded, u[0].GetState())
	require.True(t, proto.Equal(h.hw.Inventory(), u[0].GetResult().GetInventory()))

	// Redelivered after it finished, also on a new session: the journal
	// answers with the same result.
	h.receive(cmd(id, "diag.nvml", deadline, false))
	u2 := updates(h.take())
	require.Len(t, u2, 1)
	require.True(t, proto.Equal(u[0], u2[0]))
	h.disconnect()
	hello := h.redial()
	require.Len(t, hello.GetJournal(), 1)
	require.Equal(t, id, hello.GetJournal()[0].GetCommandId())
	require.Equal(t, succeeded, hello.GetJournal()[0].GetState())
	h.receive(cmd(id, "diag.nvml", deadline, false))
	u3 := updates(h.take())
	require.Len(t, u3, 1)
	require.True(t, proto.Equal(u[0], u3[0]))

	require.Equal(t, 1, h.hw.runs["diag.nvml"])
}

// TestInstantCommandReportsOnlyItsOutcome: a command that finishes as it
// starts is journaled before it runs, as every command, and reported once,
// with its outcome (no RUNNING the outcome would supersede at once).
func TestInstantCommandReportsOnlyItsOutcome(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.hw.SetDurations(fakehw.Durations{ByKind: map[string]time.Duration{"diag.nvml": 0}})
	h.establish()
	id := ids.New(ids.Command, h.now)
	h.receive(cmd(id, "diag.nvml", h.now.Add(time.Hour), false))
	u := updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, succeeded, u[0].GetState())
	e, ok := h.j.Get(id)
	require.True(t, ok)
	require.Equal(t, succeeded, e.State)
	require.Equal(t, 1, h.hw.runs["diag.nvml"])
	require.Zero(t, h.a.Status().Running)

	// Redelivered: answered from the journal, not run again.
	h.receive(cmd(id, "diag.nvml", h.now.Add(time.Hour), false))
	u2 := updates(h.take())
	require.Len(t, u2, 1)
	require.True(t, proto.Equal(u[0], u2[0]))
	require.Equal(t, 1, h.hw.runs["diag.nvml"])
}

func TestCommandKinds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		kind, args string
		state      gatewayv1.CommandState
		check      func(t *testing.T, u *gatewayv1.CommandUpdate)
	}{
		{kind: "inventory.refresh", state: succeeded, check: func(t *testing.T, u *gatewayv1.CommandUpdate) {
			require.Len(t, u.GetResult().GetInventory().GetGpus(), 8)
		}},
		{kind: "logs.collect", args: `{"lines":3}`, state: succeeded, check: func(t *testing.T, u *gatewayv1.CommandUpdate) {
			require.Equal(t, 3, strings.Count(u.GetResult().GetOutput(), "\n"))
		}},
		{kind: "logs.collect", args: `{"lines":-1}`, state: failed, check: func(t *testing.T, u *gatewayv1.CommandUpdate) {
			require.Contains(t, u.GetError(), "lines must be")
			require.Nil(t, u.GetResult())
		}},
		{kind: "gpu.melt", state: failed, check: func(t *testing.T, u *gatewayv1.CommandUpdate) {
			require.Contains(t, u.GetError(), "unknown command kind")
		}},
	} {
		t.Run(tc.kind+tc.args, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, daemon.Config{}, 1)
			h.establish()
			id := ids.New(ids.Command, h.now)
			m := cmd(id, tc.kind, h.now.Add(time.Minute), true)
			m.GetCommand().ArgsJson = []byte(tc.args)
			h.receive(m)
			h.advance(time.Second)
			u := updates(h.take())
			require.Len(t, u, 2)
			require.Equal(t, running, u[0].GetState())
			require.Equal(t, tc.state, u[1].GetState())
			tc.check(t, u[1])
			e, ok := h.j.Get(id)
			require.True(t, ok)
			require.Equal(t, tc.state, e.State)
		})
	}
}

func TestExpiredCommandDoesNotRun(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	id := ids.New(ids.Command, h.now.Add(-time.Hour))
	h.receive(cmd(id, "logs.collect", h.now.Add(-time.Second), false))
	u := updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, failed, u[0].GetState())
	require.Equal(t, daemon.ErrTextExpired, u[0].GetError())
	require.Zero(t, h.hw.runs["logs.collect"])
	e, ok := h.j.Get(id)
	require.True(t, ok)
	require.Equal(t, failed, e.State)
}

func TestJournalLoss(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	deadline := h.now.Add(time.Hour)
	// Both commands start; then the machine crashes and loses its journal.
	unsafeID := ids.New(ids.Command, h.now)
	safeID := ids.New(ids.Command, h.now)
	h.receive(cmd(unsafeID, "logs.collect", deadline, false))
	h.receive(cmd(safeID, "inventory.refresh", deadline, true))
	h.take()
	require.Equal(t, 1, h.hw.runs["logs.collect"])
	require.Equal(t, 1, h.hw.runs["inventory.refresh"])

	h.advance(100 * time.Millisecond)
	h.j.Wipe(h.now) // the crash takes the journal with it
	h.restart()
	hello := h.establish()
	require.Empty(t, hello.GetJournal())

	// The gateway redelivers both (they are still open there) and a new,
	// not retry-safe command made after the loss.
	h.advance(time.Second)
	newID := ids.New(ids.Command, h.now)
	h.receive(cmd(unsafeID, "logs.collect", deadline, false))
	h.receive(cmd(safeID, "inventory.refresh", deadline, true))
	h.receive(cmd(newID, "logs.collect", deadline, false))
	h.advance(time.Second)
	got := map[string][]gatewayv1.CommandState{}
	for _, u := range updates(h.take()) {
		got[u.GetCommandId()] = append(got[u.GetCommandId()], u.GetState())
		if u.GetCommandId() == unsafeID {
			require.Equal(t, daemon.ErrTextJournalLost, u.GetError())
		}
	}
	require.Equal(t, []gatewayv1.CommandState{failed}, got[unsafeID], "not retry-safe: failed, not run again")
	require.Equal(t, []gatewayv1.CommandState{running, succeeded}, got[safeID], "retry-safe: may run again")
	require.Equal(t, []gatewayv1.CommandState{running, succeeded}, got[newID], "issued after the loss: runs")
	require.Equal(t, 2, h.hw.runs["logs.collect"], "the unsafe command ran once, the new one once")
	require.Equal(t, 2, h.hw.runs["inventory.refresh"])

	// An id without a ULID time counts as issued before the loss.
	h.receive(cmd("cmd_not-a-ulid", "logs.collect", deadline, false))
	u := updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, failed, u[0].GetState())
}

// TestRestartFailsInterruptedCommands: a command that is not retry-safe,
// running when the daemon restarted, is failed as interrupted (retry-safe
// ones run again: TestRetrySafeCommandInterruptedRunsAgain).
func TestRestartFailsInterruptedCommands(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	id := ids.New(ids.Command, h.now)
	h.receive(cmd(id, "diag.nvml", h.now.Add(time.Hour), false))
	h.take()
	h.restart() // the process crashed while diag.nvml ran
	h.connect()
	hello := h.take()[0].GetHello()
	require.Equal(t, failed, hello.GetJournal()[0].GetState())
	h.welcome(10 * time.Second)
	u := updates(h.take())
	require.Len(t, u, 1, "the failure is reported after Welcome")
	require.Equal(t, id, u[0].GetCommandId())
	require.Equal(t, failed, u[0].GetState())
	require.Equal(t, daemon.ErrTextInterrupted, u[0].GetError())
	h.advance(time.Minute)
	require.Empty(t, updates(h.take()), "the old completion never fires")
	require.Equal(t, 1, h.hw.runs["diag.nvml"])
}

func TestCompletionWhileDisconnectedIsSentAfterWelcome(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	id := ids.New(ids.Command, h.now)
	h.receive(cmd(id, "diag.nvml", h.now.Add(time.Hour), false))
	h.take()
	h.disconnect()
	h.advance(time.Millisecond) // shorter than diag.nvml; the backoff may fire
	h.advance(time.Second)
	require.Empty(t, h.take())
	if h.a.Status().State == daemon.StateBackoff {
		h.advance(h.a.Status().NextDial.Sub(h.now))
	}
	h.connect()
	require.NotNil(t, h.take()[0].GetHello())
	h.welcome(10 * time.Second)
	u := updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, succeeded, u[0].GetState())
	require.Equal(t, id, u[0].GetCommandId())
	// Sent once: the next Welcome does not repeat it.
	h.disconnect()
	h.redial()
	require.Empty(t, updates(h.take()))
}

func TestDesiredState(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	allocs := map[string][]int32{"res_a": {0, 1}, "res_b": {4}, "res_c": {2, 3}}

	h.receive(desired(1, allocs, "res_b", "res_a"))
	require.Equal(t, []string{
		"bound res_b nvidia.com/gpu=4 gen=1",
		"bound res_a nvidia.com/gpu=0,nvidia.com/gpu=1 gen=1",
		"observed 1",
	}, describe(h.take()))
	require.Equal(t, int64(1), h.a.Status().ObservedGeneration)
	require.Equal(t, 2, h.a.Status().Allocations)

	// The same generation again: only the observed report. Older: nothing.
	h.receive(desired(1, allocs, "res_b", "res_a"))
	require.Equal(t, []string{"observed 1"}, describe(h.take()))
	h.receive(desired(0, nil))
	require.Empty(t, h.take())

	// res_a goes, res_c comes, res_b stays.
	h.receive(desired(2, allocs, "res_c", "res_b"))
	require.Equal(t, []string{
		"unbound res_a gen=2",
		"bound res_c nvidia.com/gpu=2,nvidia.com/gpu=3 gen=2",
		"observed 2",
	}, describe(h.take()))
	require.Equal(t, []daemon.AllocationStatus{
		{ReservationID: "res_b", CDIDevices: []string{"nvidia.com/gpu=4"}},
		{ReservationID: "res_c", CDIDevices: []string{"nvidia.com/gpu=2", "nvidia.com/gpu=3"}},
	}, h.a.Allocations())

	h.advance(10 * time.Second)
	beats := h.take()
	require.Len(t, beats, 1)
	require.Equal(t, int64(2), beats[0].GetHeartbeat().GetObservedGeneration())

	// A new session says observed 2 in Hello and repeats the bindings.
	h.disconnect()
	hello := h.redial()
	require.Equal(t, int64(2), hello.GetObservedGeneration())
	require.Equal(t, []string{
		"bound res_b nvidia.com/gpu=4 gen=2",
		"bound res_c nvidia.com/gpu=2,nvidia.com/gpu=3 gen=2",
	}, describe(h.take()))
}

func TestNodeReboot(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{RebootDowntime: 3 * time.Second}, 1)
	h.establish()
	oldBoot := h.hw.BootID()
	deadline := h.now.Add(time.Hour)
	other := ids.New(ids.Command, h.now)
	h.receive(cmd(other, "logs.collect", deadline, false))
	h.receive(desired(1, map[string][]int32{"res_a": {0}}, "res_a"))
	h.take()
	h.advance(400 * time.Millisecond) // logs.collect done
	h.take()

	slow := ids.New(ids.Command, h.now)
	h.receive(cmd(slow, "diag.nvml", deadline, false)) // still running when the reboot arrives
	reboot := ids.New(ids.Command, h.now)
	h.receive(cmd(reboot, "node.reboot", deadline, false))
	h.advance(100 * time.Millisecond)
	require.Equal(t, daemon.StateEstablished, h.a.Status().State, "the reboot waits for diag.nvml")
	h.advance(700 * time.Millisecond)
	u := updates(h.take())
	require.Len(t, u, 4)
	require.Equal(t, slow, u[2].GetCommandId())
	require.Equal(t, succeeded, u[2].GetState(), "queued before the reboot: runs to its end")
	require.Equal(t, reboot, u[3].GetCommandId())
	require.Equal(t, succeeded, u[3].GetState(), "answered SUCCEEDED before going down")
	require.Len(t, h.closed, 1)
	require.Equal(t, "rebooting", h.closed[0].Reason)
	require.Equal(t, daemon.StateRebooting, h.a.Status().State)

	h.advance(3 * time.Second)
	require.Len(t, h.reboots, 1)
	require.NotEqual(t, oldBoot, h.reboots[0])
	require.Equal(t, h.reboots[0], h.hw.BootID())
	require.Equal(t, daemon.StateDialing, h.a.Status().State)
	h.connect()
	hello := h.take()[0].GetHello()
	require.Equal(t, h.reboots[0], hello.GetBootId())
	require.Equal(t, int64(1), hello.GetObservedGeneration(), "the applied spec survives the reboot")
	h.welcome(10 * time.Second)
	require.Equal(t, []string{"bound res_a nvidia.com/gpu=0 gen=1"}, describe(h.take()), "nothing was interrupted")

	// The gateway redelivers the reboot (it may not have stored SUCCEEDED):
	// answered from the journal, no second reboot.
	h.receive(cmd(reboot, "node.reboot", deadline, false))
	u = updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, succeeded, u[0].GetState())
	h.advance(time.Minute)
	require.Len(t, h.reboots, 1)
	require.Equal(t, 1, h.hw.runs["node.reboot"])
}

func TestBackoffBoundsAndReset(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 7)
	h.apply(h.a.Start(h.now))
	var delays []time.Duration
	for n := 1; n <= 12; n++ {
		h.disconnect() // dial failed
		st := h.a.Status()
		require.Equal(t, daemon.StateBackoff, st.State)
		d := st.NextDial.Sub(h.now)
		c := daemon.BackoffCap(250*time.Millisecond, 30*time.Second, n)
		require.GreaterOrEqual(t, d, time.Duration(0))
		require.LessOrEqual(t, d, c, "failure %d", n)
		delays = append(delays, d)
		h.advance(d)
		require.Equal(t, daemon.StateDialing, h.a.Status().State)
	}
	require.Equal(t, 30*time.Second, daemon.BackoffCap(250*time.Millisecond, 30*time.Second, 12))
	require.Equal(t, 8*time.Second, daemon.BackoffCap(250*time.Millisecond, 30*time.Second, 6))
	distinct := map[time.Duration]bool{}
	for _, d := range delays {
		distinct[d] = true
	}
	require.Greater(t, len(distinct), 6, "jittered delays differ: %v", delays)

	// A session that lasted less than BackoffResetAfter keeps growing the
	// backoff; one that lasted longer resets it.
	h.establish()
	h.advance(5 * time.Second)
	h.disconnect()
	require.LessOrEqual(t, h.a.Status().NextDial.Sub(h.now), 30*time.Second)
	h.redial()
	h.advance(31 * time.Second)
	h.disconnect()
	require.LessOrEqual(t, h.a.Status().NextDial.Sub(h.now), 250*time.Millisecond)
}

func TestBackoffJitterSpread(t *testing.T) {
	t.Parallel()
	// Over many agents, first-failure delays cover [0, 250ms].
	var lo, hi int
	for seed := range uint64(200) {
		h := newHarness(t, daemon.Config{}, seed)
		h.apply(h.a.Start(h.now))
		h.disconnect()
		d := h.a.Status().NextDial.Sub(h.now)
		require.LessOrEqual(t, d, 250*time.Millisecond)
		if d < 125*time.Millisecond {
			lo++
		} else {
			hi++
		}
	}
	require.Greater(t, lo, 50)
	require.Greater(t, hi, 50)
}

func TestJournalPruning(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{JournalRetention: time.Minute}, 1)
	h.establish()
	oldID := ids.New(ids.Command, h.now)
	h.receive(cmd(oldID, "inventory.refresh", h.now.Add(time.Minute), false))
	newID := ids.New(ids.Command, h.now)
	h.receive(cmd(newID, "inventory.refresh", h.now.Add(time.Hour), false))
	h.advance(time.Second)
	require.Equal(t, 2, h.j.Len())
	h.advance(5 * time.Minute)
	h.disconnect()
	h.redial() // pruning happens on connect
	require.Equal(t, 1, h.j.Len())
	_, ok := h.j.Get(newID)
	require.True(t, ok)
	// The pruned command, redelivered, is past its deadline: not run again.
	h.take()
	h.receive(cmd(oldID, "inventory.refresh", t0.Add(time.Minute), false))
	u := updates(h.take())
	require.Equal(t, failed, u[0].GetState())
	require.Equal(t, daemon.ErrTextExpired, u[0].GetError())
	require.Equal(t, 2, h.hw.runs["inventory.refresh"])
}

// scenario runs a fixed script with chaos-like inputs and returns the
// effect log.
func scenario(t *testing.T, seed uint64) []string {
	h := newHarness(t, daemon.Config{}, seed)
	h.establish()
	deadline := t0.Add(time.Hour)
	idsAt := []string{
		"cmd_01JAAAAAAAAAAAAAAAAAAAAAA1", "cmd_01JAAAAAAAAAAAAAAAAAAAAAA2",
		"cmd_01JAAAAAAAAAAAAAAAAAAAAAA3", "cmd_01JAAAAAAAAAAAAAAAAAAAAAA4",
	}
	h.receive(cmd(idsAt[0], "diag.nvml", deadline, false))
	h.receive(desired(1, map[string][]int32{"res_a": {0, 1}}, "res_a"))
	h.advance(300 * time.Millisecond)
	h.receive(cmd(idsAt[1], "logs.collect", deadline, true))
	for range 5 {
		h.disconnect()
		h.advance(h.a.Status().NextDial.Sub(h.now) + time.Millisecond)
		h.apply(h.a.Disconnected(h.now, h.session, errors.New("refused")))
		h.redial()
		h.receive(cmd(idsAt[0], "diag.nvml", deadline, false))
		h.advance(7 * time.Second)
	}
	h.receive(cmd(idsAt[2], "node.reboot", deadline, false))
	h.advance(20 * time.Second)
	h.connect()
	h.welcome(10 * time.Second)
	h.receive(cmd(idsAt[3], "inventory.refresh", deadline, false))
	h.receive(desired(2, map[string][]int32{"res_b": {5}}, "res_b"))
	h.advance(time.Minute)
	return h.log
}

func TestDeterminism(t *testing.T) {
	t.Parallel()
	a := scenario(t, 42)
	b := scenario(t, 42)
	require.Equal(t, a, b)
	require.Greater(t, len(a), 30)
	require.NotEqual(t, a, scenario(t, 43), "the seed drives the jitter")
}

func TestMemoryJournal(t *testing.T) {
	t.Parallel()
	j := daemon.NewMemoryJournal()
	require.True(t, j.LostAt().IsZero())
	for i := range 40 {
		require.NoError(t, j.Put(daemon.Entry{CommandID: "c" + string(rune('A'+i)), State: running}))
	}
	require.NoError(t, j.Put(daemon.Entry{CommandID: "cA", State: succeeded}))
	for i := 1; i < 39; i++ {
		require.NoError(t, j.Delete("c"+string(rune('A'+i))))
	}
	require.NoError(t, j.Put(daemon.Entry{CommandID: "cB", State: failed})) // re-added after delete
	var got []string
	for _, e := range j.Entries() {
		got = append(got, e.CommandID+"="+e.State.String())
	}
	require.Equal(t, []string{"cA=COMMAND_STATE_SUCCEEDED", "c" + string(rune('A'+39)) + "=COMMAND_STATE_RUNNING", "cB=COMMAND_STATE_FAILED"}, got)
	j.Wipe(t0)
	require.Zero(t, j.Len())
	require.Empty(t, j.Entries())
	require.Equal(t, t0, j.LostAt())
}
