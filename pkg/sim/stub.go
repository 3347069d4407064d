package sim

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/ids"
)

// The stub's timings, those of the real gateway and controllers.
const (
	// HeartbeatInterval is what Welcome tells daemons (the gateway's
	// default).
	HeartbeatInterval = 10 * time.Second
	// IdleTimeout closes a session the gateway heard nothing on for this
	// long (3 × HeartbeatInterval), checked every ResyncInterval.
	IdleTimeout = 3 * HeartbeatInterval
	// HelloTimeout closes a stream that sent no Hello for this long.
	HelloTimeout = 10 * time.Second
	// ResyncInterval is how often a gateway looks for silent streams.
	ResyncInterval = 5 * time.Second
	// LivenessTimeout is how long a node may go unheard (by last_seen as
	// flushed) before the sweeper marks it unreachable, when no present
	// gateway holds its live session (the controllers' default).
	LivenessTimeout = 30 * time.Second
	// FlushInterval is how often each gateway writes the last_seen of the
	// nodes it heard from and renews its presence.
	FlushInterval = time.Second
	// PresenceTTL is how long a gateway counts as present after a flush
	// (store.GatewayPresenceTTL).
	PresenceTTL = 30 * time.Second
	// CommandTimeout is every command's deadline from its creation.
	CommandTimeout = 5 * time.Minute
	// UsageInterval is how often the usage meter writes final windows.
	UsageInterval = time.Minute
	// Gateways is how many stub gateways a run has.
	Gateways = 3
)

// GatewayStub is the control plane's side of the Session protocol, in
// memory: gateways that accept sessions (Hello → Welcome, newest session
// wins), answer heartbeats (HeartbeatAck), deliver queued commands and the node's DesiredState (again, with
// the in-flight commands, on every new session), record command updates
// forward only, observed generations and the allocations each node
// reports bound (AllocationBound, checked by the progress check); a
// placement that books GPUs on one node (best fit) and bumps its NodeSpec
// generation; command and booking expiry at their deadline and end; the
// liveness design of pkg/store/liveness.go; and a usage meter writing
// per-reservation UTC-hour windows.
//
// Liveness is modelled as the real gateway and sweeper do it: a Hello
// writes the node's live session and last_seen at once (OpenSessions);
// every other message is batched per gateway and written every
// FlushInterval, and each flush renews that gateway's presence for
// PresenceTTL; a gateway that ends a session writes its last hearing
// (CloseSession) and clears the live session if it still is the node's; a
// killed gateway stops flushing, its unflushed hearings are lost, its
// sessions stay live in the table and its presence expires; back up, it
// clears its old sessions and raises their last_seen to its start
// (ResetGatewaySessions). The sweeper (every second, before that second's
// flushes) marks a node unreachable only when its last_seen is older than
// LivenessTimeout and no present gateway holds its live session. I4 is
// checked against the true hearings (RecHeard), so it tests that
// arithmetic under gateway kills, crashes and partitions.
//
// What the invariants exercise: I1 (devices a daemon holds), I2, I3 and
// the progress check test the daemon core; I4 tests the liveness model
// above; I1 (bookings), I5 and I8 check the stub's own placement, release
// and usage bookkeeping (they guard the simulator and its workload, not
// the control plane).
//
// It leaves out, on purpose: Postgres and NATS (state is one shared table,
// delivery is immediate so no poke is ever lost, and a flush never fails
// or lags, so the gateway's fence and a late batch never happen: presence
// matters only for a killed gateway); TLS, certificates, renewal,
// revocation and signed intent; join and acceptance (every node is adopted
// from the start); tenants, pools, quotas, cordons and pending
// reservations (a booking that does not fit now is dropped, not queued);
// the Hello journal (logged by the real gateway too, not used); and
// reports other than observed generation, AllocationBound and
// AllocationUnbound. It is a test double for the daemon side: the runs
// against the real control plane are the integration suites.
type GatewayStub struct {
	s        *Sim
	gateways []*stubGateway
	nodes    []*stubNode
	commands map[string]*command
	cmdQueue []*command // by creation, which is deadline order (one timeout for all)
	cmdHead  int
	live     []*booking // live bookings in creation order (ended ones removed lazily)
	usage    []*booking // bookings with usage windows left to write
	hb       *durationpb.Duration

	total, unplaced            int
	succeeded, failed, expired int
	sweepTimeout               time.Duration // LivenessTimeout, or a test's
}

