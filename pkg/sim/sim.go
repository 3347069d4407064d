// Package sim is the deterministic fleet simulator behind `better-compute
// sim` (docs/simulator.md): thousands of daemon
// cores (pkg/daemon's Agent, the code the fakedaemon runs) on fake hardware
// (pkg/fakehw), each with its own command journal, talk the Session
// protocol over simulated links to a GatewayStub, entirely in simulated
// time, under a steady workload and the faults of a chaos level. The
// Agent has no I/O of its own; the simulator is its driver, as the
// fakedaemon is: time is the virtual clock's on every input, the transport
// is the simulated link (link.go), storage is a daemon.Journal (a
// MemoryJournal that survives the daemon's crash and is wiped for a
// journal loss) and the hardware is fakehw behind daemon.Hardware. Every
// fact that matters is recorded and checked against the invariants (I1,
// I2, I3, I4, I5, I8) and the progress check (see Checkers; GatewayStub
// says which of them exercise the daemon core and which the stub's own
// bookkeeping), and every event is written to an event log whose SHA-256
// is the run's digest.
//
// Determinism: one discrete-event scheduler on a virtual clock (a heap
// ordered by time, ties broken by the order events were scheduled); every
// random draw comes from one PCG generator seeded from SHA-256 of the seed
// (the Agents' jitter from per-node generators drawn from it at the start);
// ids come from ids.FromReader over it; nothing iterates a map, starts a
// goroutine or reads the wall clock except to report wallMs. The same seed
// therefore gives the same digest on every run and machine.
//
// To add a fault, add its rate to chaosParams (and the table) and a case to
// faultDraw; to add an invariant, write a Checker with a test feeding it a
// hand-made violating history, and add it to Checkers.
package sim

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
)

// Limits and defaults of a run.
const (
	// MaxNodes is the most nodes a run simulates.
	MaxNodes = 5000
	// DefaultSeed is the seed when none is given.
	DefaultSeed = "sim"
	// DefaultNodes is the CLI's --nodes default.
	DefaultNodes = 50
	// DefaultDuration is the CLI's --duration default.
	DefaultDuration = 10 * time.Minute
	// DefaultSettle is the CLI's --settle default: long enough for every
	// command (CommandTimeout) and booking (at most 15 min) to end.
	DefaultSettle = 16 * time.Minute
	// DefaultChaos is the chaos level when none is given.
	DefaultChaos = ChaosLight
	// WorkloadEvery is the workload's beat: three commands, a booking and
	// sometimes a release.
	WorkloadEvery = 2 * time.Second
	// MaxFirstViolations is how many violations a Report lists.
	MaxFirstViolations = 20
	// MaxDuration bounds Config.Duration and Config.Settle, each.
	MaxDuration = 7 * 24 * time.Hour
)

// Start is the simulated time every run starts at: ten minutes before an
// hour (and a day) ends, so usage windows are split in every run.
var Start = time.Date(2030, 1, 1, 23, 50, 0, 0, time.UTC)

// Config is one run.
type Config struct {
	// Seed is what every random draw derives from (DefaultSeed if empty).
	Seed string
	// Nodes is how many machines, 1 to MaxNodes.
	Nodes int
	// Duration is the simulated time under workload and faults, from
	// WorkloadEvery (one beat) to MaxDuration.
	Duration time.Duration
	// Settle is the quiet simulated time afterwards, 0 to MaxDuration: no
	// workload, no faults, links as chaotic as before.
	Settle time.Duration
	// Chaos is the chaos level (DefaultChaos if empty).
	Chaos Chaos
	// Log, when set, receives the event log: one line per thing that
	// happened (every message a daemon sends, dial, close, command run,
	// gateway action, fault and violation; not the arrival of each
	// message), "<ns since the start> <node or -> <text>". The digest is
	// SHA-256 over exactly these bytes, computed without Log too.
	Log io.Writer
	// Clock measures wallMs (clock.New() if nil); the simulation never
	// reads it.
	Clock clock.Clock

	// wrapJournal, a test hook, wraps every daemon's journal (a daemon that
	// skips its journal, say).
	wrapJournal func(daemon.Journal) daemon.Journal
	// sample, a test hook, is called every sampleEvery events (benchmarks
	// sample memory with it).
	sample func()
	// dropCommands, a test hook, drops every Command before the Agent
	// sees it (a daemon that runs nothing).
	dropCommands bool
	// sweepTimeout, a test hook, replaces the sweeper's LivenessTimeout.
	sweepTimeout time.Duration
}

