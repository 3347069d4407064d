// Package daemon is the daemon core of better-compute: the node side of the
// Session protocol (bc.gateway.v1) as a state machine with no I/O.
//
// An Agent owns one machine's session state, its command journal and its
// applied NodeSpec. It starts no goroutine, reads no clock, iterates no map
// and draws randomness only from the Rand it is given, so that the same
// inputs always yield the same Effects. Drivers feed it inputs — Start,
// Connected, Disconnected, Receive and Tick, each with the current time —
// and carry out the Effects it returns in order: send a message, dial the
// gateway, close a session, call Tick again at a time. Effects of an input
// made while carrying out a batch (Connected after EffectDial, Disconnected
// after a failed send) go after the rest of that batch. The node agent
// (pkg/agent, which the fakedaemon runs) drives it in real time over HTTP/2;
// the fleet simulator drives thousands of Agents from one goroutine on a
// virtual clock (see Example).
//
// Sessions are numbered: every EffectDial carries a new number, and inputs for
// any other number are stale and ignored, so a driver never has to cancel
// in-flight events precisely.
//
// Behaviour (docs/architecture.md, "Session", "Commands", "Reservations"):
//   - disconnected → dialing → hello sent → established, heartbeats every
//     Welcome.heartbeat_interval, reconnect with exponential backoff and full
//     jitter, reset after a session lasted Config.BackoffResetAfter;
//   - a silent gateway: the gateway acknowledges every heartbeat
//     (HeartbeatAck), so an established session on which nothing
//     arrived from the gateway for the silence timeout (Config.SilenceTimeout:
//     3 heartbeat intervals, at most 15 s) is closed with EffectClose.Abort
//     (the driver drops the stream and its connection at once, so a write
//     blocked on a frozen gateway returns) and the Agent reconnects: a
//     gateway that hangs without closing its connections (paused, stuck,
//     cut off while the peer's kernel still acknowledges) costs its nodes
//     at most that long, well inside the 30 s after which the control plane
//     marks an unheard node unreachable;
//   - commands run at most once: journaled before they run, answered from the
//     journal when redelivered, failed without running past their deadline,
//     failed instead of run after a journal loss unless retry-safe; a
//     command running when the Agent restarts (or the machine reboots) is
//     failed as interrupted unless it is retry-safe and its deadline has not
//     passed: then it runs again when the gateway delivers it again after
//     the boot (Entry.Runs counts its runs);
//   - desired state: newer generations are applied, allocations reported
//     bound (CDI names "nvidia.com/gpu=<index>") or unbound, then the
//     observed generation;
//   - node.reboot keeps the order commands were queued in (their ids sort by
//     time): it waits until every command running when it arrives (and any
//     with an earlier id that arrives while it waits) has finished or reached
//     its deadline, but not past the reboot's own deadline; commands queued
//     after it that arrive while it waits are neither journaled nor run, and
//     the gateway delivers them again on the session after the boot. Then
//     it answers SUCCEEDED, drops the session, and after
//     Config.RebootDowntime the machine is back with a new boot id;
//   - signed intent (Config.CommandSigningRoot): every Command and
//     DesiredState must carry the command-signing root's signature bound to
//     this node; others are refused without running or applying them and
//     reported (CommandUpdate FAILED "refused: …", Report.spec_refused);
//   - stopping for good (StateStopped, EffectStop): a session refused or
//     ended because the node is revoked (Disconnected with an error matching
//     ErrRevoked), or a node certificate past its NotAfter when the Agent
//     would dial (ErrCertificateExpired), ends the Agent: it logs an error
//     saying the node must join again and never dials again;
//   - tunnels (docs/architecture.md, "Tunnels"; tunnel.go): an OpenTunnel on
//     the established session becomes EffectOpenTunnel (the driver dials
//     the tunnel and serves it; the Agent keeps no state of it); SSHAccess
//     is what the node's SSH server accepts logins against, the SSH user CAs
//     and reservations of the applied spec; a spec whose CAs do not parse is
//     refused (SpecRefused) and leaves no CA trusted; ReportSSHRefused
//     reports a refused login (Report.ssh_refused);
//   - certificate renewal (Config.CertNotAfter): once less than a third of
//     the node certificate's lifetime is left, the Agent asks the driver for
//     a CSR of a new key (EffectMakeCSR), sends RenewCertificate on the
//     established session, hands the issued certificate to the driver
//     (EffectCertificate) for the next dial, and retries with backoff when
//     the gateway does not answer or refuses.
//
// To add a command kind, teach the Hardware's Run about it; kinds with an
// effect on the session (like node.reboot) also need a case in complete.
package daemon

import (
	"cmp"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/oklog/ulid/v2"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/sshca"
)

// KindNodeReboot is the command kind that reboots the machine once the
// commands queued before it have finished and it has answered SUCCEEDED.
const KindNodeReboot = "node.reboot"

// DefaultSilenceCap bounds the default silence timeout (Config.SilenceTimeout
// zero: 3 heartbeat intervals, at most this): half the control plane's 30 s
// liveness timeout, so that a node whose gateway hung is on another gateway
// long before it could be marked unreachable.
const DefaultSilenceCap = 15 * time.Second

// Errors reported in CommandUpdate.error.
const (
	// ErrTextJournalLost is the error of a command that is not retry-safe and
	// may have run before the daemon lost its journal.
	ErrTextJournalLost = "journal lost: the command may have run before the daemon lost its journal, so it is not run again"
	// ErrTextExpired is the error of a command received after its deadline
	// (reported FAILED, never run).
	ErrTextExpired = "deadline passed before the command started"
	// ErrTextInterrupted is the error of a command that was running when the
	// daemon restarted, and is not retry-safe or is past its deadline.
	ErrTextInterrupted = "interrupted: the daemon restarted while the command ran"
	// ErrTextRebooted is the error of a command that was running when the
	// machine rebooted (a node.reboot that waited for it until a deadline),
	// and is not retry-safe or is past its deadline.
	ErrTextRebooted = "interrupted: the machine rebooted while the command ran"
)

