package sim

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
)

// Chaos is a level of chaos: "none", "light" or "heavy".
type Chaos string

// The chaos levels (docs/simulator.md's table, defined in chaosLevels).
const (
	ChaosNone  Chaos = "none"
	ChaosLight Chaos = "light"
	ChaosHeavy Chaos = "heavy"
)

// chaosParams are the link and fault rates of a level. Link rates are per
// message; fault probabilities are per draw, one draw every faultEvery:
// with probability p, one node (or gateway) drawn uniformly suffers the
// fault.
type chaosParams struct {
	latency, jitter time.Duration
	drop            float64 // per message, either direction: the connection is reset
	duplicate       float64 // per message, either direction: delivered twice
	reorder         float64 // per message, down only: overtaken by later ones
	faultEvery      time.Duration
	// Fault probabilities per draw.
	crash, reboot, journalLoss, partition, isolate float64
	halfOpen, reset, stall, gatewayKill            float64
}

var chaosLevels = map[Chaos]chaosParams{
	ChaosNone: {},
	ChaosLight: {
		latency: 5 * time.Millisecond, jitter: 20 * time.Millisecond,
		drop: 0.0001, duplicate: 0.002, reorder: 0.0005,
		faultEvery: 15 * time.Second,
		crash:      0.1, reboot: 0.05, partition: 0.1, reset: 0.1, stall: 0.05,
	},
	ChaosHeavy: {
		latency: 5 * time.Millisecond, jitter: 20 * time.Millisecond,
		drop: 0.0005, duplicate: 0.01, reorder: 0.002,
		faultEvery: 5 * time.Second,
		crash:      0.3, reboot: 0.1, journalLoss: 0.05, partition: 0.3, isolate: 0.1, halfOpen: 0.1,
		reset: 0.2, stall: 0.2, gatewayKill: 0.02,
	},
}

// Transport timings, those of the node agent's HTTP/2 transport
// (pkg/agent, on Linux).
const (
	// connectTimeout is how long a dial to an unreachable address waits.
	connectTimeout = 10 * time.Second
	// unackedTimeout is how long a heartbeat may stay unacknowledged before
	// the daemon's kernel ends the connection (TCP_USER_TIMEOUT). A
	// connection that dies silently is noticed by the transport at most
	// HeartbeatInterval+unackedTimeout after it died: the next heartbeat
	// goes out within HeartbeatInterval. The daemon core usually notices
	// first: it drops a session on which its gateway (which acknowledges
	// heartbeats) was silent for daemon.DefaultSilenceCap (15 s).
	unackedTimeout = 15 * time.Second
	// reorderExtra bounds how much later than its turn a reordered message
	// arrives.
	reorderExtra = 200 * time.Millisecond
)

var (
	errConnReset    = errors.New("connection reset")
	errUnacked      = errors.New("heartbeat unacknowledged: the connection is dead")
	errDialTimeout  = errors.New("dial timeout")
	errDialRefused  = errors.New("connection refused: the gateway is down")
	errGatewayClose = errors.New("the gateway closed the session")
)

// conn is one simulated connection between a node's daemon and a gateway,
// carrying one session. Messages keep their order in each direction (like
// the TCP stream under HTTP/2) except down messages picked for reordering.
type conn struct {
	id      uint64
	n       *node
	inc     uint64 // the daemon incarnation that dialed it
	session uint64 // the Agent's session number
	gw      int    // gateway index; -1 while dialing an unreachable address
	opened  time.Duration

	nodeOpen bool // the node's side has not seen it end
	gwOpen   bool // the gateway's side holds it
	helloed  bool // the gateway received Hello on it
	dead     bool // nothing gets through any more, either way
	notified bool // the node's transport was told it ended (or will be)

	lastRecv         time.Duration // the gateway's last receive
	upTail, downTail time.Duration // arrival of the last message each way
}

// delay draws one link latency: latency plus uniform jitter.
func (s *Sim) delay() time.Duration {
	p := &s.chaos
	if p.jitter <= 0 {
		return p.latency
	}
	return p.latency + time.Duration(s.rng.Int64N(int64(p.jitter)))
}

func (s *Sim) chance(p float64) bool { return p > 0 && s.rng.Float64() < p }

