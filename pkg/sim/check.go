package sim

import (
	"fmt"
	"slices"
	"time"

	"github.com/better-compute/better-compute/pkg/daemon"
)

// Bounds of the invariants.
const (
	// SpecObserveWithin is I3's bound: a delivered spec is observed this
	// soon while the node stays reachable.
	SpecObserveWithin = 60 * time.Second
	// HeardGrace is I4's bound: no node is marked unreachable this soon
	// after a gateway heard from it.
	HeardGrace = 20 * time.Second
)

func violation(inv string, r *Record, format string, args ...any) Violation {
	return Violation{Invariant: inv, At: r.At, Node: r.Node, Detail: fmt.Sprintf(format, args...)}
}

// i1 checks I1: bookings on one node never share a device while both are
// live, and no daemon holds one device for two allocations.
type i1 struct {
	byNode map[string][]*i1Booking // live or recently ended bookings of a node
	byRes  map[string]*i1Booking
}

type i1Booking struct {
	res     string
	devices []int32
	end     time.Time // scheduled end, or when it was ended
}

func newI1() *i1 { return &i1{byNode: map[string][]*i1Booking{}, byRes: map[string]*i1Booking{}} }

func (c *i1) Invariant() (string, string) {
	return "I1", "no overlapping bookings or node-held devices: two live allocations on one node never share a device " +
		"(node-held devices: the daemon core; bookings: the stub's own placement)"
}

func (c *i1) Observe(r *Record) []Violation {
	var out []Violation
	switch r.Kind {
	case RecBookingStart:
		kept := c.byNode[r.Node][:0]
		for _, b := range c.byNode[r.Node] {
			if !b.end.After(r.At) {
				delete(c.byRes, b.res)
				continue
			}
			kept = append(kept, b)
			for _, d := range r.Devices {
				if slices.Contains(b.devices, d) {
					out = append(out, violation("I1", r, "reservation %s booked device %d of %s while %s holds it until %s",
						r.Reservation, d, r.Node, b.res, b.end.UTC().Format(time.RFC3339)))
				}
			}
		}
		if d, ok := duplicate(r.Devices); ok {
			out = append(out, violation("I1", r, "reservation %s booked device %d twice", r.Reservation, d))
		}
		b := &i1Booking{res: r.Reservation, devices: r.Devices, end: r.End}
		c.byNode[r.Node] = append(kept, b)
		c.byRes[r.Reservation] = b
	case RecBookingEnd:
		if b := c.byRes[r.Reservation]; b != nil && r.At.Before(b.end) {
			b.end = r.At
		}
	case RecNodeHolds:
		var seen []int32
		for _, h := range r.Holds {
			for _, d := range h.Devices {
				if slices.Contains(seen, d) {
					out = append(out, violation("I1", r, "the daemon holds device %d for two allocations (one is %s)", d, h.Reservation))
				}
				seen = append(seen, d)
			}
		}
	}
	return out
}

func (c *i1) Finish(time.Time) []Violation { return nil }

func duplicate(ds []int32) (int32, bool) {
	for i, d := range ds {
		if slices.Contains(ds[i+1:], d) {
			return d, true
		}
	}
	return 0, false
}

// i2 checks I2: each command runs at most once, and only once the
// daemon's journal holds it as running (run 1, 2, …); a retry-safe one may
// run again only after its node lost its journal, or after its node went
// down (RecDown) while the command ran, as a run the journal counts (one
// more than the last); one that is not retry-safe never runs twice, and
// never runs after a journal loss that happened after it was issued: when
// its node's daemon receives it after the loss, it answers FAILED with
// daemon.ErrTextJournalLost at once (not merely "not run").
type i2 struct {
	cmds     map[string]*i2Command
	lastLoss map[string]time.Time
	running  map[string][]*i2Command // by node: commands whose last run may not have ended
}

type i2Command struct {
	id          string
	node        string
	retrySafe   bool
	issued      time.Time
	runs        int
	lastRun     time.Time
	lastEnd     time.Time // when the last run ends on the hardware
	journaled   int       // the journal's run count at the last run
	interrupted bool      // the node went down before the last run ended
}

func newI2() *i2 {
	return &i2{cmds: map[string]*i2Command{}, lastLoss: map[string]time.Time{}, running: map[string][]*i2Command{}}
}

func (c *i2) Invariant() (string, string) {
	return "I2", "at most one execution per command, journaled before it runs; a retry-safe one runs again only after a " +
		"journal loss or when its node went down while it ran; after a journal loss, in-flight commands that are not " +
		"retry-safe are answered FAILED (journal lost) instead of running again (the daemon core)"
}