// Reasons an Agent stops for good (Status.Stopped matches one with
// errors.Is).
var (
	// ErrRevoked is what a driver wraps into the error it gives
	// Disconnected when the gateway refused or ended the session because
	// the node or its certificate is revoked (Connect Unauthenticated
	// "certificate revoked"). Retrying cannot help: the node must join
	// again.
	ErrRevoked = errors.New("node revoked")
	// ErrCertificateExpired is the reason of an Agent whose node
	// certificate (Config.CertNotAfter, or the last one renewed) expired
	// before it could dial: no gateway accepts it, so the node must join
	// again.
	ErrCertificateExpired = errors.New("node certificate expired")
)

// Hardware is the machine the Agent runs on; *fakehw.Machine implements it,
// and pkg/agent's Hardware (what a real machine provides) extends it. The
// Agent calls it from one goroutine.
type Hardware interface {
	// BootID returns the id of the current boot.
	BootID() string
	// Run performs a command's effect on the machine and returns its result,
	// how long it takes (the Agent reports completion that much later) and
	// an error if it failed.
	Run(kind string, args []byte) (*gatewayv1.CommandResult, time.Duration, error)
	// Reboot reboots the machine and returns the new boot id.
	Reboot() string
}

// Rand is the randomness the Agent draws backoff jitter from;
// *math/rand/v2.Rand implements it.
type Rand interface {
	// Int64N returns a uniform integer in [0, n); n > 0.
	Int64N(n int64) int64
}