type stubGateway struct {
	id       string
	alive    bool
	presence time.Duration // present until then (exclusive)
	pending  []*stubNode   // nodes heard from since the last flush, in order
}

// stubNode is the control plane's row of a node plus its gateway sessions.
type stubNode struct {
	idx       int32
	id        string
	owner     []*booking // by device index: the live booking holding it
	devices   int        // GPUs on the board
	free      int        // of them not booked
	streams   []*conn    // connections the gateways hold for it
	session   *conn      // its newest session past Hello
	epoch     int64
	lastSeen  time.Duration // as written to the table
	live      *conn         // the table's live session (session_id, gateway_id)
	reachable bool
	// Per gateway: the latest unflushed hearing and its connection.
	pendAt   [Gateways]time.Duration
	pendConn [Gateways]*conn

	specGen  int64
	spec     *gatewayv1.SessionResponse // DesiredState of specGen, built when first sent
	reported int64                      // what the session says the daemon observed
	sent     int64                      // generation sent on the session
	inFlight bool                       // the next delivery resends delivered and running commands
	lastObs  int64                      // last observed generation recorded
	open     []*command                 // commands not yet in a terminal state, by creation
	allocs   []*booking                 // live bookings, by reservation id
}

type cmdState uint8

const (
	cmdQueued cmdState = iota
	cmdDelivered
	cmdRunning
	cmdSucceeded
	cmdFailed
	cmdExpired
)

func (c cmdState) terminal() bool { return c >= cmdSucceeded }

var cmdStateNames = [...]string{"queued", "delivered", "running", "succeeded", "failed", "expired"}

type command struct {
	id        string
	node      *stubNode
	kind      string
	retrySafe bool
	deadline  time.Duration
	state     cmdState
	msg       *gatewayv1.SessionResponse
}

type booking struct {
	id         string
	node       *stubNode
	devices    []int32
	start, end time.Duration
	ended      bool
	next       time.Time // start of the next usage window to write
}

func newStub(s *Sim) *GatewayStub {
	g := &GatewayStub{s: s, commands: map[string]*command{}, hb: durationpb.New(HeartbeatInterval), sweepTimeout: LivenessTimeout}
	if s.cfg.sweepTimeout > 0 {
		g.sweepTimeout = s.cfg.sweepTimeout
	}
	for i := range Gateways {
		g.gateways = append(g.gateways, &stubGateway{id: "gw-" + strconv.Itoa(i), alive: true, presence: PresenceTTL})
	}
	return g
}

// addNode adds an adopted node with the GPUs of its inventory.
func (g *GatewayStub) addNode(n *node) {
	sn := &stubNode{idx: n.idx, id: n.id, reachable: true}
	maxIdx := int32(-1)
	gpus := n.hw.Inventory().GetGpus()
	for _, gpu := range gpus {
		maxIdx = max(maxIdx, gpu.GetIndex())
	}
	sn.owner = make([]*booking, maxIdx+1)
	for i := range sn.owner {
		if !n.hw.HasGPU(int32(i)) {
			sn.owner[i] = missingGPU
		}
	}
	sn.devices, sn.free = len(gpus), len(gpus)
	g.nodes = append(g.nodes, sn)
}

// missingGPU owns the indexes a board lacks, so they are never booked.
var missingGPU = &booking{id: "missing"}

func (g *GatewayStub) now() time.Duration { return g.s.eng.now }

func (g *GatewayStub) log(sn *stubNode, text string) { g.s.logNode(g.s.nodes[sn.idx], text) }

// pickGateway returns the index of a live gateway drawn uniformly (the load
// balancer in front of them).
func (g *GatewayStub) pickGateway() int {
	alive := 0
	for _, gw := range g.gateways {
		if gw.alive {
			alive++
		}
	}
	k := g.s.rng.IntN(alive)
	for i, gw := range g.gateways {
		if gw.alive {
			if k == 0 {
				return i
			}
			k--
		}
	}
	return 0
}

// accept opens the gateway's side of a connection.
func (g *GatewayStub) accept(c *conn) {
	c.gwOpen = true
	c.lastRecv = g.now()
	sn := g.nodes[c.n.idx]
	sn.streams = append(sn.streams, c)
}

// abort closes the gateway's side of c (it tells the node, if anything
// gets through).
func (g *GatewayStub) abort(c *conn, why string) {
	if !c.gwOpen {
		return
	}
	g.forget(c)
	g.closeSession(c)
	g.log(g.nodes[c.n.idx], fmt.Sprintf("%s closes conn %d: %s", g.gateways[c.gw].id, c.id, why))
	g.s.closeByGateway(c)
}