func (c *i2) Observe(r *Record) []Violation {
	switch r.Kind {
	case RecCommandCreated:
		c.cmds[r.Command] = &i2Command{id: r.Command, node: r.Node, retrySafe: r.RetrySafe, issued: r.At}
	case RecJournalLost:
		c.lastLoss[r.Node] = r.At
	case RecDown:
		// A run that had not ended when its node went down was cut short
		// (one ending at that very instant may have been: the benefit of
		// the doubt).
		for _, cmd := range c.running[r.Node] {
			if !cmd.lastEnd.Before(r.At) {
				cmd.interrupted = true
			}
		}
		delete(c.running, r.Node)
	case RecExecuted:
		if r.Command == "" {
			return []Violation{violation("I2", r, "the hardware ran a command outside any delivery")}
		}
		cmd := c.cmds[r.Command]
		if cmd == nil {
			return []Violation{violation("I2", r, "ran %s, which was never issued", r.Command)}
		}
		var out []Violation
		if cmd.node != r.Node {
			out = append(out, violation("I2", r, "ran %s, a command for %s", r.Command, cmd.node))
		}
		if r.Runs < 1 {
			out = append(out, violation("I2", r, "ran %s, which its node's journal does not hold as running", r.Command))
		}
		loss, lost := c.lastLoss[r.Node]
		if cmd.runs > 0 {
			// A second run is allowed only for a retry-safe command whose
			// node lost its journal since the last run, or went down while
			// it ran; the journal then counts the run.
			lostSince := lost && loss.After(cmd.lastRun)
			switch {
			case !cmd.retrySafe || (!lostSince && !cmd.interrupted):
				out = append(out, violation("I2", r, "ran %s again (run %d, last at %s)", r.Command, cmd.runs+1, cmd.lastRun.UTC().Format(time.RFC3339Nano)))
			case !lostSince && r.Runs != cmd.journaled+1:
				out = append(out, violation("I2", r, "ran %s again after it was interrupted, as run %d of its journal, not %d",
					r.Command, r.Runs, cmd.journaled+1))
			}
		}
		if !cmd.retrySafe && lost && !cmd.issued.After(loss) {
			out = append(out, violation("I2", r, "ran %s, not retry-safe and issued before the journal loss at %s", r.Command, loss.UTC().Format(time.RFC3339Nano)))
		}
		cmd.runs++
		cmd.lastRun = r.At
		cmd.lastEnd = r.At.Add(r.Took)
		cmd.journaled = r.Runs
		cmd.interrupted = false
		// Keep the node's list to the runs that may not have ended.
		live := c.running[r.Node][:0]
		for _, x := range c.running[r.Node] {
			if x != cmd && !x.lastEnd.Before(r.At) {
				live = append(live, x)
			}
		}
		c.running[r.Node] = append(live, cmd)
		return out
	case RecCommandReceived:
		cmd := c.cmds[r.Command]
		loss, lost := c.lastLoss[r.Node]
		if cmd == nil || cmd.retrySafe || !lost || cmd.issued.After(loss) || !r.At.After(loss) {
			return nil
		}
		if r.State != cmdStateNames[cmdFailed] || r.Error != daemon.ErrTextJournalLost {
			answer := "nothing"
			if r.State != "" {
				answer = fmt.Sprintf("%s %q", r.State, r.Error)
			}
			return []Violation{violation("I2", r, "received %s after the journal loss at %s (not retry-safe, issued before it) and answered %s, not failed: journal lost",
				r.Command, loss.UTC().Format(time.RFC3339Nano), answer)}
		}
	}
	return nil
}

func (c *i2) Finish(time.Time) []Violation { return nil }

// i3 checks I3: a DesiredState a gateway sent is reported observed (a
// generation at least as new) within SpecObserveWithin, unless the node is
// marked unreachable in that time or was when it was sent. Deliveries whose window outlasts the run
// are not judged.
type i3 struct {
	pending map[string][]*i3Delivery // by node, not yet observed
	queue   []*i3Delivery            // every delivery not yet judged, in delivery (= deadline) order
	down    map[string]bool          // nodes marked unreachable and not heard from since
}

type i3Delivery struct {
	node     string
	gen      int64
	at       time.Time
	deadline time.Time
	done     bool
}

func newI3() *i3 { return &i3{pending: map[string][]*i3Delivery{}, down: map[string]bool{}} }

func (c *i3) Invariant() (string, string) {
	return "I3", "a delivered spec is reported observed within 60 s while the node stays reachable (the daemon core)"
}