// Config configures an Agent. Zero durations take the defaults named.
type Config struct {
	// NodeID is the node's id ("node_…"), sent in Hello. Required.
	NodeID string
	// AgentVersion is sent in Hello.
	AgentVersion string
	// BackoffMin is the first reconnect delay cap (default 250 ms).
	BackoffMin time.Duration
	// BackoffMax is the largest reconnect delay cap (default 30 s).
	BackoffMax time.Duration
	// BackoffResetAfter is how long a session must have been established for
	// the backoff to start over when it ends (default 30 s).
	BackoffResetAfter time.Duration
	// HelloTimeout is how long to wait for Welcome after Hello before
	// closing the session and reconnecting (default 30 s).
	HelloTimeout time.Duration
	// DefaultHeartbeat is the heartbeat interval when Welcome names none
	// (default 10 s).
	DefaultHeartbeat time.Duration
	// SilenceTimeout is how long an established session may go without any
	// message from the gateway (a HeartbeatAck, a Command, …) before the
	// Agent closes it as silent (EffectClose with Abort) and reconnects. A
	// gateway answers every heartbeat, so a live one is heard at least once
	// per heartbeat interval. Zero means 3 heartbeat intervals, at most
	// DefaultSilenceCap (15 s with the usual 10 s interval). It is never
	// taken below 1.5 heartbeat intervals, which would close live sessions
	// between two heartbeats.
	SilenceTimeout time.Duration
	// RebootDowntime is how long the machine is down on node.reboot
	// (default 5 s).
	RebootDowntime time.Duration
	// JournalRetention is how long past its deadline a finished command
	// stays in the journal (default 10 min). Past its deadline a command is
	// answered FAILED without running, so pruning it is safe.
	JournalRetention time.Duration
	// HelloJournalMax is how many of the latest journal entries Hello
	// carries (default 256, at most MaxHelloJournal).
	HelloJournalMax int
	// LossSkew widens the journal-loss window: a command that is not in the
	// journal and not retry-safe is failed if its id's ULID time is before
	// Journal.LostAt()+LossSkew (default 0; set it to the clock skew allowed
	// between the control plane and the machine).
	LossSkew time.Duration
	// CommandSigningRoot is the command-signing root's Ed25519 public key
	// when the deployment signs intent (signedIntent; received at Join).
	// With it, a Command or DesiredState whose signature is missing or does
	// not verify over pkg/pki CommandSigningInput / SpecSigningInput with
	// NodeID is refused and reported, never run or applied. Nil accepts
	// intent unverified.
	CommandSigningRoot ed25519.PublicKey
	// CertNotBefore and CertNotAfter are the validity of the node
	// certificate the driver presents. With CertNotAfter set, the Agent
	// renews the certificate over the established session once less than a
	// third of its lifetime (CertNotAfter − CertNotBefore, counted from
	// CertReceivedAt when that is later) is left. A zero CertNotAfter renews
	// nothing.
	CertNotBefore, CertNotAfter time.Time
	// CertReceivedAt is when the driver received that certificate (e.g.
	// the Join that just issued it); zero when unknown (a certificate read
	// back from disk). The renewal point counts from the later of it and
	// CertNotBefore, so a backdated NotBefore never puts it in the past.
	CertReceivedAt time.Time
	// RenewTimeout is how long a renewal waits for the driver's CSR or the
	// gateway's CertificateIssued before it counts as failed (default 30 s).
	RenewTimeout time.Duration
	// RenewBackoffMin and RenewBackoffMax bound the wait before a failed
	// renewal is tried again: after the n-th failure in a row, between half
	// and all of min(RenewBackoffMax, RenewBackoffMin·2^(n-1)) (defaults 5 s
	// and 10 min). RenewBackoffMin is also the least time between two
	// renewals.
	RenewBackoffMin, RenewBackoffMax time.Duration
	// Logger receives the Agent's rare warnings; nil discards them. The
	// caller's logger names the node (pkg/agent's carries node.id).
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.BackoffMin, 250*time.Millisecond)
	def(&c.BackoffMax, 30*time.Second)
	def(&c.BackoffResetAfter, 30*time.Second)
	def(&c.HelloTimeout, 30*time.Second)
	def(&c.DefaultHeartbeat, 10*time.Second)
	def(&c.RebootDowntime, 5*time.Second)
	def(&c.JournalRetention, 10*time.Minute)
	def(&c.RenewTimeout, 30*time.Second)
	def(&c.RenewBackoffMin, 5*time.Second)
	def(&c.RenewBackoffMax, 10*time.Minute)
	if c.RenewBackoffMax < c.RenewBackoffMin {
		c.RenewBackoffMax = c.RenewBackoffMin
	}
	if c.HelloJournalMax <= 0 {
		c.HelloJournalMax = 256
	}
	c.HelloJournalMax = min(c.HelloJournalMax, MaxHelloJournal)
	if c.BackoffMax < c.BackoffMin {
		c.BackoffMax = c.BackoffMin
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// State is the Agent's session state.
type State uint8

// The session states.
const (
	// StateIdle is before Start.
	StateIdle State = iota
	// StateBackoff waits to dial again (Status.NextDial says when).
	StateBackoff
	// StateDialing has asked the driver to open a session.
	StateDialing
	// StateHello has sent Hello and waits for Welcome.
	StateHello
	// StateEstablished has a session: heartbeats flow, commands run.
	StateEstablished
	// StateRebooting is down for a reboot.
	StateRebooting
	// StateStopped has stopped for good (Status.Stopped says why): the node
	// was revoked or its certificate expired, and it must join again.
	StateStopped
)

// String returns the state's name.
func (s State) String() string {
	switch s {
	case StateIdle:
		return "idle"
	case StateBackoff:
		return "backoff"
	case StateDialing:
		return "dialing"
	case StateHello:
		return "hello"
	case StateEstablished:
		return "established"
	case StateRebooting:
		return "rebooting"
	case StateStopped:
		return "stopped"
	}
	return "State(" + strconv.Itoa(int(s)) + ")"
}

// Agent is the daemon core of one machine. It is not safe for concurrent use:
// a driver calls it from one goroutine (or holds a lock).
type Agent struct {
	cfg Config
	hw  Hardware
	j   Journal
	rnd Rand

	state         State
	session       uint64 // number of the current (or last) session
	sessionID     string // Welcome.session_id of the established session
	gatewayID     string // Welcome.gateway_id of the established session
	heartbeat     time.Duration
	silence       time.Duration // silence timeout of the established session, 0: unchecked
	heardAt       time.Time     // last message from the gateway (StateEstablished)
	silenced      int           // sessions closed because the gateway was silent
	hbSeq         int64
	establishedAt time.Time
	failures      int // sessions that ended (or failed) since the backoff last reset

	dialAt        time.Time // StateBackoff
	helloDeadline time.Time // StateHello
	nextHeartbeat time.Time // StateEstablished
	upAt          time.Time // StateRebooting: when the machine is back

	observed int64
	allocs   []allocation // sorted by reservation id
	running  []running    // sorted by due, then seq
	// rebooting is the node.reboot waiting for the commands before it
	// (nil when none): it completes at rebootAt.
	rebooting *running
	seq       uint64
	unsent    []string // command ids whose latest update is yet to be sent

	cert renewal // the node certificate and its renewal

	stopped error // why the Agent stopped for good (StateStopped)
	// dialRenewals is cert.renewals when the current session was dialled:
	// a session opened with a certificate since renewed may be refused for
	// that old certificate's revocation without the node being revoked.
	dialRenewals int

	announced time.Time // last EffectTimer At returned

	// access is what the node's SSH server accepts logins against
	// (tunnel.go); sshRefusals the refusals to report after the next
	// Welcome.
	access      *SSHAccess
	sshRefusals []*gatewayv1.SshRefused
}

type allocation struct {
	reservationID string
	devices       []int32
}

type running struct {
	due      time.Time
	deadline time.Time // the command's deadline; zero when none
	seq      uint64
	id       string
	kind     string
	result   *gatewayv1.CommandResult
	err      error
}

// MaxHelloJournal is the most journal entries a Hello may carry
// (gateway.proto's Hello.journal max_items).
const MaxHelloJournal = 1024

// New returns an Agent for the node cfg.NodeID on hw, journaling into j and
// drawing jitter from rnd. It fails when a dependency or the node id is
// missing.
func New(cfg Config, hw Hardware, j Journal, rnd Rand) (*Agent, error) {
	switch {
	case cfg.NodeID == "":
		return nil, errors.New("daemon: node id is required")
	case hw == nil:
		return nil, errors.New("daemon: hardware is required")
	case j == nil:
		return nil, errors.New("daemon: journal is required")
	case rnd == nil:
		return nil, errors.New("daemon: rand is required")
	case cfg.CommandSigningRoot != nil && len(cfg.CommandSigningRoot) != ed25519.PublicKeySize:
		return nil, fmt.Errorf("daemon: command-signing root must be an Ed25519 public key of %d bytes", ed25519.PublicKeySize)
	case !cfg.CertNotAfter.IsZero() && (cfg.CertNotBefore.IsZero() || !cfg.CertNotBefore.Before(cfg.CertNotAfter)):
		return nil, errors.New("daemon: the certificate's NotBefore must be set and before its NotAfter")
	}
	cfg.setDefaults()
	a := &Agent{cfg: cfg, hw: hw, j: j, rnd: rnd, access: noAccess}
	a.cert.notBefore, a.cert.notAfter, a.cert.receivedAt = cfg.CertNotBefore, cfg.CertNotAfter, cfg.CertReceivedAt
	a.cert.at = a.renewPoint()
	return a, nil
}

// Status is a snapshot of an Agent, for handles, health checks and tests.
type Status struct {
	// State is the session state.
	State State
	// Session is the number of the current (or last) session.
	Session uint64
	// SessionID is Welcome.session_id while established, else "".
	SessionID string
	// GatewayID is Welcome.gateway_id while established, else "".
	GatewayID string
	// Silenced counts the sessions the Agent closed because the gateway
	// sent nothing for the silence timeout (Config.SilenceTimeout).
	Silenced int
	// BootID is the machine's current boot id.
	BootID string
	// ObservedGeneration is the NodeSpec generation applied.
	ObservedGeneration int64
	// Allocations is how many allocations the applied spec holds.
	Allocations int
	// Running is how many commands are running (a node.reboot waiting for
	// the commands before it included).
	Running int
	// NextDial is when the Agent dials again (StateBackoff only).
	NextDial time.Time
	// CertNotAfter is when the node certificate in use expires (zero when
	// the Agent does not renew it).
	CertNotAfter time.Time
	// Renewals counts the certificates renewed since the Agent was made.
	Renewals int
	// Stopped is why the Agent stopped for good (StateStopped only); it
	// matches ErrRevoked or ErrCertificateExpired with errors.Is.
	Stopped error
}

// Status returns a snapshot of the Agent.
func (a *Agent) Status() Status {
	s := Status{
		State:              a.state,
		Session:            a.session,
		SessionID:          a.sessionID,
		GatewayID:          a.gatewayID,
		Silenced:           a.silenced,
		BootID:             a.hw.BootID(),
		ObservedGeneration: a.observed,
		Allocations:        len(a.allocs),
		Running:            len(a.running) + btoi(a.rebooting != nil),
		CertNotAfter:       a.cert.notAfter,
		Renewals:           a.cert.renewals,
		Stopped:            a.stopped,
	}
	if a.state == StateBackoff {
		s.NextDial = a.dialAt
	}
	return s
}

// NodeID returns the node id the Agent was made for.
func (a *Agent) NodeID() string { return a.cfg.NodeID }

// Allocations returns the applied allocations: reservation id → CDI device
// names, in reservation id order.
func (a *Agent) Allocations() []AllocationStatus {
	out := make([]AllocationStatus, 0, len(a.allocs))
	for _, al := range a.allocs {
		out = append(out, AllocationStatus{ReservationID: al.reservationID, CDIDevices: cdiNames(al.devices)})
	}
	return out
}

// AllocationStatus is one applied allocation.
type AllocationStatus struct {
	// ReservationID is the reservation the devices are bound to.
	ReservationID string
	// CDIDevices are the bound devices' CDI names ("nvidia.com/gpu=<index>").
	CDIDevices []string
}

// NextTimer returns when the Agent next needs Tick, or the zero time.
func (a *Agent) NextTimer() time.Time { return a.nextDeadline() }

// out collects the effects of one input.
type out struct{ effects []Effect }

func (o *out) add(e Effect) { o.effects = append(o.effects, e) }

// finish appends an EffectTimer when the next deadline changed since the last
// one announced, and returns the effects.
func (a *Agent) finish(o *out) []Effect {
	if next := a.nextDeadline(); !next.Equal(a.announced) {
		a.announced = next
		o.add(Effect{Kind: EffectTimer, At: next})
	}
	return o.effects
}

// Start starts the Agent at now: commands the journal shows running were
// interrupted (this Agent did not start them): retry-safe ones before their
// deadline wait to run again when delivered again, others are failed as
// interrupted; finished ones long past their deadline are pruned, and the
// first session is dialed at once. It returns nil when the Agent was
// started already.
func (a *Agent) Start(now time.Time) []Effect {
	if a.state != StateIdle {
		return nil
	}
	for _, e := range a.j.Entries() {
		if !e.Terminal() {
			a.interrupt(now, e, ErrTextInterrupted)
		}
	}
	a.prune(now)
	var o out
	a.dial(now, &o)
	return a.finish(&o)
}

// Connected reports that the driver opened session for sending; the Agent
// sends Hello. A stale session is closed.
func (a *Agent) Connected(now time.Time, session uint64) []Effect {
	var o out
	if session != a.session || a.state != StateDialing {
		o.add(Effect{Kind: EffectClose, Session: session, Reason: "stale session"})
		return a.finish(&o)
	}
	a.prune(now)
	a.state = StateHello
	a.helloDeadline = now.Add(a.cfg.HelloTimeout)
	entries := a.j.Entries()
	if len(entries) > a.cfg.HelloJournalMax {
		entries = entries[len(entries)-a.cfg.HelloJournalMax:]
	}
	hello := &gatewayv1.Hello{
		NodeId:             a.cfg.NodeID,
		BootId:             a.hw.BootID(),
		ObservedGeneration: a.observed,
		AgentVersion:       a.cfg.AgentVersion,
		Journal:            make([]*gatewayv1.JournalEntry, 0, len(entries)),
	}
	for _, e := range entries {
		hello.Journal = append(hello.Journal, &gatewayv1.JournalEntry{CommandId: e.CommandID, State: e.State})
	}
	a.send(&o, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Hello{Hello: hello}})
	return a.finish(&o)
}