// forget drops c from its node's streams and session.
func (g *GatewayStub) forget(c *conn) {
	sn := g.nodes[c.n.idx]
	sn.streams = slices.DeleteFunc(sn.streams, func(x *conn) bool { return x == c })
	if sn.session == c {
		sn.session = nil
	}
}

// closed handles a connection the node closed or that broke.
func (g *GatewayStub) closed(c *conn) {
	if !c.gwOpen {
		return
	}
	c.gwOpen = false
	g.forget(c)
	g.closeSession(c)
	g.log(g.nodes[c.n.idx], fmt.Sprintf("%s saw conn %d end", g.gateways[c.gw].id, c.id))
}

// closeSession is a live gateway's CloseSession of c: the session's last
// hearing goes into last_seen, and the live session is cleared if c still
// is it.
func (g *GatewayStub) closeSession(c *conn) {
	if !c.helloed {
		return
	}
	sn := g.nodes[c.n.idx]
	sn.lastSeen = max(sn.lastSeen, c.lastRecv)
	if sn.live == c {
		sn.live = nil
	}
}

// heard batches a hearing on c for its gateway's next flush.
func (g *GatewayStub) heard(c *conn, sn *stubNode, at time.Duration) {
	gw := g.gateways[c.gw]
	if sn.pendConn[c.gw] == nil {
		gw.pending = append(gw.pending, sn)
	}
	sn.pendAt[c.gw], sn.pendConn[c.gw] = at, c
}

// flush is gateway k's last_seen flush: every batched hearing is written
// (a node whose live session it was is reachable again) and its presence
// renewed.
func (g *GatewayStub) flush(k int) {
	gw := g.gateways[k]
	for _, sn := range gw.pending {
		sn.lastSeen = max(sn.lastSeen, sn.pendAt[k])
		if !sn.reachable && sn.live == sn.pendConn[k] {
			sn.reachable = true
			g.s.record(Record{Kind: RecReachable, Node: sn.id})
			g.log(sn, "reachable")
		}
		sn.pendConn[k] = nil
	}
	clear(gw.pending)
	gw.pending = gw.pending[:0]
	gw.presence = g.now() + PresenceTTL
}

// receive handles a message that reached the gateway of c.
func (g *GatewayStub) receive(c *conn, m *gatewayv1.SessionRequest) {
	sn := g.nodes[c.n.idx]
	now := g.now()
	g.s.record(Record{Kind: RecHeard, Node: sn.id})
	if h := m.GetHello(); h != nil {
		c.lastRecv = now
		g.hello(c, sn, h)
		return
	}
	if !c.helloed {
		g.abort(c, "the first message is not Hello")
		return
	}
	c.lastRecv = now
	g.heard(c, sn, now)
	switch {
	case m.GetHeartbeat() != nil:
		g.observe(sn, m.GetHeartbeat().GetObservedGeneration(), false)
		// As the gateway does (HeartbeatAck).
		g.s.sendDown(c, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_HeartbeatAck{
			HeartbeatAck: &gatewayv1.HeartbeatAck{Seq: m.GetHeartbeat().GetSeq()},
		}})
	case m.GetCommandUpdate() != nil:
		g.update(sn, m.GetCommandUpdate())
	case m.GetReport() != nil:
		r := m.GetReport()
		switch {
		case r.GetAllocationBound() != nil:
			b := r.GetAllocationBound()
			g.log(sn, "gw bound "+b.GetReservationId()+" "+strings.Join(b.GetCdiDevices(), ","))
			g.s.record(Record{Kind: RecBound, Node: sn.id, Reservation: b.GetReservationId()})
		case r.GetAllocationUnbound() != nil:
			g.log(sn, "gw unbound "+r.GetAllocationUnbound().GetReservationId())
		case r.GetInventory() == nil && r.GetSpecRefused() == nil:
			g.observe(sn, r.GetObservedGeneration(), false)
		}
	}
}