// arrival returns when a message sent now arrives, after the one before it
// (tail) and after the node's stall.
func (s *Sim) arrival(n *node, tail *time.Duration) time.Duration {
	t := s.eng.now + s.delay()
	t = max(t, n.stallUntil, *tail)
	*tail = t
	return t
}

// dial opens session for n's daemon: the handshake takes three link
// latencies to a gateway drawn from the live ones, or times out when the
// node is cut off.
func (s *Sim) dial(n *node, session uint64) {
	s.nextConn++
	c := &conn{id: s.nextConn, n: n, inc: n.inc, session: session, gw: -1, opened: s.eng.now, nodeOpen: true}
	n.conn = c
	if s.eng.now < n.cutUntil {
		c.dead = true
		s.eng.schedule(s.eng.now+connectTimeout, event{kind: evDialFailed, c: c})
		return
	}
	c.gw = s.stub.pickGateway()
	s.eng.schedule(s.eng.now+s.delay()+s.delay()+s.delay(), event{kind: evConnected, c: c})
}

func (s *Sim) onConnected(c *conn) {
	n := c.n
	if !c.nodeOpen || c.inc != n.inc || n.agent == nil {
		return
	}
	if s.eng.now < n.cutUntil {
		// Cut off during the handshake: the dial times out.
		c.dead = true
		s.eng.schedule(c.opened+connectTimeout, event{kind: evDialFailed, c: c})
		return
	}
	if !s.stub.gateways[c.gw].alive {
		c.nodeOpen, c.dead = false, true
		s.logNode(n, "dial refused: gateway "+s.stub.gateways[c.gw].id+" is down")
		s.apply(n, n.agent.Disconnected(s.time(), c.session, errDialRefused))
		return
	}
	s.stub.accept(c)
	s.apply(n, n.agent.Connected(s.time(), c.session))
}

func (s *Sim) onDialFailed(c *conn) {
	n := c.n
	if !c.nodeOpen || c.inc != n.inc || n.agent == nil {
		return
	}
	c.nodeOpen = false
	s.logNode(n, fmt.Sprintf("dial[%d] timed out", c.session))
	s.apply(n, n.agent.Disconnected(s.time(), c.session, errDialTimeout))
}

// sendUp carries a message from n's daemon to its gateway.
func (s *Sim) sendUp(n *node, session uint64, m *gatewayv1.SessionRequest) {
	c := n.conn
	if c == nil || c.session != session || c.inc != n.inc || !c.nodeOpen || c.dead {
		return // lost with its connection
	}
	if s.chance(s.chaos.drop) {
		s.reset(c, "drop up")
		return
	}
	s.eng.schedule(s.arrival(n, &c.upTail), event{kind: evUp, c: c, up: m})
	if s.chance(s.chaos.duplicate) {
		s.logNode(n, "duplicate up")
		s.eng.schedule(s.arrival(n, &c.upTail), event{kind: evUp, c: c, up: proto.CloneOf(m)})
	}
}

// sendDown carries a message from a gateway to the node of c.
func (s *Sim) sendDown(c *conn, m *gatewayv1.SessionResponse) {
	if !c.gwOpen || c.dead {
		return
	}
	n := c.n
	if s.chance(s.chaos.drop) {
		s.reset(c, "drop down")
		return
	}
	if s.chance(s.chaos.reorder) {
		t := s.eng.now + s.delay() + s.delay() + uniform(s.rng, s.chaos.jitter, reorderExtra)
		s.logNode(n, "reorder down")
		s.eng.schedule(max(t, n.stallUntil), event{kind: evDown, c: c, down: m})
	} else {
		s.eng.schedule(s.arrival(n, &c.downTail), event{kind: evDown, c: c, down: m})
	}
	if s.chance(s.chaos.duplicate) {
		s.logNode(n, "duplicate down")
		s.eng.schedule(s.arrival(n, &c.downTail), event{kind: evDown, c: c, down: proto.CloneOf(m)})
	}
}