// expire judges the deliveries whose deadline is before t.
func (c *i3) expire(t time.Time) []Violation {
	var out []Violation
	n := 0
	for n < len(c.queue) && c.queue[n].deadline.Before(t) {
		d := c.queue[n]
		if !d.done {
			d.done = true
			r := &Record{At: d.deadline, Node: d.node}
			out = append(out, violation("I3", r, "generation %d, sent at %s, was not observed within %s while the node stayed reachable",
				d.gen, d.at.UTC().Format(time.RFC3339Nano), SpecObserveWithin))
			c.drop(d.node)
		}
		n++
	}
	if n > 0 {
		c.queue = slices.Delete(c.queue, 0, n)
	}
	return out
}

// drop forgets the node's judged or observed deliveries.
func (c *i3) drop(node string) {
	kept := slices.DeleteFunc(c.pending[node], func(d *i3Delivery) bool { return d.done })
	if len(kept) == 0 {
		delete(c.pending, node)
		return
	}
	c.pending[node] = kept
}

func (c *i3) Observe(r *Record) []Violation {
	var out []Violation
	if len(c.queue) > 0 && c.queue[0].deadline.Before(r.At) {
		out = c.expire(r.At)
	}
	switch r.Kind {
	case RecSpecDelivered:
		if c.down[r.Node] {
			// Sent while the node is marked unreachable (on a session its
			// gateway has not closed yet): not "while reachable".
			return out
		}
		d := &i3Delivery{node: r.Node, gen: r.Gen, at: r.At, deadline: r.At.Add(SpecObserveWithin)}
		c.pending[r.Node] = append(c.pending[r.Node], d)
		c.queue = append(c.queue, d)
	case RecSpecObserved:
		for _, d := range c.pending[r.Node] {
			if d.gen <= r.Gen {
				d.done = true
			}
		}
		c.drop(r.Node)
	case RecUnreachable:
		c.down[r.Node] = true
		for _, d := range c.pending[r.Node] {
			d.done = true
		}
		delete(c.pending, r.Node)
	case RecReachable:
		delete(c.down, r.Node)
	}
	return out
}

func (c *i3) Finish(end time.Time) []Violation {
	// A deadline exactly at the end was still met by anything observed
	// until then; later ones are not judged.
	var out []Violation
	for _, d := range c.queue {
		if d.deadline.Before(end) && !d.done {
			d.done = true
			r := &Record{At: d.deadline, Node: d.node}
			out = append(out, violation("I3", r, "generation %d, sent at %s, was not observed within %s while the node stayed reachable",
				d.gen, d.at.UTC().Format(time.RFC3339Nano), SpecObserveWithin))
		}
	}
	c.queue = nil
	return out
}

// i4 checks I4: a node is never marked unreachable within HeardGrace of a
// gateway hearing from it.
type i4 struct{ lastHeard map[string]time.Time }

func newI4() *i4 { return &i4{lastHeard: map[string]time.Time{}} }

func (c *i4) Invariant() (string, string) {
	return "I4", "no node is marked unreachable within 20 s of a gateway hearing from it (the stub's model of the gateways' " +
		"batched last_seen, presence and the sweeper, against the true hearings)"
}

func (c *i4) Observe(r *Record) []Violation {
	switch r.Kind {
	case RecHeard:
		c.lastHeard[r.Node] = r.At
	case RecUnreachable:
		if h, ok := c.lastHeard[r.Node]; ok && r.At.Sub(h) < HeardGrace {
			return []Violation{violation("I4", r, "marked unreachable %s after a gateway heard from it", r.At.Sub(h))}
		}
	}
	return nil
}

func (c *i4) Finish(time.Time) []Violation { return nil }

// i5 checks I5: a booking ends only when released (after a release was
// asked for) or at its scheduled end; never because of connectivity.
type i5 struct {
	bookings map[string]*i5Booking
	releases map[string]time.Time // first release request of a reservation
}

type i5Booking struct {
	end   time.Time
	ended bool
}

func newI5() *i5 { return &i5{bookings: map[string]*i5Booking{}, releases: map[string]time.Time{}} }

func (c *i5) Invariant() (string, string) {
	return "I5", "no release caused by connectivity: a booking ends only by release or at its end time (the stub's own bookkeeping)"
}