// Disconnected reports that session ended or could not be opened (err says
// why). The Agent backs off and dials again, unless err matches ErrRevoked
// and the session presented the certificate still in use (none was renewed
// since it was dialled): then it stops for good (StateStopped, EffectStop).
// Stale sessions are ignored.
func (a *Agent) Disconnected(now time.Time, session uint64, err error) []Effect {
	var o out
	if session != a.session {
		return nil
	}
	switch a.state {
	case StateDialing, StateHello, StateEstablished:
	default:
		return nil
	}
	if errors.Is(err, ErrRevoked) {
		if a.cert.renewals == a.dialRenewals {
			a.stop(&o, fmt.Errorf("node %s was revoked (%w); it stops and must join again with a new join token", a.cfg.NodeID, err))
			return a.finish(&o)
		}
		// The session presented a certificate renewed since: the next dial
		// presents the new one, and is terminal if refused too.
		a.cfg.Logger.Warn("the certificate this session was opened with is revoked; reconnecting with the renewed one",
			"session", session, "err", err)
	}
	if err != nil {
		a.cfg.Logger.Debug("session ended", "session", session, "err", err)
	}
	a.lose(now)
	return a.finish(&o)
}

// stop ends the Agent for good: no session, no dial, no renewal; reason is
// logged as an error and handed to the driver (EffectStop).
func (a *Agent) stop(o *out, reason error) {
	a.state = StateStopped
	a.sessionID, a.gatewayID = "", ""
	a.stopped = reason
	a.cert.phase = renewIdle
	a.cert.csr = nil
	a.cfg.Logger.Error("machine stopped for good", "reason", reason.Error())
	o.add(Effect{Kind: EffectStop, Reason: reason.Error()})
}

// lose ends the current session and schedules the next dial with backoff.
func (a *Agent) lose(now time.Time) {
	if a.state == StateEstablished && now.Sub(a.establishedAt) >= a.cfg.BackoffResetAfter {
		a.failures = 0
	}
	a.failures++
	a.state = StateBackoff
	a.sessionID, a.gatewayID = "", ""
	a.dialAt = now.Add(a.Backoff(a.failures))
}