func (g *GatewayStub) hello(c *conn, sn *stubNode, h *gatewayv1.Hello) {
	if c.helloed || h.GetNodeId() != sn.id {
		g.abort(c, "bad Hello")
		return
	}
	c.helloed = true
	sn.epoch++
	// OpenSessions: the live session, last_seen and reachable, at once.
	sn.live = c
	sn.lastSeen = max(sn.lastSeen, g.now())
	if !sn.reachable {
		sn.reachable = true
		g.s.record(Record{Kind: RecReachable, Node: sn.id})
		g.log(sn, "reachable")
	}
	older := sn.session
	sn.session = c
	if older != nil && older != c {
		g.abort(older, "superseded")
	}
	sn.reported, sn.sent, sn.inFlight = h.GetObservedGeneration(), 0, true
	g.observe(sn, h.GetObservedGeneration(), true)
	sid := ids.FromReader(ids.Session, g.s.time(), g.s.ids)
	g.log(sn, fmt.Sprintf("%s welcome conn %d %s epoch=%d", g.gateways[c.gw].id, c.id, sid, sn.epoch))
	g.s.sendDown(c, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Welcome{Welcome: &gatewayv1.Welcome{
		SessionId: sid, GatewayId: g.gateways[c.gw].id, HeartbeatInterval: g.hb, SessionEpoch: sn.epoch,
	}}})
	g.deliver(sn)
}

// observe takes an observed generation the daemon reported.
func (g *GatewayStub) observe(sn *stubNode, gen int64, hello bool) {
	sn.reported = max(sn.reported, gen)
	if hello || gen != sn.lastObs {
		sn.lastObs = gen
		g.s.record(Record{Kind: RecSpecObserved, Node: sn.id, Gen: gen})
	}
}

var updateStates = map[gatewayv1.CommandState]cmdState{
	gatewayv1.CommandState_COMMAND_STATE_DELIVERED: cmdDelivered,
	gatewayv1.CommandState_COMMAND_STATE_RUNNING:   cmdRunning,
	gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED: cmdSucceeded,
	gatewayv1.CommandState_COMMAND_STATE_FAILED:    cmdFailed,
}

// update records a command's new state, forward only; a terminal state is
// final.
func (g *GatewayStub) update(sn *stubNode, u *gatewayv1.CommandUpdate) {
	cmd := g.commands[u.GetCommandId()]
	st, ok := updateStates[u.GetState()]
	if cmd == nil || cmd.node != sn || !ok || cmd.state.terminal() || st <= cmd.state {
		return
	}
	cmd.state = st
	if st.terminal() {
		g.log(sn, "gw "+cmd.id+" "+cmdStateNames[st])
		sn.open = slices.DeleteFunc(sn.open, func(x *command) bool { return x == cmd })
		if st == cmdSucceeded {
			g.succeeded++
		} else {
			g.failed++
		}
		g.s.record(Record{Kind: RecCommandEnded, Node: sn.id, Command: cmd.id, State: cmdStateNames[st], Error: u.GetError()})
	}
}

// deliver sends the node's session what it does not have: queued commands
// (after a new Hello also the delivered and running ones) and the
// DesiredState when the spec is newer than what the daemon reported or
// was sent.
func (g *GatewayStub) deliver(sn *stubNode) {
	c := sn.session
	if c == nil || !c.gwOpen {
		return
	}
	all := sn.inFlight
	sn.inFlight = false
	for _, cmd := range sn.open {
		if cmd.state == cmdQueued || (all && (cmd.state == cmdDelivered || cmd.state == cmdRunning)) {
			if cmd.state == cmdQueued {
				cmd.state = cmdDelivered
			}
			g.s.sendDown(c, cmd.msg)
		}
	}
	if sn.specGen > max(sn.reported, sn.sent) {
		if sn.spec == nil || sn.spec.GetDesiredState().GetGeneration() != sn.specGen {
			allocs := make([]*gatewayv1.Allocation, 0, len(sn.allocs))
			for _, b := range sn.allocs {
				allocs = append(allocs, &gatewayv1.Allocation{ReservationId: b.id, DeviceIndexes: b.devices})
			}
			sn.spec = &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_DesiredState{DesiredState: &gatewayv1.DesiredState{
				Generation: sn.specGen, Spec: &gatewayv1.NodeSpec{Allocations: allocs},
			}}}
		}
		sn.sent = sn.specGen
		g.log(sn, "gw desired gen="+strconv.FormatInt(sn.specGen, 10))
		g.s.record(Record{Kind: RecSpecDelivered, Node: sn.id, Gen: sn.specGen})
		g.s.sendDown(c, sn.spec)
	}
}

