package daemon

import (
	"time"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// Entry is what the journal knows about one command: written with state
// RUNNING before the command runs, then again with its terminal state. The
// last update sent for a command is derived from its entry, so a
// redelivered command is answered from the journal.
type Entry struct {
	// CommandID is the command's id ("cmd_…").
	CommandID string
	// Kind is the command kind, e.g. "diag.nvml".
	Kind string
	// RetrySafe is the command's retry_safe flag.
	RetrySafe bool
	// State is the last state the daemon reached: RUNNING, SUCCEEDED or
	// FAILED (the Agent never reports EXPIRED; see ErrTextExpired).
	State gatewayv1.CommandState
	// Result is the result of a SUCCEEDED command. Treat it as immutable.
	Result *gatewayv1.CommandResult
	// Error says why a FAILED command did not succeed.
	Error string
	// Deadline is the command's deadline (zero when it had none).
	Deadline time.Time
	// ReceivedAt is when the daemon first saw the command.
	ReceivedAt time.Time
	// FinishedAt is when the command reached its terminal state (zero while
	// it runs).
	FinishedAt time.Time
	// Runs is how many times the daemon started the command: 1 once it
	// ran, one more each time a retry-safe command interrupted by a reboot
	// or a restart of the daemon runs again. 0 for a command that ended
	// without running (and in entries written before Runs existed).
	Runs int
	// Interrupted says why the last run of a retry-safe command was cut
	// short (ErrTextRebooted or ErrTextInterrupted) while its entry, still
	// RUNNING, waits for the command to be delivered again and run again;
	// empty otherwise.
	Interrupted string
}

// Terminal reports whether the entry's state is final.
func (e *Entry) Terminal() bool { return terminal(e.State) }

func terminal(s gatewayv1.CommandState) bool {
	switch s {
	case gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, gatewayv1.CommandState_COMMAND_STATE_FAILED,
		gatewayv1.CommandState_COMMAND_STATE_EXPIRED, gatewayv1.CommandState_COMMAND_STATE_CANCELED:
		return true
	}
	return false
}

// Journal is the daemon's durable record of the commands it has seen, the
// basis of at-most-once execution (docs/architecture.md, "Commands", invariant I2). Put must be
// durable when it returns: the Agent journals a command before running it.
//
// A Journal must be able to tell that it was lost: an implementation keeps a
// marker beside the machine's identity (an epoch file, say) and, when it finds
// the marker but not the journal it names, starts empty and reports LostAt.
// Commands that may have been in flight before that time and are not
// retry-safe are then reported FAILED instead of run again.
//
// Implementations: MemoryJournal here (tests and the simulator) and
// pkg/agent's FileJournal. The Agent calls a Journal from one goroutine.
type Journal interface {
	// Get returns the entry of commandID, if the journal has one.
	Get(commandID string) (Entry, bool)
	// Put creates or replaces the entry of e.CommandID durably.
	Put(e Entry) error
	// Delete forgets a command (the Agent prunes terminal entries whose
	// deadline is long past, so the journal stays small).
	Delete(commandID string) error
	// Entries returns every entry in the order the commands were first put.
	Entries() []Entry
	// LostAt returns when the journal was last found lost (wiped while the
	// machine kept its identity), or the zero time if it never was.
	LostAt() time.Time
}

// MemoryJournal is a Journal held in memory, for tests and the fleet
// simulator (which wipes it to inject a journal loss). Its zero value is not
// usable; call NewMemoryJournal. It is not safe for concurrent use.
type MemoryJournal struct {
	entries map[string]*slot
	order   []string // command ids in first-put order; may hold deleted or stale ids
	lostAt  time.Time
}

type slot struct {
	e   Entry
	pos int // index of the id in order
}

// NewMemoryJournal returns an empty journal that was never lost.
func NewMemoryJournal() *MemoryJournal {
	return &MemoryJournal{entries: map[string]*slot{}}
}

// Get implements Journal.
func (m *MemoryJournal) Get(commandID string) (Entry, bool) {
	s, ok := m.entries[commandID]
	if !ok {
		return Entry{}, false
	}
	return s.e, true
}

// Put implements Journal; it never fails.
func (m *MemoryJournal) Put(e Entry) error {
	if s, ok := m.entries[e.CommandID]; ok {
		s.e = e
		return nil
	}
	m.entries[e.CommandID] = &slot{e: e, pos: len(m.order)}
	m.order = append(m.order, e.CommandID)
	return nil
}

// Delete implements Journal; it never fails.
func (m *MemoryJournal) Delete(commandID string) error {
	delete(m.entries, commandID)
	if len(m.order) > 2*len(m.entries)+16 {
		kept := m.order[:0]
		for i, id := range m.order {
			if s, ok := m.entries[id]; ok && s.pos == i {
				s.pos = len(kept)
				kept = append(kept, id)
			}
		}
		clear(m.order[len(kept):])
		m.order = kept
	}
	return nil
}

// Entries implements Journal.
func (m *MemoryJournal) Entries() []Entry {
	out := make([]Entry, 0, len(m.entries))
	for i, id := range m.order {
		if s, ok := m.entries[id]; ok && s.pos == i {
			out = append(out, s.e)
		}
	}
	return out
}

// LostAt implements Journal.
func (m *MemoryJournal) LostAt() time.Time { return m.lostAt }

// Len returns how many entries the journal holds.
func (m *MemoryJournal) Len() int { return len(m.entries) }

// Wipe simulates losing the journal at now: every entry is gone and LostAt
// returns now. Restart the Agent afterwards (a loss happens with a crash).
func (m *MemoryJournal) Wipe(now time.Time) {
	clear(m.entries)
	m.order = nil
	m.lostAt = now
}
