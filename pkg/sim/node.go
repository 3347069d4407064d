package sim

import (
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
)

// node is one simulated machine: fake hardware, a journal that survives
// its daemon, and the daemon core (daemon.Agent) the simulator drives as
// the fakedaemon does, with the virtual clock's time on every input.
type node struct {
	idx     int32
	tag     string // "n<idx>", the node in the event log
	id      string // node id
	hw      *fakehw.Machine
	rec     *recordingHW
	mem     *daemon.MemoryJournal // the journal "on disk"
	journal daemon.Journal        // what the Agent writes to (mem, or a test's wrapper)
	rnd     *rand.Rand            // the Agent's jitter
	agent   *daemon.Agent         // nil while the process is down
	inc     uint64                // daemon incarnation: up one at every (re)start
	conn    *conn                 // the connection of the Agent's current session

	timerAt   time.Duration // when the live Tick event fires
	timerTok  uint64        // token of the live Tick event; older ones are stale
	timerLive bool
	ticking   bool

	delivering string // the command id of the Command being received
	rebooting  bool   // the Agent was last seen down for a node.reboot

	cutUntil   time.Duration // partitioned or isolated until then
	stallUntil time.Duration // messages held until then

	holds []Hold // the daemon's allocations last recorded
}

// recordingHW is the node's hardware with every Run recorded (I2): the
// Agent runs a command only while it receives the Command (a node.reboot
// that waits for the commands before it runs at once too; only its
// completion waits), so the command id is the one being delivered. The
// record carries the run count the journal "on disk" holds for it, which
// the Agent writes before it runs a command.
type recordingHW struct {
	*fakehw.Machine
	s *Sim
	n *node
}

// Run implements daemon.Hardware.
func (h *recordingHW) Run(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error) {
	id := h.n.delivering
	runs := 0
	if e, ok := h.n.mem.Get(id); ok && e.State == gatewayv1.CommandState_COMMAND_STATE_RUNNING {
		runs = e.Runs
	}
	res, d, err := h.Machine.Run(kind, args)
	h.s.record(Record{Kind: RecExecuted, Node: h.n.id, Command: id, Runs: runs, Took: d})
	h.s.logNode(h.n, "run "+kind+" "+id)
	return res, d, err
}

// startDaemon starts a new daemon process on n: a new Agent over the same
// hardware and journal.
func (s *Sim) startDaemon(n *node, rebooted bool) {
	if rebooted {
		s.logNode(n, "machine up, boot="+n.hw.Reboot())
	}
	n.inc++
	a, err := daemon.New(daemon.Config{NodeID: n.id, AgentVersion: "sim"}, n.rec, n.journal, n.rnd)
	if err != nil {
		panic(err) // the config is the simulator's own
	}
	n.agent = a
	n.conn = nil
	n.rebooting = false
	s.setHolds(n, nil)
	s.logNode(n, "daemon start inc="+strconv.FormatUint(n.inc, 10))
	s.apply(n, a.Start(s.time()))
}

// stopDaemon kills n's daemon process: its connection drops (the kernel
// resets it; the gateway notices after a latency) and whatever the Agent
// held in memory is gone. The journal stays.
func (s *Sim) stopDaemon(n *node) {
	if n.agent == nil {
		return
	}
	s.record(Record{Kind: RecDown, Node: n.id})
	if c := n.conn; c != nil && c.nodeOpen {
		c.nodeOpen = false
		if !c.dead {
			c.dead = true
			if c.gwOpen {
				s.eng.schedule(s.eng.now+s.delay(), event{kind: evGatewayReset, c: c})
			}
		}
	}
	n.agent = nil
	n.conn = nil
	n.timerTok++
	n.timerLive = false
}

// apply carries out an Agent's effects in order. Connected and
// Disconnected always come from later events, so a batch never grows while
// it is carried out. The Agent's timer is taken from NextTimer after every
// batch. An Agent that went down for a node.reboot is recorded (RecDown).
func (s *Sim) apply(n *node, effects []daemon.Effect) {
	if n.agent != nil {
		rebooting := n.agent.Status().State == daemon.StateRebooting
		if rebooting && !n.rebooting {
			s.record(Record{Kind: RecDown, Node: n.id})
		}
		n.rebooting = rebooting
	}
	for _, e := range effects {
		switch e.Kind {
		case daemon.EffectSend:
			s.logNode(n, e.String())
			s.sendUp(n, e.Session, e.Msg)
		case daemon.EffectDial:
			s.logNode(n, e.String())
			s.dial(n, e.Session)
		case daemon.EffectClose:
			s.logNode(n, e.String())
			s.closeByNode(n, e.Session, e.Abort)
		case daemon.EffectReboot, daemon.EffectStop:
			s.logNode(n, e.String())
		case daemon.EffectTimer, daemon.EffectMakeCSR, daemon.EffectCertificate, daemon.EffectOpenTunnel:
			// Timer: see below. No certificate expires in a run, so the
			// Agent never renews one; the stub gateway never sends
			// OpenTunnel.
		}
	}
	s.syncTimer(n)
}

// syncTimer schedules a Tick at the Agent's next deadline unless one is
// scheduled for then already. A deadline that a Tick just left due (which
// the Agent should never do) is pushed a millisecond on, so a run cannot
// spin, and noted in the event log ("driver note"), so it is not hidden.
func (s *Sim) syncTimer(n *node) {
	if n.agent == nil {
		return
	}
	next := n.agent.NextTimer()
	if next.IsZero() {
		if n.timerLive {
			n.timerTok++
			n.timerLive = false
		}
		return
	}
	at := next.Sub(s.t0)
	if n.timerLive && n.timerAt == at {
		return
	}
	if at <= s.eng.now && n.ticking {
		s.logNode(n, "driver note: the Agent asked for a timer at "+(at-s.eng.now).String()+
			" from now right after a Tick; it runs 1ms from now")
		at = s.eng.now + time.Millisecond
	}
	n.timerTok++
	n.timerAt, n.timerLive = at, true
	s.eng.schedule(at, event{kind: evTick, node: n.idx, n: n.timerTok})
}

func (s *Sim) onTick(n *node, tok uint64) {
	if n.agent == nil || !n.timerLive || tok != n.timerTok {
		return
	}
	n.timerLive = false
	n.ticking = true
	effects := n.agent.Tick(s.time())
	s.apply(n, effects)
	n.ticking = false
}

// noteHolds records the daemon's allocations when they changed (I1).
func (s *Sim) noteHolds(n *node) {
	allocs := n.agent.Allocations()
	holds := make([]Hold, 0, len(allocs))
	for _, a := range allocs {
		h := Hold{Reservation: a.ReservationID, Devices: make([]int32, 0, len(a.CDIDevices))}
		for _, name := range a.CDIDevices {
			i, err := strconv.Atoi(strings.TrimPrefix(name, "nvidia.com/gpu="))
			if err != nil {
				i = -1
			}
			h.Devices = append(h.Devices, int32(i))
		}
		holds = append(holds, h)
	}
	s.setHolds(n, holds)
}

func (s *Sim) setHolds(n *node, holds []Hold) {
	if slices.EqualFunc(n.holds, holds, func(a, b Hold) bool {
		return a.Reservation == b.Reservation && slices.Equal(a.Devices, b.Devices)
	}) {
		return
	}
	n.holds = holds
	s.record(Record{Kind: RecNodeHolds, Node: n.id, Holds: holds})
}