// Backoff returns the reconnect delay after the n-th consecutive failure
// (n ≥ 1): uniform in [0, min(BackoffMax, BackoffMin·2^(n-1))] ("full
// jitter"). It draws from the Agent's Rand.
func (a *Agent) Backoff(n int) time.Duration {
	c := BackoffCap(a.cfg.BackoffMin, a.cfg.BackoffMax, n)
	return time.Duration(a.rnd.Int64N(int64(c) + 1))
}

// BackoffCap returns min(maxDelay, minDelay·2^(n-1)) for n ≥ 1 (minDelay for
// smaller n).
func BackoffCap(minDelay, maxDelay time.Duration, n int) time.Duration {
	c := minDelay
	for i := 1; i < n && c < maxDelay; i++ {
		c *= 2
	}
	return min(c, maxDelay)
}

// dial starts a new session, unless the node certificate has expired (at
// or past its NotAfter): then the Agent stops for good, since no gateway
// would accept it.
func (a *Agent) dial(now time.Time, o *out) {
	if na := a.cert.notAfter; !na.IsZero() && !now.Before(na) {
		a.stop(o, fmt.Errorf("node %s: node certificate expired at %s; join again (%w)",
			a.cfg.NodeID, na.UTC().Format(time.RFC3339), ErrCertificateExpired))
		return
	}
	a.session++
	a.dialRenewals = a.cert.renewals
	a.state = StateDialing
	a.sessionID, a.gatewayID = "", ""
	o.add(Effect{Kind: EffectDial, Session: a.session})
}

// Receive handles a message the gateway sent on session. Messages of stale
// sessions are ignored.
func (a *Agent) Receive(now time.Time, session uint64, msg *gatewayv1.SessionResponse) []Effect {
	if session != a.session || (a.state != StateHello && a.state != StateEstablished) {
		return nil
	}
	var o out
	if a.state == StateEstablished {
		// Any message shows the gateway alive (Config.SilenceTimeout).
		a.heardAt = now
	}
	switch m := msg.GetMsg().(type) {
	case *gatewayv1.SessionResponse_Welcome:
		a.welcome(now, &o, m.Welcome)
	case *gatewayv1.SessionResponse_HeartbeatAck:
		// Nothing to do beyond hearing it.
	case *gatewayv1.SessionResponse_Command:
		a.command(now, &o, m.Command)
	case *gatewayv1.SessionResponse_DesiredState:
		a.desired(&o, m.DesiredState)
	case *gatewayv1.SessionResponse_CertificateIssued:
		a.issued(now, &o, m.CertificateIssued)
	case *gatewayv1.SessionResponse_OpenTunnel:
		a.openTunnel(&o, m.OpenTunnel)
	}
	return a.finish(&o)
}

func (a *Agent) welcome(now time.Time, o *out, w *gatewayv1.Welcome) {
	if a.state != StateHello {
		return
	}
	a.state = StateEstablished
	a.sessionID = w.GetSessionId()
	a.gatewayID = w.GetGatewayId()
	a.establishedAt = now
	a.heartbeat = a.cfg.DefaultHeartbeat
	if d := w.GetHeartbeatInterval(); d != nil && d.AsDuration() > 0 {
		a.heartbeat = max(d.AsDuration(), 10*time.Millisecond)
	}
	a.nextHeartbeat = now.Add(a.heartbeat)
	a.heardAt = now
	a.silence = SilenceTimeout(a.cfg.SilenceTimeout, a.heartbeat)
	// Updates that could not be sent while disconnected.
	pending := a.unsent
	a.unsent = nil
	for _, id := range pending {
		if e, ok := a.j.Get(id); ok {
			a.send(o, updateOf(&e))
		}
	}
	// Bindings may have been reported on a session that broke before the
	// gateway read them; they carry their generation, so repeats are safe.
	for _, al := range a.allocs {
		a.send(o, boundOf(al, a.observed))
	}
	a.sendSSHRefusals(o)
	if a.cert.phase != renewIdle {
		// The session that carried the renewal ended before its answer.
		a.renewFailed(now, "the session ended before the certificate was issued")
	}
	if a.cert.at.Before(now) {
		// Overdue while there was no session: renew now.
		a.cert.at = now
	}
}

// Tick handles every timer due at now: command completions, the reboot
// coming back, the next dial, the Welcome timeout and heartbeats.
func (a *Agent) Tick(now time.Time) []Effect {
	var o out
	for range 1000 { // bound the loop; each step consumes one deadline
		if !a.step(now, &o) {
			break
		}
	}
	return a.finish(&o)
}

// step handles the earliest deadline if it is due and reports whether it
// did. A command completion due at the same time as a session deadline goes
// first, and one due at the same time as a waiting node.reboot goes before
// it.
func (a *Agent) step(now time.Time, o *out) bool {
	sd := a.sessionDeadline()
	if cd := a.commandDeadline(); !cd.IsZero() && !cd.After(now) && (sd.IsZero() || !sd.Before(cd)) {
		if len(a.running) > 0 && a.running[0].due.Equal(cd) {
			r := a.running[0]
			a.running = slices.Delete(a.running, 0, 1)
			a.complete(now, o, r)
			return true
		}
		r := *a.rebooting
		a.rebooting = nil
		a.complete(now, o, r)
		return true
	}
	if rd := a.renewDeadline(); !rd.IsZero() && !rd.After(now) && (sd.IsZero() || !sd.Before(rd)) {
		a.renewStep(now, o)
		return true
	}
	if sd.IsZero() || sd.After(now) {
		return false
	}
	switch a.state {
	case StateRebooting:
		boot := a.hw.Reboot()
		o.add(Effect{Kind: EffectReboot, BootID: boot})
		a.dial(now, o)
	case StateBackoff:
		a.dial(now, o)
	case StateHello:
		o.add(Effect{Kind: EffectClose, Session: a.session, Abort: true, Reason: "no Welcome within " + a.cfg.HelloTimeout.String()})
		a.lose(now)
	case StateEstablished:
		if a.silence > 0 && !now.Before(a.heardAt.Add(a.silence)) {
			a.silenced++
			a.cfg.Logger.Warn("the gateway is silent; dropping the session to reconnect",
				"session", a.session, "gateway", a.gatewayID, "silent_for", now.Sub(a.heardAt).String())
			o.add(Effect{Kind: EffectClose, Session: a.session, Abort: true,
				Reason: "gateway silent for " + a.silence.String()})
			a.lose(now)
			return true
		}
		a.hbSeq++
		a.send(o, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Heartbeat{Heartbeat: &gatewayv1.Heartbeat{
			Seq:                a.hbSeq,
			ObservedGeneration: a.observed,
			SentAt:             timestamppb.New(now),
		}}})
		// Skip beats missed by a late Tick rather than bursting them.
		a.nextHeartbeat = a.nextHeartbeat.Add(a.heartbeat)
		if !a.nextHeartbeat.After(now) {
			a.nextHeartbeat = now.Add(a.heartbeat)
		}
	}
	return true
}