// createCommand queues a command for sn and delivers it if it can.
func (g *GatewayStub) createCommand(sn *stubNode, kind string, args []byte, retrySafe bool) {
	t := g.s.time()
	cmd := &command{
		id: ids.FromReader(ids.Command, t, g.s.ids), node: sn, kind: kind, retrySafe: retrySafe,
		deadline: g.now() + CommandTimeout,
	}
	cmd.msg = &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Command{Command: &gatewayv1.Command{
		CommandId: cmd.id, Kind: kind, ArgsJson: args, Deadline: timestamppb.New(t.Add(CommandTimeout)), RetrySafe: retrySafe,
	}}}
	g.commands[cmd.id] = cmd
	g.cmdQueue = append(g.cmdQueue, cmd)
	sn.open = append(sn.open, cmd)
	g.total++
	g.log(sn, "gw command "+cmd.id+" "+kind)
	g.s.record(Record{Kind: RecCommandCreated, Node: sn.id, Command: cmd.id, RetrySafe: retrySafe})
	g.deliver(sn)
}

// book places a booking of gpus GPUs for d on the reachable node that
// fits it best (fewest free GPUs; the lowest index on a tie), on its
// lowest free devices. It reports whether one fitted.
func (g *GatewayStub) book(gpus int, d time.Duration) bool {
	var best *stubNode
	for _, sn := range g.nodes {
		if sn.reachable && sn.free >= gpus && (best == nil || sn.free < best.free) {
			best = sn
		}
	}
	if best == nil {
		g.unplaced++
		g.s.logGlobal("gw no node fits " + strconv.Itoa(gpus) + " GPUs")
		return false
	}
	now := g.now()
	b := &booking{id: ids.FromReader(ids.Reservation, g.s.time(), g.s.ids), node: best, start: now, end: now + d}
	for i, o := range best.owner {
		if o == nil && len(b.devices) < gpus {
			best.owner[i] = b
			b.devices = append(b.devices, int32(i))
		}
	}
	best.free -= gpus
	i, _ := slices.BinarySearchFunc(best.allocs, b.id, func(x *booking, id string) int { return strings.Compare(x.id, id) })
	best.allocs = slices.Insert(best.allocs, i, b)
	b.next = g.s.t0.Add(now).Truncate(time.Second).Truncate(time.Hour)
	g.live = append(g.live, b)
	g.usage = append(g.usage, b)
	g.log(best, fmt.Sprintf("gw book %s %v until +%s", b.id, b.devices, d))
	g.s.record(Record{Kind: RecBookingStart, Node: best.id, Reservation: b.id, Devices: b.devices, GPUs: gpus, End: g.s.t0.Add(b.end)})
	g.s.eng.schedule(b.end, event{kind: evExpire, b: b})
	g.bump(best)
	return true
}

// releaseRandom releases a live booking drawn uniformly, if there is one.
func (g *GatewayStub) releaseRandom() {
	g.live = slices.DeleteFunc(g.live, func(b *booking) bool { return b.ended })
	if len(g.live) == 0 {
		return
	}
	b := g.live[g.s.rng.IntN(len(g.live))]
	g.s.record(Record{Kind: RecReleaseRequested, Reservation: b.id})
	g.endBooking(b, CauseRelease)
}

// endBooking ends b now: its devices are free and the node's spec drops it.
func (g *GatewayStub) endBooking(b *booking, cause string) {
	if b.ended {
		return
	}
	b.ended = true
	b.end = g.now()
	sn := b.node
	for _, d := range b.devices {
		sn.owner[d] = nil
	}
	sn.free += len(b.devices)
	sn.allocs = slices.DeleteFunc(sn.allocs, func(x *booking) bool { return x == b })
	g.log(sn, "gw end "+b.id+" "+cause)
	g.s.record(Record{Kind: RecBookingEnd, Node: sn.id, Reservation: b.id, Cause: cause})
	g.bump(sn)
}

// bump raises the node's spec generation and delivers it.
func (g *GatewayStub) bump(sn *stubNode) {
	sn.specGen++
	g.deliver(sn)
}