func (c *i5) Observe(r *Record) []Violation {
	switch r.Kind {
	case RecBookingStart:
		c.bookings[r.Reservation] = &i5Booking{end: r.End}
	case RecReleaseRequested:
		if _, ok := c.releases[r.Reservation]; !ok {
			c.releases[r.Reservation] = r.At
		}
	case RecBookingEnd:
		b := c.bookings[r.Reservation]
		switch {
		case b == nil:
			return []Violation{violation("I5", r, "the booking of %s ended but never started", r.Reservation)}
		case b.ended:
			return []Violation{violation("I5", r, "the booking of %s ended twice", r.Reservation)}
		}
		b.ended = true
		switch r.Cause {
		case CauseRelease:
			if at, ok := c.releases[r.Reservation]; !ok || at.After(r.At) {
				return []Violation{violation("I5", r, "the booking of %s was released though no release was asked for", r.Reservation)}
			}
		case CauseExpiry:
			if !r.At.Equal(b.end) {
				return []Violation{violation("I5", r, "the booking of %s expired at %s, but it ends at %s", r.Reservation,
					r.At.UTC().Format(time.RFC3339Nano), b.end.UTC().Format(time.RFC3339Nano))}
			}
		default:
			return []Violation{violation("I5", r, "the booking of %s ended because of %q", r.Reservation, r.Cause)}
		}
	}
	return nil
}

func (c *i5) Finish(time.Time) []Violation { return nil }

// i8 checks I8: the usage windows of a reservation are whole UTC hours,
// written once each, and add up to its GPUs × its booked seconds (both
// bounds truncated to the second; a booking still live at the end counts
// until the end).
type i8 struct {
	bookings map[string]*i8Booking
	order    []string // reservations in booking order, for a stable report
	windows  map[i8Key]bool
}

type i8Key struct {
	res    string
	window int64 // Unix seconds
}

type i8Booking struct {
	node       string
	gpus       int64
	start, end time.Time
	ended      bool
	sum        int64
}

func newI8() *i8 { return &i8{bookings: map[string]*i8Booking{}, windows: map[i8Key]bool{}} }

func (c *i8) Invariant() (string, string) {
	return "I8", "usage windows (per reservation and UTC hour, integer GPU-seconds) add up to booked time × GPUs, with no " +
		"duplicate keys (the stub's own bookkeeping)"
}

func (c *i8) Observe(r *Record) []Violation {
	switch r.Kind {
	case RecBookingStart:
		c.bookings[r.Reservation] = &i8Booking{node: r.Node, gpus: int64(r.GPUs), start: r.At, end: r.End}
		c.order = append(c.order, r.Reservation)
	case RecBookingEnd:
		if b := c.bookings[r.Reservation]; b != nil {
			b.end, b.ended = r.At, true
		}
	case RecUsageWindow:
		k := i8Key{res: r.Reservation, window: r.Window.Unix()}
		var out []Violation
		if c.windows[k] {
			out = append(out, violation("I8", r, "usage window %s of %s written twice", r.Window.UTC().Format(time.RFC3339), r.Reservation))
		}
		c.windows[k] = true
		if !r.Window.Equal(r.Window.Truncate(time.Hour)) {
			out = append(out, violation("I8", r, "usage window %s of %s is not a whole UTC hour", r.Window.UTC().Format(time.RFC3339), r.Reservation))
		}
		b := c.bookings[r.Reservation]
		if b == nil {
			return append(out, violation("I8", r, "usage window for %s, which was never booked", r.Reservation))
		}
		b.sum += r.Secs
		return out
	}
	return nil
}

func (c *i8) Finish(end time.Time) []Violation {
	var out []Violation
	for _, id := range c.order {
		b := c.bookings[id]
		e := b.end
		if !b.ended && e.After(end) {
			e = end
		}
		want := b.gpus * int64(max(0, e.Truncate(time.Second).Sub(b.start.Truncate(time.Second))/time.Second))
		if b.sum != want {
			r := &Record{At: end, Node: b.node}
			out = append(out, violation("I8", r, "usage windows of %s add up to %d GPU-seconds, its booking to %d", id, b.sum, want))
		}
	}
	return out
}

// progress checks that the daemons do their work, so that a daemon that
// runs nothing cannot pass. Strict (chaos none): every command ends
// SUCCEEDED and none is still open after its deadline — a node.reboot the
// workload sends waits for the commands queued before it (all of one
// timeout, so their deadlines come before its own), and those queued after
// it run after the boot, so no reboot interrupts a command, and none runs
// twice (a retry-safe one would, after an interruption); every booking is reported bound (AllocationBound) by its own
// node within SpecObserveWithin unless it ended sooner. Under chaos: when
// some command's deadline passed before the end of the run, some command
// succeeded; when some booking was live SpecObserveWithin before the end,
// some booking was bound.
type progress struct {
	strict    bool
	cmds      map[string]*progCommand // not ended, by id
	cmdOrder  []*progCommand          // every command, by issue time
	bookings  map[string]*progBooking
	bookOrder []*progBooking // every booking, by start
	succeeded int
	bound     int
}