func (a *Agent) sessionDeadline() time.Time {
	switch a.state {
	case StateRebooting:
		return a.upAt
	case StateBackoff:
		return a.dialAt
	case StateHello:
		return a.helloDeadline
	case StateEstablished:
		if a.silence > 0 {
			if silentAt := a.heardAt.Add(a.silence); silentAt.Before(a.nextHeartbeat) {
				return silentAt
			}
		}
		return a.nextHeartbeat
	}
	return time.Time{}
}

// commandDeadline returns when the next command completes (the earliest
// running command, or the waiting node.reboot), or the zero time.
func (a *Agent) commandDeadline() time.Time {
	var d time.Time
	if len(a.running) > 0 {
		d = a.running[0].due
	}
	if a.rebooting != nil {
		if ra := a.rebootAt(); d.IsZero() || ra.Before(d) {
			d = ra
		}
	}
	return d
}

// rebootAt returns when the waiting node.reboot completes: once its own run
// is done and every other running command (each started before it, or
// queued before it) has finished or reached its deadline, but no later than
// the reboot's own deadline (or its own run, if that ends after it).
func (a *Agent) rebootAt() time.Time {
	r := a.rebooting
	at := r.due
	for _, x := range a.running {
		end := x.due
		if !x.deadline.IsZero() && x.deadline.Before(end) {
			end = x.deadline
		}
		if end.After(at) {
			at = end
		}
	}
	if !r.deadline.IsZero() {
		if limit := later(r.due, r.deadline); at.After(limit) {
			at = limit
		}
	}
	return at
}

func later(x, y time.Time) time.Time {
	if y.After(x) {
		return y
	}
	return x
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// SilenceTimeout returns the silence timeout of a session with heartbeat
// interval hb when Config.SilenceTimeout is configured: configured, or for
// zero min(3·hb, DefaultSilenceCap); never below 1.5·hb.
func SilenceTimeout(configured, hb time.Duration) time.Duration {
	d := configured
	if d <= 0 {
		d = min(3*hb, DefaultSilenceCap)
	}
	return max(d, hb+hb/2)
}

func (a *Agent) nextDeadline() time.Time {
	d := a.sessionDeadline()
	if cd := a.commandDeadline(); !cd.IsZero() && (d.IsZero() || cd.Before(d)) {
		d = cd
	}
	if rd := a.renewDeadline(); !rd.IsZero() && (d.IsZero() || rd.Before(d)) {
		d = rd
	}
	return d
}

// connected reports whether messages can be sent now.
func (a *Agent) connected() bool { return a.state == StateHello || a.state == StateEstablished }

// send sends m on the session, fitted to the gateway's rules (Conform)
// when it carries text (see carriesText).
func (a *Agent) send(o *out, m *gatewayv1.SessionRequest) {
	if carriesText(m) {
		if fitted, err := Conform(m); err != nil {
			a.cfg.Logger.Warn("message fitted to the gateway's rules before sending", "msg", DescribeRequest(fitted), "err", err)
			m = fitted
		}
	}
	o.add(Effect{Kind: EffectSend, Session: a.session, Msg: m})
}

// carriesText reports whether m may hold a string: heartbeats and
// observed-generation reports, the most frequent messages, hold none and
// skip Conform's check.
func carriesText(m *gatewayv1.SessionRequest) bool {
	switch m.GetMsg().(type) {
	case *gatewayv1.SessionRequest_Heartbeat:
		return false
	case *gatewayv1.SessionRequest_Report:
		_, gen := m.GetReport().GetReport().(*gatewayv1.Report_ObservedGeneration)
		return !gen
	}
	return true
}

// sendUpdate sends the entry's update now, or after the next Welcome.
func (a *Agent) sendUpdate(o *out, e *Entry) {
	if a.state == StateEstablished {
		a.send(o, updateOf(e))
		return
	}
	a.markUnsent(e.CommandID)
}

func (a *Agent) markUnsent(id string) {
	if !slices.Contains(a.unsent, id) {
		a.unsent = append(a.unsent, id)
	}
}

func (a *Agent) put(e Entry) bool {
	if err := a.j.Put(e); err != nil {
		a.cfg.Logger.Warn("journal write failed", "command.id", e.CommandID, "err", err)
		return false
	}
	return true
}

// prune fails interrupted commands whose deadline passed before they were
// delivered again (they are never run again), and forgets finished commands
// whose deadline passed more than JournalRetention ago.
func (a *Agent) prune(now time.Time) {
	cutoff := now.Add(-a.cfg.JournalRetention)
	for _, e := range a.j.Entries() {
		if e.Interrupted != "" && !e.Terminal() && !e.Deadline.IsZero() && now.After(e.Deadline) {
			a.failInterrupted(now, e, e.Interrupted)
			continue
		}
		if e.Terminal() && !e.Deadline.IsZero() && e.Deadline.Before(cutoff) && !slices.Contains(a.unsent, e.CommandID) {
			if err := a.j.Delete(e.CommandID); err != nil {
				a.cfg.Logger.Warn("journal delete failed", "command.id", e.CommandID, "err", err)
			}
		}
	}
}

func updateOf(e *Entry) *gatewayv1.SessionRequest {
	return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{
		CommandId: e.CommandID,
		State:     e.State,
		Result:    e.Result,
		Error:     e.Error,
	}}}
}