// tick is the stub's 1-second beat: command expiry, the liveness sweeper,
// and every ResyncInterval the gateways' idle check, every UsageInterval
// the usage meter.
func (g *GatewayStub) tick(n int64) {
	now := g.now()
	for g.cmdHead < len(g.cmdQueue) && g.cmdQueue[g.cmdHead].deadline <= now {
		cmd := g.cmdQueue[g.cmdHead]
		g.cmdQueue[g.cmdHead] = nil
		g.cmdHead++
		if !cmd.state.terminal() {
			cmd.state = cmdExpired
			cmd.node.open = slices.DeleteFunc(cmd.node.open, func(x *command) bool { return x == cmd })
			g.log(cmd.node, "gw "+cmd.id+" expired")
			g.expired++
			g.s.record(Record{Kind: RecCommandEnded, Node: cmd.node.id, Command: cmd.id, State: cmdStateNames[cmdExpired]})
		}
	}
	if g.cmdHead > 1024 && g.cmdHead*2 > len(g.cmdQueue) {
		g.cmdQueue = slices.Delete(g.cmdQueue, 0, g.cmdHead)
		g.cmdHead = 0
	}
	for _, sn := range g.nodes {
		held := sn.live != nil && g.gateways[sn.live.gw].presence > now
		if sn.reachable && !held && now-sn.lastSeen > g.sweepTimeout {
			sn.reachable = false
			g.log(sn, "unreachable")
			g.s.record(Record{Kind: RecUnreachable, Node: sn.id})
		}
	}
	for k, gw := range g.gateways {
		if gw.alive {
			g.flush(k)
		}
	}
	if n%int64(ResyncInterval/time.Second) == 0 {
		for _, sn := range g.nodes {
			for _, c := range slices.Clone(sn.streams) {
				switch {
				case c.helloed && now-c.lastRecv > IdleTimeout:
					g.abort(c, "silent for "+IdleTimeout.String())
				case !c.helloed && now-c.lastRecv > HelloTimeout:
					g.abort(c, "no Hello within "+HelloTimeout.String())
				}
			}
		}
	}
	if n%int64(UsageInterval/time.Second) == 0 {
		g.meter(false)
	}
}

// killGateway kills gateway k: its connections are reset (nodes reconnect
// to another), its unflushed hearings are lost and it stops flushing, so
// its presence expires; its sessions stay live in the table.
func (g *GatewayStub) killGateway(k int) {
	gw := g.gateways[k]
	gw.alive = false
	for _, sn := range gw.pending {
		sn.pendConn[k] = nil
	}
	clear(gw.pending)
	gw.pending = gw.pending[:0]
	for _, sn := range g.nodes {
		for _, c := range slices.Clone(sn.streams) {
			if c.gw == k {
				c.gwOpen = false
				g.forget(c)
				if !c.dead {
					c.dead = true
					g.s.notifyNode(c, g.now()+g.s.delay(), errConnReset)
				}
			}
		}
	}
}

// reviveGateway brings gateway k back: it clears the sessions it held in
// the table, raising their last_seen to now (ResetGatewaySessions), and
// flushes at once (its presence).
func (g *GatewayStub) reviveGateway(k int) {
	now := g.now()
	for _, sn := range g.nodes {
		if sn.live != nil && sn.live.gw == k {
			sn.live = nil
			sn.lastSeen = max(sn.lastSeen, now)
		}
	}
	g.gateways[k].alive = true
	g.flush(k)
}

// meter writes the usage windows that are final: those of hours that
// ended, and all of a booking that ended. With final set (the end of the
// run) it writes the rest, counting live bookings until now.
func (g *GatewayStub) meter(final bool) {
	now := g.s.time()
	kept := g.usage[:0]
	for _, b := range g.usage {
		lo := g.s.t0.Add(b.start).Truncate(time.Second)
		hi := g.s.t0.Add(b.end)
		done := b.ended || final
		if !b.ended && final && hi.After(now) {
			hi = now
		}
		hi = hi.Truncate(time.Second)
		gpus := int64(len(b.devices))
		for ws := b.next; ws.Before(hi) && hi.After(lo); ws = ws.Add(time.Hour) {
			we := ws.Add(time.Hour)
			if !done && we.After(now) {
				break
			}
			secs := int64(earlier(hi, we).Sub(later(lo, ws))/time.Second) * gpus
			g.s.record(Record{Kind: RecUsageWindow, Node: b.node.id, Reservation: b.id, Window: ws, Secs: secs})
			b.next = we
		}
		if !done {
			kept = append(kept, b)
		}
	}
	clear(g.usage[len(kept):])
	g.usage = kept
}

func earlier(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// open counts the commands not in a terminal state.
func (g *GatewayStub) open() int {
	n := 0
	for _, cmd := range g.cmdQueue[g.cmdHead:] {
		if !cmd.state.terminal() {
			n++
		}
	}
	return n
}