// Report is a run's outcome, printed as JSON by `better-compute sim`.
type Report struct {
	// Seed, Nodes and Chaos are the run's configuration.
	Seed  string `json:"seed"`
	Nodes int    `json:"nodes"`
	Chaos Chaos  `json:"chaos"`
	// SimulatedMs is the simulated time, Duration + Settle, in ms.
	SimulatedMs int64 `json:"simulatedMs"`
	// WallMs is how long the run took on the wall clock, in ms (not part
	// of the digest).
	WallMs int64 `json:"wallMs"`
	// Digest is the hex SHA-256 of the event log.
	Digest   string         `json:"digest"`
	Commands CommandSummary `json:"commands"`
	Faults   FaultSummary   `json:"faults"`
	// Violations counts every violation found.
	Violations int `json:"violations"`
	// FirstViolations are the first MaxFirstViolations of them, in the
	// order found.
	FirstViolations []Violation `json:"firstViolations"`
	// Events is how many scheduler events ran (not part of the JSON).
	Events int64 `json:"-"`
	// Records counts the history's records by kind (not part of the
	// JSON), so tests can see that every checker was fed.
	Records [recordKinds]int64 `json:"-"`

	duration, settle time.Duration
}

// ErrInvariantViolated is the sentinel of Report.Err.
var ErrInvariantViolated = errors.New("SIM_INVARIANT_VIOLATED")

// Err returns nil when the run broke no invariant, else an error matching
// ErrInvariantViolated whose message starts with SIM_INVARIANT_VIOLATED
// and names the first violation and how to reproduce the run.
func (r *Report) Err() error {
	if r.Violations == 0 {
		return nil
	}
	first := ""
	if len(r.FirstViolations) > 0 {
		v := r.FirstViolations[0]
		first = fmt.Sprintf("; first: %s at %d ms %s: %s", v.Invariant, v.AtMs, v.Node, v.Detail)
	}
	return fmt.Errorf("%w: %d violation(s)%s; reproduce with --seed %s --nodes %d --duration %s --settle %s --chaos %s (add --log PATH for the event log)",
		ErrInvariantViolated, r.Violations, first, ShellQuote(r.Seed), r.Nodes, r.duration, r.settle, r.Chaos)
}

// ShellQuote quotes s for a POSIX shell: in single quotes, each single
// quote in s replaced by these four characters (close, escaped quote,
// reopen), so that $, `, \, tabs and newlines stay literal:
//
//	'\''
func ShellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// CommandSummary counts the workload's commands.
type CommandSummary struct {
	// Total is how many were issued.
	Total int `json:"total"`
	// Open is how many were not in a terminal state at the end.
	Open int `json:"open"`
	// Succeeded, Failed and Expired count those that ended so (Total =
	// Open + Succeeded + Failed + Expired).
	Succeeded int `json:"succeeded"`
	Failed    int `json:"failed"`
	Expired   int `json:"expired"`
}

// FaultSummary counts the injected faults of some kinds.
type FaultSummary struct {
	// Crashes counts daemon crashes (restarts with the journal kept).
	Crashes int `json:"crashes"`
	// Reboots counts machine reboots (a new boot id).
	Reboots int `json:"reboots"`
	// JournalLosses counts crashes that wiped the journal.
	JournalLosses int `json:"journalLosses"`
	// GatewayKills counts stub gateways killed.
	GatewayKills int `json:"gatewayKills"`
}

// ErrConfig is the sentinel of a bad Config.
var ErrConfig = errors.New("invalid simulator configuration")

func (c *Config) normalize() error {
	if c.Seed == "" {
		c.Seed = DefaultSeed
	}
	if c.Chaos == "" {
		c.Chaos = DefaultChaos
	}
	if c.Clock == nil {
		c.Clock = clock.New()
	}
	switch {
	case c.Nodes < 1 || c.Nodes > MaxNodes:
		return fmt.Errorf("%w: nodes must be between 1 and %d, got %d", ErrConfig, MaxNodes, c.Nodes)
	case c.Duration < WorkloadEvery:
		return fmt.Errorf("%w: duration must be at least %s (one workload beat), got %s", ErrConfig, WorkloadEvery, c.Duration)
	case c.Duration > MaxDuration:
		return fmt.Errorf("%w: duration must be at most %s, got %s", ErrConfig, MaxDuration, c.Duration)
	case c.Settle < 0:
		return fmt.Errorf("%w: settle must not be negative, got %s", ErrConfig, c.Settle)
	case c.Settle > MaxDuration:
		return fmt.Errorf("%w: settle must be at most %s, got %s", ErrConfig, MaxDuration, c.Settle)
	}
	if _, ok := chaosLevels[c.Chaos]; !ok {
		return fmt.Errorf("%w: chaos must be none, light or heavy, got %q", ErrConfig, c.Chaos)
	}
	return nil
}