// command handles a delivered command (docs/architecture.md, "Commands").
func (a *Agent) command(now time.Time, o *out, c *gatewayv1.Command) {
	id := c.GetCommandId()
	if id == "" {
		return
	}
	if reason := a.verifyCommand(c); reason != "" {
		// Not journaled: nothing ran, and a correctly signed delivery of
		// the same id may still run.
		a.cfg.Logger.Warn("command refused", "command.id", id, "reason", reason)
		a.send(o, updateOf(&Entry{CommandID: id, State: gatewayv1.CommandState_COMMAND_STATE_FAILED, Error: reason}))
		return
	}
	if e, ok := a.j.Get(id); ok {
		if e.Interrupted == "" || e.Terminal() {
			// Redelivered: answer from the journal, never run again.
			a.sendUpdate(o, &e)
			return
		}
		// Retry-safe and interrupted by a reboot or a restart: run again,
		// unless its deadline passed meanwhile.
		if !e.Deadline.IsZero() && now.After(e.Deadline) {
			a.conclude(now, o, e, gatewayv1.CommandState_COMMAND_STATE_FAILED, e.Interrupted)
			return
		}
		if a.heldBack(id, e.Kind) {
			return
		}
		e.Runs = max(e.Runs, 1) + 1
		e.Interrupted = ""
		a.start(now, o, e, c.GetArgsJson())
		return
	}
	e := Entry{
		CommandID:  id,
		Kind:       c.GetKind(),
		RetrySafe:  c.GetRetrySafe(),
		ReceivedAt: now,
	}
	if c.GetDeadline() != nil {
		e.Deadline = c.GetDeadline().AsTime()
	}
	if lost := a.j.LostAt(); !lost.IsZero() && !e.RetrySafe && issuedBefore(id, lost.Add(a.cfg.LossSkew)) {
		a.conclude(now, o, e, gatewayv1.CommandState_COMMAND_STATE_FAILED, ErrTextJournalLost)
		return
	}
	if !e.Deadline.IsZero() && now.After(e.Deadline) {
		// FAILED rather than EXPIRED: the gateway contract takes RUNNING,
		// SUCCEEDED and FAILED from daemons; expiry is the control plane's.
		a.conclude(now, o, e, gatewayv1.CommandState_COMMAND_STATE_FAILED, ErrTextExpired)
		return
	}
	if a.heldBack(id, e.Kind) {
		return
	}
	e.Runs = 1
	a.start(now, o, e, c.GetArgsJson())
}

// heldBack reports whether a command must wait for the node.reboot that
// waits for the commands before it: one queued after that reboot (a later
// id), or another reboot, runs after the machine is back. It is neither
// journaled nor answered: the session ends with the reboot, and the gateway
// delivers it again on the next one.
func (a *Agent) heldBack(id, kind string) bool {
	if a.rebooting == nil || (id < a.rebooting.id && kind != KindNodeReboot) {
		return false
	}
	a.cfg.Logger.Debug("command held back until the machine is back from a reboot", "command.id", id, "reboot", a.rebooting.id)
	return true
}

// start journals e as RUNNING, then runs it. A node.reboot completes once
// the commands before it are done (rebootAt).
func (a *Agent) start(now time.Time, o *out, e Entry, args []byte) {
	e.State = gatewayv1.CommandState_COMMAND_STATE_RUNNING
	if err := a.j.Put(e); err != nil {
		// Not journaled, so not run: a redelivery may try again.
		a.cfg.Logger.Warn("journal write failed", "command.id", e.CommandID, "err", err)
		a.send(o, updateOf(&Entry{CommandID: e.CommandID, State: gatewayv1.CommandState_COMMAND_STATE_FAILED, Error: "journal write failed: " + err.Error()}))
		return
	}
	res, d, err := a.hw.Run(e.Kind, args)
	a.seq++
	r := running{due: now.Add(max(d, 0)), deadline: e.Deadline, seq: a.seq, id: e.CommandID, kind: e.Kind, result: res, err: err}
	if e.Kind == KindNodeReboot && err == nil {
		a.rebooting = &r
		if !a.rebootAt().After(now) {
			// Nothing to wait for.
			a.rebooting = nil
			a.complete(now, o, r)
			return
		}
		a.sendUpdate(o, &e)
		return
	}
	if d <= 0 {
		// Finished at once: its outcome is the only update worth sending
		// (RUNNING would be superseded before the gateway could act on it).
		a.complete(now, o, r)
		return
	}
	a.sendUpdate(o, &e)
	i, _ := slices.BinarySearchFunc(a.running, r, func(x, y running) int {
		if c := x.due.Compare(y.due); c != 0 {
			return c
		}
		return cmp.Compare(x.seq, y.seq)
	})
	a.running = slices.Insert(a.running, i, r)
}

// conclude journals and reports a command that ends without running (again).
func (a *Agent) conclude(now time.Time, o *out, e Entry, s gatewayv1.CommandState, msg string) {
	e.State = s
	e.Error = msg
	e.Interrupted = ""
	e.FinishedAt = now
	a.put(e)
	a.sendUpdate(o, &e)
}

// complete records a finished command and, for node.reboot, takes the
// machine down.
func (a *Agent) complete(now time.Time, o *out, r running) {
	e, ok := a.j.Get(r.id)
	if !ok {
		e = Entry{CommandID: r.id, Kind: r.kind, ReceivedAt: now}
	}
	e.FinishedAt = now
	if r.err != nil {
		e.State = gatewayv1.CommandState_COMMAND_STATE_FAILED
		e.Error = r.err.Error()
	} else {
		e.State = gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED
		e.Result = r.result
	}
	a.put(e)
	a.sendUpdate(o, &e)
	if r.kind == KindNodeReboot && r.err == nil {
		a.reboot(now, o)
	}
}

