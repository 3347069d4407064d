package sim

import (
	"fmt"
	"strconv"
	"time"

	"github.com/better-compute/better-compute/pkg/fakehw"
)

// commandKinds are the kinds the workload draws from, uniformly, with
// their retry_safe flag (pkg/store's: a reboot is never repeated).
var commandKinds = []struct {
	kind      string
	retrySafe bool
}{
	{fakehw.KindDiagNVML, true},
	{fakehw.KindInventoryRefresh, true},
	{fakehw.KindLogsCollect, true},
	{fakehw.KindNodeReboot, false},
}

// commandDurations are how long commands take on the simulated machines:
// longer than fakehw's defaults (made for real-time tests), so that
// sessions break, daemons crash and journals get lost while commands run.
var commandDurations = fakehw.Durations{
	ByKind: map[string]time.Duration{
		fakehw.KindDiagNVML:         20 * time.Second,
		fakehw.KindInventoryRefresh: 3 * time.Second,
		fakehw.KindLogsCollect:      8 * time.Second,
		fakehw.KindNodeReboot:       time.Second,
	},
	Default: time.Second,
}

// Booking sizes and lengths the workload draws from, uniformly.
const (
	maxBookingGPUs = 8
	minBooking     = time.Minute
	maxBooking     = 15 * time.Minute
	// releaseChance is the chance, every beat, that the workload releases a
	// live booking drawn uniformly.
	releaseChance = 0.5
)

// workload is one beat of the steady workload: three commands to random
// nodes, a booking of 1–8 GPUs for 1–15 minutes (whole seconds), and
// sometimes a release. It stops at the end of the run's Duration.
func (s *Sim) workload() {
	for range 3 {
		k := commandKinds[s.rng.IntN(len(commandKinds))]
		sn := s.stub.nodes[s.rng.IntN(len(s.stub.nodes))]
		var args []byte
		if k.kind == fakehw.KindLogsCollect {
			args = []byte(`{"lines":` + strconv.Itoa(1+s.rng.IntN(50)) + `}`)
		}
		s.stub.createCommand(sn, k.kind, args, k.retrySafe)
	}
	gpus := 1 + s.rng.IntN(maxBookingGPUs)
	d := time.Duration(int64(minBooking/time.Second)+s.rng.Int64N(int64((maxBooking-minBooking)/time.Second)+1)) * time.Second
	s.stub.book(gpus, d)
	if s.rng.Float64() < releaseChance {
		s.stub.releaseRandom()
	}
	if next := s.eng.now + WorkloadEvery; next < s.workEnd {
		s.eng.schedule(next, event{kind: evWorkload})
	}
}

// Fault durations, drawn uniformly.
const (
	restartMin, restartMax     = time.Second, 5 * time.Second        // a crashed daemon's restart
	rebootMin, rebootMax       = 20 * time.Second, 60 * time.Second  // a rebooted machine's downtime
	partitionMin, partitionMax = 5 * time.Second, 20 * time.Second   // shorter than the liveness timeout
	isolateMin, isolateMax     = 45 * time.Second, 120 * time.Second // longer: the node is marked unreachable
	stallMin, stallMax         = time.Second, 10 * time.Second       // messages held back
	gatewayDownMin             = 30 * time.Second                    // a killed gateway's downtime
	gatewayDownMax             = 90 * time.Second
)