// Sim is one run in progress.
type Sim struct {
	cfg      Config
	t0       time.Time
	workEnd  time.Duration
	end      time.Duration
	eng      engine
	rng      *rand.Rand
	ids      randReader
	chaos    chaosParams
	nodes    []*node
	stub     *GatewayStub
	log      *eventLog
	checkers []Checker
	nextConn uint64

	violations int
	first      []Violation
	faults     FaultSummary
	records    [recordKinds]int64
}

const sampleEvery = 1 << 16

// ErrLog is the sentinel of a failing Config.Log writer.
var ErrLog = errors.New("write the event log")

// Validate returns the error Run would return for cfg's configuration (one
// matching ErrConfig), without running it.
func (c Config) Validate() error { return c.normalize() }

// Run simulates cfg and returns its report. It fails for a bad Config
// (ErrConfig, no report) or a failing Log writer (ErrLog: the run is
// complete and its report is returned too, with the digest of the whole
// log); violations are in the report.
func Run(cfg Config) (*Report, error) {
	if err := cfg.normalize(); err != nil {
		return nil, err
	}
	wallStart := cfg.Clock.Now()
	s := newSim(cfg)
	for {
		ev := s.eng.next()
		if ev == nil || ev.at > s.end {
			break
		}
		s.dispatch(ev)
		s.eng.recycle(ev)
		if cfg.sample != nil && s.eng.popped%sampleEvery == 0 {
			cfg.sample()
		}
	}
	s.eng.now = s.end
	s.stub.meter(true)
	for _, c := range s.checkers {
		s.violate(c.Finish(s.time()))
	}
	digest, logErr := s.log.finish()
	r := &Report{
		Seed: cfg.Seed, Nodes: cfg.Nodes, Chaos: cfg.Chaos,
		SimulatedMs: s.end.Milliseconds(),
		Digest:      digest,
		Commands: CommandSummary{
			Total: s.stub.total, Open: s.stub.open(),
			Succeeded: s.stub.succeeded, Failed: s.stub.failed, Expired: s.stub.expired,
		},
		Faults:     s.faults,
		Violations: s.violations,
		Events:     s.eng.popped,
		Records:    s.records,
		duration:   cfg.Duration, settle: cfg.Settle,
	}
	r.FirstViolations = make([]Violation, 0, len(s.first))
	for _, v := range s.first {
		v.AtMs = v.At.Sub(s.t0).Milliseconds()
		r.FirstViolations = append(r.FirstViolations, v)
	}
	r.WallMs = clock.Since(cfg.Clock, wallStart).Milliseconds()
	if logErr != nil {
		return r, fmt.Errorf("%w: %w", ErrLog, logErr)
	}
	return r, nil
}

func newSim(cfg Config) *Sim {
	rng := newRand(cfg.Seed)
	s := &Sim{
		cfg: cfg, t0: Start, workEnd: cfg.Duration, end: cfg.Duration + cfg.Settle,
		rng: rng, ids: randReader{rng}, chaos: chaosLevels[cfg.Chaos],
		log: newEventLog(cfg.Log), checkers: Checkers(cfg.Chaos),
	}
	s.stub = newStub(s)
	s.logGlobal(fmt.Sprintf("sim seed=%q nodes=%d duration=%s settle=%s chaos=%s", cfg.Seed, cfg.Nodes, cfg.Duration, cfg.Settle, cfg.Chaos))
	for i := range cfg.Nodes {
		variant := fakehw.VariantHGXH100
		switch k := rng.IntN(10); {
		case k >= 9:
			variant = fakehw.VariantHGXH100GPUMissing
		case k >= 6:
			variant = fakehw.VariantL40S
		}
		var mid [16]byte
		_, _ = s.ids.Read(mid[:])
		hw, err := fakehw.New(variant, hex.EncodeToString(mid[:]))
		if err != nil {
			panic(err) // the variants are fakehw's own
		}
		hw.SetDurations(commandDurations)
		n := &node{
			idx: int32(i), tag: "n" + strconv.Itoa(i), id: ids.FromReader(ids.Node, s.t0, s.ids), hw: hw,
			mem: daemon.NewMemoryJournal(), rnd: newPCG(rng),
		}
		n.rec = &recordingHW{Machine: hw, s: s, n: n}
		n.journal = n.mem
		if cfg.wrapJournal != nil {
			n.journal = cfg.wrapJournal(n.mem)
		}
		s.nodes = append(s.nodes, n)
		s.stub.addNode(n)
		s.logNode(n, n.id+" "+variant+" machine="+hw.MachineID())
		s.eng.schedule(uniform(rng, 0, 5*time.Second), event{kind: evStart, node: n.idx})
	}
	s.eng.schedule(WorkloadEvery, event{kind: evWorkload})
	if s.chaos.faultEvery > 0 && s.chaos.faultEvery < s.workEnd {
		s.eng.schedule(s.chaos.faultEvery, event{kind: evFaults})
	}
	s.eng.schedule(time.Second, event{kind: evStubTick, n: 1})
	return s
}