// reset tears c down at once: what is in flight is lost and both sides
// notice after a link latency.
func (s *Sim) reset(c *conn, why string) {
	if c.dead {
		return
	}
	c.dead = true
	s.logNode(c.n, fmt.Sprintf("reset conn %d (%s)", c.id, why))
	s.notifyNode(c, s.eng.now+s.delay(), errConnReset)
	if c.gwOpen {
		s.eng.schedule(s.eng.now+s.delay(), event{kind: evGatewayReset, c: c})
	}
}

// kill makes c die silently (a partition, a half-open connection): nothing
// gets through, the node's transport notices unackedTimeout after its next
// heartbeat and the gateway by its idle timeout.
func (s *Sim) kill(c *conn) {
	if c.dead {
		return
	}
	c.dead = true
	s.notifyNode(c, s.eng.now+uniform(s.rng, time.Millisecond, HeartbeatInterval)+unackedTimeout, errUnacked)
}

// notifyNode tells the node's transport at t that c ended.
func (s *Sim) notifyNode(c *conn, t time.Duration, err error) {
	if !c.nodeOpen || c.notified {
		return
	}
	c.notified = true
	s.eng.schedule(t, event{kind: evNodeReset, c: c, text: err.Error()})
}

// closeByNode closes the daemon's side of session: gracefully, what is in
// flight still arrives, then the gateway sees the end; aborted (the Agent
// found its gateway silent), the daemon drops the connection: what is in
// flight is lost and the gateway sees the end after a link latency.
func (s *Sim) closeByNode(n *node, session uint64, abort bool) {
	c := n.conn
	if c == nil || c.session != session || c.inc != n.inc || !c.nodeOpen {
		return
	}
	c.nodeOpen = false
	if c.dead || !c.gwOpen {
		return
	}
	if abort {
		c.dead = true
		s.eng.schedule(s.eng.now+s.delay(), event{kind: evGatewayReset, c: c})
		return
	}
	s.eng.schedule(max(s.eng.now+s.delay(), c.upTail), event{kind: evGatewayReset, c: c})
}

// closeByGateway ends the gateway's side of c gracefully: what it sent
// still arrives, then the node sees the end.
func (s *Sim) closeByGateway(c *conn) {
	if !c.gwOpen {
		return
	}
	c.gwOpen = false
	if !c.dead {
		s.notifyNode(c, max(s.eng.now+s.delay(), c.downTail), errGatewayClose)
	}
}

func (s *Sim) onNodeReset(c *conn, why string) {
	n := c.n
	if !c.nodeOpen || c.inc != n.inc || n.agent == nil {
		return
	}
	c.nodeOpen = false
	s.logNode(n, fmt.Sprintf("conn %d ended: %s", c.id, why))
	s.apply(n, n.agent.Disconnected(s.time(), c.session, errors.New(why)))
}

func (s *Sim) onUp(c *conn, m *gatewayv1.SessionRequest) {
	if c.dead || !c.gwOpen {
		return
	}
	s.stub.receive(c, m)
}

func (s *Sim) onDown(c *conn, m *gatewayv1.SessionResponse) {
	n := c.n
	if c.dead || !c.nodeOpen || c.inc != n.inc || n.agent == nil {
		return
	}
	cmd := m.GetCommand()
	if cmd != nil {
		if s.cfg.dropCommands {
			return
		}
		n.delivering = cmd.GetCommandId()
	}
	effects := n.agent.Receive(s.time(), c.session, m)
	n.delivering = ""
	if cmd != nil {
		s.noteAnswer(n, cmd.GetCommandId(), effects)
	}
	if m.GetDesiredState() != nil {
		s.noteHolds(n)
	}
	s.apply(n, effects)
}

// noteAnswer records what n's daemon answered, in effects, to the Command
// id it just received (I2): its last CommandUpdate for id, if any.
func (s *Sim) noteAnswer(n *node, id string, effects []daemon.Effect) {
	r := Record{Kind: RecCommandReceived, Node: n.id, Command: id}
	for _, e := range effects {
		u := e.Msg.GetCommandUpdate()
		if e.Kind != daemon.EffectSend || u.GetCommandId() != id {
			continue
		}
		r.State, r.Error = "", u.GetError()
		if st, ok := updateStates[u.GetState()]; ok {
			r.State = cmdStateNames[st]
		}
	}
	s.record(r)
}
