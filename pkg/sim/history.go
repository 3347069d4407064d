package sim

import (
	"time"
)

// RecordKind says what a Record tells the checkers.
type RecordKind uint8

// The kinds of record. Each names the fields it sets.
const (
	// RecHeard: a gateway received a message from Node at At.
	RecHeard RecordKind = iota + 1
	// RecUnreachable: the stub's sweeper marked Node unreachable at At.
	RecUnreachable
	// RecReachable: Node was heard from again after being unreachable.
	RecReachable
	// RecBookingStart: Reservation was booked on Node, devices Devices
	// (GPUs of them), from At until End unless released earlier.
	RecBookingStart
	// RecReleaseRequested: the workload asked at At to release Reservation.
	RecReleaseRequested
	// RecBookingEnd: Reservation's booking ended at At because of Cause
	// (CauseRelease or CauseExpiry).
	RecBookingEnd
	// RecNodeHolds: the daemon of Node holds Holds (its applied
	// allocations) from At on.
	RecNodeHolds
	// RecCommandCreated: Command (for Node, RetrySafe) was issued at At.
	RecCommandCreated
	// RecExecuted: the hardware of Node ran Command at At ("" when the
	// simulator could not tell which command ran), for Took; Runs is the
	// run count the daemon's journal held for Command as it ran (0 when
	// the journal held no RUNNING entry of it).
	RecExecuted
	// RecJournalLost: Node lost its command journal at At.
	RecJournalLost
	// RecSpecDelivered: a gateway sent Node a DesiredState of generation Gen
	// at At.
	RecSpecDelivered
	// RecSpecObserved: a gateway heard from Node at At that it applied
	// generation Gen.
	RecSpecObserved
	// RecUsageWindow: the usage meter wrote Secs GPU-seconds for
	// Reservation in the UTC hour starting at Window.
	RecUsageWindow
	// RecCommandReceived: the daemon of Node received Command at At and
	// answered it, in the same step, with State (a cmdState name:
	// "running", "succeeded" or "failed"; "" when it sent no update for
	// it) and Error.
	RecCommandReceived
	// RecCommandEnded: the control plane recorded Command's terminal State
	// ("succeeded", "failed" with the daemon's Error, or "expired" at its
	// deadline) at At.
	RecCommandEnded
	// RecBound: a gateway heard from Node at At that its daemon bound the
	// allocation of Reservation (AllocationBound).
	RecBound
	// RecDown: Node went down at At: its daemon process stopped (a crash,
	// a reboot, a journal loss) or its machine went down for a node.reboot.
	// A command still running there was interrupted.
	RecDown

	recordKinds // one past the last kind
)

// Causes of RecBookingEnd.
const (
	// CauseRelease ends a booking because the workload released it.
	CauseRelease = "release"
	// CauseExpiry ends a booking at its end time.
	CauseExpiry = "expiry"
)

// Record is one fact of a run's history, in the order it happened. Only the
// fields of its Kind are set.
type Record struct {
	// At is the simulated time of the fact.
	At   time.Time
	Kind RecordKind
	// Node is the node's id ("node_…").
	Node string
	// Command is a command id ("cmd_…").
	Command string
	// Reservation is a reservation id ("res_…").
	Reservation string
	// Gen is a NodeSpec generation.
	Gen int64
	// Devices are GPU indexes.
	Devices []int32
	// GPUs is how many GPUs a booking has.
	GPUs int
	// End is a booking's scheduled end.
	End time.Time
	// Cause is why a booking ended.
	Cause string
	// RetrySafe is the command's retry_safe flag.
	RetrySafe bool
	// Holds are a daemon's applied allocations, in reservation id order.
	Holds []Hold
	// Window is the start of a usage window (a whole UTC hour).
	Window time.Time
	// Secs is a usage window's GPU-seconds.
	Secs int64
	// State is a command's state (RecCommandReceived, RecCommandEnded).
	State string
	// Error is a failed command's error text.
	Error string
	// Runs is a command's run count in the daemon's journal (RecExecuted).
	Runs int
	// Took is how long a command runs on the hardware (RecExecuted).
	Took time.Duration
}

// Hold is one allocation a daemon has applied.
type Hold struct {
	// Reservation is the reservation id.
	Reservation string
	// Devices are its GPU indexes.
	Devices []int32
}

// Violation is one breach of an invariant.
type Violation struct {
	// Invariant is "I1", "I2", "I3", "I4", "I5", "I8" or "progress".
	Invariant string `json:"invariant"`
	// At is the simulated time the breach was found.
	At time.Time `json:"-"`
	// AtMs is At in milliseconds since the run's start (set in the report).
	AtMs int64 `json:"atMs"`
	// Node is the node involved, if one is.
	Node string `json:"node,omitempty"`
	// Detail says what happened.
	Detail string `json:"detail"`
}

// Checker checks one invariant over a history fed to it in time order. A
// Checker holds only what it needs, so the simulator streams records to it
// instead of keeping the history.
type Checker interface {
	// Invariant returns the invariant's name and one line saying what it
	// checks.
	Invariant() (name, summary string)
	// Observe takes the next record (At never decreases) and returns the
	// violations it reveals.
	Observe(r *Record) []Violation
	// Finish is called once when the run ended at end; it returns the
	// violations left to report.
	Finish(end time.Time) []Violation
}

// Checkers returns a fresh checker of every invariant the simulator checks
// in a run at chaos level chaos, in order: I1, I2, I3, I4, I5, I8 and
// progress (strict with ChaosNone; see newProgress).
func Checkers(chaos Chaos) []Checker {
	return []Checker{newI1(), newI2(), newI3(), newI4(), newI5(), newI8(), newProgress(chaos == ChaosNone)}
}

// Invariants returns "<name>: <summary>" for every invariant checked, one
// per line's worth, in order (the CLI's help text lists them). Each
// summary ends by saying what it exercises: the daemon core, or the
// stub's own bookkeeping.
func Invariants() []string {
	var out []string
	for _, c := range Checkers(ChaosNone) {
		n, s := c.Invariant()
		out = append(out, n+": "+s)
	}
	return out
}

// Check runs checker over history and returns every violation, for tests
// and for replaying a recorded history.
func Check(c Checker, history []Record, end time.Time) []Violation {
	var out []Violation
	for i := range history {
		out = append(out, c.Observe(&history[i])...)
	}
	return append(out, c.Finish(end)...)
}