// time returns the simulated time now.
func (s *Sim) time() time.Time { return s.t0.Add(s.eng.now) }

func (s *Sim) dispatch(ev *event) {
	switch ev.kind {
	case evTick:
		s.onTick(s.nodes[ev.node], ev.n)
	case evStart:
		if n := s.nodes[ev.node]; n.agent == nil {
			s.startDaemon(n, ev.n == 1)
		}
	case evConnected:
		s.onConnected(ev.c)
	case evDialFailed:
		s.onDialFailed(ev.c)
	case evUp:
		s.onUp(ev.c, ev.up)
	case evDown:
		s.onDown(ev.c, ev.down)
	case evNodeReset:
		s.onNodeReset(ev.c, ev.text)
	case evGatewayReset:
		s.stub.closed(ev.c)
	case evWorkload:
		s.workload()
	case evFaults:
		s.faultDraw()
	case evStubTick:
		s.stub.tick(int64(ev.n))
		s.eng.schedule(s.eng.now+time.Second, event{kind: evStubTick, n: ev.n + 1})
	case evGatewayRevive:
		s.stub.reviveGateway(int(ev.n))
		s.logGlobal("gateway " + s.stub.gateways[ev.n].id + " is back")
	case evHeal:
		s.logNode(s.nodes[ev.node], ev.text)
	case evExpire:
		s.stub.endBooking(ev.b, CauseExpiry)
	}
}

// record feeds r to every checker; At defaults to now.
func (s *Sim) record(r Record) {
	if r.At.IsZero() {
		r.At = s.time()
	}
	s.records[r.Kind]++
	for _, c := range s.checkers {
		if vs := c.Observe(&r); len(vs) > 0 {
			s.violate(vs)
		}
	}
}

func (s *Sim) violate(vs []Violation) {
	for _, v := range vs {
		s.violations++
		if len(s.first) < MaxFirstViolations {
			s.first = append(s.first, v)
		}
		s.logGlobal("VIOLATION " + v.Invariant + " " + v.Node + " " + v.Detail)
	}
}

func (s *Sim) logNode(n *node, text string) { s.log.line(s.eng.now, n.tag, text) }
func (s *Sim) logGlobal(text string)        { s.log.line(s.eng.now, "-", text) }

// eventLog writes the event log and hashes it: lines of "<ns since the
// start> <node or -> <text>".
type eventLog struct {
	h   hash.Hash
	w   *bufio.Writer
	buf []byte
	err error
}

func newEventLog(w io.Writer) *eventLog {
	l := &eventLog{h: sha256.New(), buf: make([]byte, 0, 64<<10)}
	if w != nil {
		l.w = bufio.NewWriterSize(w, 256<<10)
	}
	return l
}

func (l *eventLog) line(at time.Duration, who, text string) {
	l.buf = strconv.AppendInt(l.buf, int64(at), 10)
	l.buf = append(l.buf, ' ')
	l.buf = append(l.buf, who...)
	l.buf = append(l.buf, ' ')
	l.buf = append(l.buf, text...)
	l.buf = append(l.buf, '\n')
	if len(l.buf) >= 60<<10 {
		l.flush()
	}
}

func (l *eventLog) flush() {
	l.h.Write(l.buf)
	if l.w != nil && l.err == nil {
		_, l.err = l.w.Write(l.buf)
	}
	l.buf = l.buf[:0]
}

// finish returns the digest once the log is written out.
func (l *eventLog) finish() (string, error) {
	l.flush()
	if l.w != nil && l.err == nil {
		l.err = l.w.Flush()
	}
	return hex.EncodeToString(l.h.Sum(nil)), l.err
}