// reboot takes the machine down: the session closes, commands still
// running (only those the node.reboot stopped waiting for at a deadline)
// are interrupted, and the machine is back after RebootDowntime.
func (a *Agent) reboot(now time.Time, o *out) {
	if a.connected() || a.state == StateDialing {
		o.add(Effect{Kind: EffectClose, Session: a.session, Reason: "rebooting"})
	}
	for _, r := range a.running {
		if e, ok := a.j.Get(r.id); ok {
			a.interrupt(now, e, ErrTextRebooted)
		}
	}
	a.running = nil
	a.state = StateRebooting
	a.sessionID, a.gatewayID = "", ""
	a.failures = 0
	a.upAt = now.Add(a.cfg.RebootDowntime)
}

// interrupt records that the running command e was cut short (why is
// ErrTextRebooted or ErrTextInterrupted). A retry-safe one before its
// deadline stays RUNNING, marked interrupted, and runs again when the
// gateway delivers it again; any other is failed with why.
func (a *Agent) interrupt(now time.Time, e Entry, why string) {
	if e.Interrupted != "" {
		why = e.Interrupted // interrupted before, and not delivered since
	}
	if e.RetrySafe && (e.Deadline.IsZero() || now.Before(e.Deadline)) {
		if e.Interrupted == "" {
			e.Interrupted = why
			a.put(e)
		}
		return
	}
	a.failInterrupted(now, e, why)
}

// failInterrupted journals an interrupted command FAILED with why and
// reports it when a session is established.
func (a *Agent) failInterrupted(now time.Time, e Entry, why string) {
	e.State = gatewayv1.CommandState_COMMAND_STATE_FAILED
	e.Error = why
	e.Result = nil
	e.Interrupted = ""
	e.FinishedAt = now
	a.put(e)
	a.markUnsent(e.CommandID)
}

// issuedBefore reports whether the command id's ULID time is not after t.
// Ids that carry no ULID count as issued before (the safe answer).
func issuedBefore(id string, t time.Time) bool {
	i := strings.LastIndexByte(id, '_')
	u, err := ulid.ParseStrict(id[i+1:])
	if err != nil {
		return true
	}
	return !ulid.Time(u.Time()).After(t)
}

// desired applies a DesiredState (docs/architecture.md, "Reservations").
func (a *Agent) desired(o *out, ds *gatewayv1.DesiredState) {
	g := ds.GetGeneration()
	if reason := a.verifySpec(ds); reason != "" {
		a.cfg.Logger.Warn("desired state refused", "generation", g, "reason", reason)
		a.send(o, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
			Report: &gatewayv1.Report_SpecRefused{SpecRefused: &gatewayv1.SpecRefused{Generation: g, Reason: reason}},
		}}})
		return
	}
	if g < a.observed {
		return
	}
	if g == a.observed {
		a.send(o, observedOf(g))
		return
	}
	authorities, err := sshca.Authorities(ds.GetSpec().GetSshUserCas())
	if err != nil {
		// Refused like a badly signed spec, and the SSH server trusts no CA
		// until a spec with usable ones is applied: the control plane meant
		// to change the node's trust (a rotation), so keeping the CAs of the
		// previous spec could keep trusting the very CA it rotates out.
		reason := ErrTextSpecBadSSHCA + ": " + err.Error()
		a.cfg.Logger.Warn("desired state refused", "generation", g, "reason", reason)
		a.send(o, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
			Report: &gatewayv1.Report_SpecRefused{SpecRefused: &gatewayv1.SpecRefused{Generation: g, Reason: reason}},
		}}})
		a.access = a.specAccess(nil, a.allocs)
		return
	}
	next := make([]allocation, 0, len(ds.GetSpec().GetAllocations()))
	for _, al := range ds.GetSpec().GetAllocations() {
		rid := al.GetReservationId()
		if rid == "" || slices.ContainsFunc(next, func(x allocation) bool { return x.reservationID == rid }) {
			continue
		}
		next = append(next, allocation{reservationID: rid, devices: slices.Clone(al.GetDeviceIndexes())})
	}
	for _, old := range a.allocs {
		if !slices.ContainsFunc(next, func(x allocation) bool { return x.reservationID == old.reservationID }) {
			a.send(o, &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
				Report: &gatewayv1.Report_AllocationUnbound{AllocationUnbound: &gatewayv1.AllocationUnbound{ReservationId: old.reservationID, Generation: g}},
			}}})
		}
	}
	for _, al := range next {
		i, found := a.findAlloc(al.reservationID)
		if found && slices.Equal(a.allocs[i].devices, al.devices) {
			continue
		}
		a.send(o, boundOf(al, g))
	}
	slices.SortFunc(next, func(x, y allocation) int { return strings.Compare(x.reservationID, y.reservationID) })
	a.allocs = next
	a.access = a.specAccess(authorities, next)
	a.observed = g
	a.send(o, observedOf(g))
}

func (a *Agent) findAlloc(rid string) (int, bool) {
	return slices.BinarySearchFunc(a.allocs, rid, func(x allocation, id string) int { return strings.Compare(x.reservationID, id) })
}

func observedOf(g int64) *gatewayv1.SessionRequest {
	return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
		Report: &gatewayv1.Report_ObservedGeneration{ObservedGeneration: g},
	}}}
}

func boundOf(al allocation, g int64) *gatewayv1.SessionRequest {
	return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{
		Report: &gatewayv1.Report_AllocationBound{AllocationBound: &gatewayv1.AllocationBound{
			ReservationId: al.reservationID,
			CdiDevices:    cdiNames(al.devices),
			Generation:    g,
		}},
	}}}
}

// CDIName returns the CDI device name of GPU index: "nvidia.com/gpu=<index>".
func CDIName(index int32) string { return "nvidia.com/gpu=" + strconv.Itoa(int(index)) }

func cdiNames(devices []int32) []string {
	out := make([]string, len(devices))
	for i, d := range devices {
		out[i] = CDIName(d)
	}
	return out
}

// HeartbeatInterval returns the interval in use, for tests and status.
func (a *Agent) HeartbeatInterval() time.Duration { return a.heartbeat }

// String describes the Agent for logs.
func (a *Agent) String() string {
	return fmt.Sprintf("agent %s %s session=%d observed=%d", a.cfg.NodeID, a.state, a.session, a.observed)
}