type progCommand struct {
	id, node string
	issued   time.Time
	ended    bool
	runs     int
}

type progBooking struct {
	res, node  string
	start, end time.Time // end: when it ended (zero while live)
	bound      bool
}

// ProgressName is the name of the progress check in violations.
const ProgressName = "progress"

func newProgress(strict bool) *progress {
	return &progress{strict: strict, cmds: map[string]*progCommand{}, bookings: map[string]*progBooking{}}
}

func (c *progress) Invariant() (string, string) {
	return ProgressName, "the daemons do the work: with chaos none every command runs once and succeeds (a node.reboot interrupts none) " +
		"and every booking is bound by its node within 60 s; under chaos some command succeeds and some " +
		"booking is bound (the daemon core)"
}

func (c *progress) Observe(r *Record) []Violation {
	var out []Violation
	if c.strict {
		out = c.judgeBookings(r.At, false)
	}
	switch r.Kind {
	case RecCommandCreated:
		cmd := &progCommand{id: r.Command, node: r.Node, issued: r.At}
		c.cmds[r.Command] = cmd
		c.cmdOrder = append(c.cmdOrder, cmd)
	case RecExecuted:
		if cmd := c.cmds[r.Command]; cmd != nil && c.strict {
			cmd.runs++
			if cmd.runs == 2 {
				out = append(out, violation(ProgressName, r, "%s ran twice with chaos none: a node.reboot interrupted it", r.Command))
			}
		}
	case RecCommandEnded:
		cmd := c.cmds[r.Command]
		if cmd == nil {
			return out
		}
		delete(c.cmds, r.Command)
		cmd.ended = true
		switch {
		case r.State == cmdStateNames[cmdSucceeded]:
			c.succeeded++
		case !c.strict:
		default:
			out = append(out, violation(ProgressName, r, "%s ended %s %q with chaos none", r.Command, r.State, r.Error))
		}
	case RecBookingStart:
		b := &progBooking{res: r.Reservation, node: r.Node, start: r.At}
		c.bookings[r.Reservation] = b
		c.bookOrder = append(c.bookOrder, b)
	case RecBookingEnd:
		if b := c.bookings[r.Reservation]; b != nil && b.end.IsZero() {
			b.end = r.At
		}
	case RecBound:
		b := c.bookings[r.Reservation]
		switch {
		case b == nil:
		case b.node != r.Node:
			out = append(out, violation(ProgressName, r, "bound %s, a booking on %s", r.Reservation, b.node))
		case !b.bound:
			b.bound = true
			c.bound++
		}
	}
	return out
}

// judgeBookings judges, in strict mode, the bookings whose binding window
// ended before t (at t too when final).
func (c *progress) judgeBookings(t time.Time, final bool) []Violation {
	var out []Violation
	n := 0
	for _, b := range c.bookOrder {
		deadline := b.start.Add(SpecObserveWithin)
		if deadline.After(t) || (!final && deadline.Equal(t)) {
			break
		}
		n++
		if b.bound || (!b.end.IsZero() && b.end.Before(deadline)) {
			continue
		}
		r := &Record{At: deadline, Node: b.node}
		out = append(out, violation(ProgressName, r, "booking %s was not reported bound within %s with chaos none", b.res, SpecObserveWithin))
	}
	if n > 0 {
		for _, b := range c.bookOrder[:n] {
			delete(c.bookings, b.res)
		}
		c.bookOrder = slices.Delete(c.bookOrder, 0, n)
	}
	return out
}

func (c *progress) Finish(end time.Time) []Violation {
	at := &Record{At: end}
	var out []Violation
	due := 0
	for _, cmd := range c.cmdOrder {
		if cmd.issued.Add(CommandTimeout).After(end) {
			break
		}
		due++
		if c.strict && !cmd.ended {
			r := &Record{At: end, Node: cmd.node}
			out = append(out, violation(ProgressName, r, "%s never ended", cmd.id))
		}
	}
	if c.strict {
		return append(out, c.judgeBookings(end, true)...)
	}
	if due > 0 && c.succeeded == 0 {
		out = append(out, violation(ProgressName, at, "no command succeeded of %d issued", len(c.cmdOrder)))
	}
	live := 0
	for _, b := range c.bookOrder {
		if !b.start.Add(SpecObserveWithin).After(end) && (b.end.IsZero() || !b.end.Before(b.start.Add(SpecObserveWithin))) {
			live++
		}
	}
	if live > 0 && c.bound == 0 {
		out = append(out, violation(ProgressName, at, "no booking was reported bound of %d that lived %s", live, SpecObserveWithin))
	}
	return out
}