// faultDraw is one draw of the chaos level's faults. Each fault kind is
// drawn in the table's order: with its probability, one node drawn
// uniformly (one gateway for a gateway kill) suffers it. So "crash 0.3"
// every 5 s is 0.06 crashes per second across the fleet, whatever its
// size. A fault that cannot apply (a crash of a node already down, a
// half-open or reset without a connection, a gateway kill with one gateway
// left) is logged and skipped.
func (s *Sim) faultDraw() {
	p := &s.chaos
	pick := func() *node { return s.nodes[s.rng.IntN(len(s.nodes))] }
	if s.chance(p.crash) {
		s.crash(pick(), "crash", restartMin, restartMax, false)
	}
	if s.chance(p.reboot) {
		s.crash(pick(), "reboot", rebootMin, rebootMax, true)
	}
	if s.chance(p.journalLoss) {
		s.crash(pick(), "journal loss", restartMin, restartMax, false)
	}
	if s.chance(p.partition) {
		s.cut(pick(), "partition", partitionMin, partitionMax)
	}
	if s.chance(p.isolate) {
		s.cut(pick(), "isolate", isolateMin, isolateMax)
	}
	if s.chance(p.halfOpen) {
		n := pick()
		if c := n.conn; c != nil && c.nodeOpen && !c.dead {
			s.logNode(n, fmt.Sprintf("fault half-open conn %d", c.id))
			s.kill(c)
		} else {
			s.logNode(n, "fault half-open: no connection")
		}
	}
	if s.chance(p.reset) {
		n := pick()
		if c := n.conn; c != nil && c.nodeOpen && !c.dead {
			s.reset(c, "fault reset")
		} else {
			s.logNode(n, "fault reset: no connection")
		}
	}
	if s.chance(p.stall) {
		n := pick()
		d := uniform(s.rng, stallMin, stallMax)
		n.stallUntil = max(n.stallUntil, s.eng.now+d)
		s.logNode(n, "fault stall "+d.String())
		s.eng.schedule(n.stallUntil, event{kind: evHeal, node: n.idx, text: "stall over"})
	}
	if s.chance(p.gatewayKill) {
		s.killGateway()
	}
	if next := s.eng.now + p.faultEvery; next < s.workEnd {
		s.eng.schedule(next, event{kind: evFaults})
	}
}

// crash kills n's daemon process and starts it again after a downtime in
// [lo, hi]; with reboot the machine reboots (new boot id); a journal loss
// also wipes the journal (the machine keeps its identity).
func (s *Sim) crash(n *node, what string, lo, hi time.Duration, reboot bool) {
	if n.agent == nil {
		s.logNode(n, "fault "+what+": already down")
		return
	}
	d := uniform(s.rng, lo, hi)
	s.logNode(n, "fault "+what+", back in "+d.String())
	s.stopDaemon(n)
	switch {
	case reboot:
		s.faults.Reboots++
	case what == "journal loss":
		s.faults.JournalLosses++
		n.mem.Wipe(s.time())
		s.record(Record{Kind: RecJournalLost, Node: n.id})
	default:
		s.faults.Crashes++
	}
	var flag uint64
	if reboot {
		flag = 1
	}
	s.eng.schedule(s.eng.now+d, event{kind: evStart, node: n.idx, n: flag})
}

// cut cuts n off from every gateway, both ways, for a duration in [lo,
// hi]: its connections die silently and its dials time out until then.
func (s *Sim) cut(n *node, what string, lo, hi time.Duration) {
	d := uniform(s.rng, lo, hi)
	n.cutUntil = max(n.cutUntil, s.eng.now+d)
	s.logNode(n, "fault "+what+" "+d.String())
	if c := n.conn; c != nil && c.nodeOpen {
		s.kill(c)
	}
	for _, c := range s.stub.nodes[n.idx].streams {
		s.kill(c)
	}
	s.eng.schedule(n.cutUntil, event{kind: evHeal, node: n.idx, text: what + " over"})
}

// killGateway kills a live gateway drawn uniformly, if another one is
// alive, and brings it back after a while.
func (s *Sim) killGateway() {
	var alive []int
	for i, gw := range s.stub.gateways {
		if gw.alive {
			alive = append(alive, i)
		}
	}
	if len(alive) < 2 {
		s.logGlobal("fault gateway kill: only one gateway left")
		return
	}
	k := alive[s.rng.IntN(len(alive))]
	d := uniform(s.rng, gatewayDownMin, gatewayDownMax)
	s.logGlobal("fault gateway kill " + s.stub.gateways[k].id + ", back in " + d.String())
	s.faults.GatewayKills++
	s.stub.killGateway(k)
	s.eng.schedule(s.eng.now+d, event{kind: evGatewayRevive, n: uint64(k)})
}
