package sim

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/daemon"
)

var h0 = time.Date(2030, 1, 1, 23, 50, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return h0.Add(d) }

// checkCase is a hand-made history: clean must pass, each of bad must be
// caught with a violation of the checker's invariant.
type checkCase struct {
	checker func() Checker
	clean   []Record
	bad     map[string][]Record
	end     time.Time
}

func runCase(t *testing.T, c checkCase) {
	t.Helper()
	name, summary := c.checker().Invariant()
	require.NotEmpty(t, summary)
	require.Empty(t, Check(c.checker(), c.clean, c.end), "the clean history of %s", name)
	require.NotEmpty(t, c.bad)
	for what, h := range c.bad {
		vs := Check(c.checker(), h, c.end)
		require.NotEmpty(t, vs, "%s: %s is not caught", name, what)
		for _, v := range vs {
			require.Equal(t, name, v.Invariant, what)
			require.NotEmpty(t, v.Detail, what)
		}
	}
}

func TestI1(t *testing.T) {
	start := func(d time.Duration, node, res string, end time.Duration, devs ...int32) Record {
		return Record{At: at(d), Kind: RecBookingStart, Node: node, Reservation: res, Devices: devs, GPUs: len(devs), End: at(end)}
	}
	endAt := func(d time.Duration, res, cause string) Record {
		return Record{At: at(d), Kind: RecBookingEnd, Reservation: res, Cause: cause}
	}
	holds := func(d time.Duration, node string, hs ...Hold) Record {
		return Record{At: at(d), Kind: RecNodeHolds, Node: node, Holds: hs}
	}
	runCase(t, checkCase{
		checker: func() Checker { return newI1() },
		clean: []Record{
			start(0, "n1", "r1", time.Hour, 0, 1),
			start(time.Second, "n1", "r2", time.Hour, 2, 3),
			start(time.Second, "n2", "r3", time.Hour, 0, 1), // another node
			endAt(time.Minute, "r1", CauseRelease),
			start(time.Minute, "n1", "r4", time.Hour, 0), // device 0 is free since r1 ended
			start(time.Hour, "n1", "r5", 2*time.Hour, 1, 2, 3),
			holds(time.Hour, "n1", Hold{"r4", []int32{0}}, Hold{"r5", []int32{1, 2, 3}}),
		},
		bad: map[string][]Record{
			"two bookings share a device": {
				start(0, "n1", "r1", time.Hour, 0, 1),
				start(time.Minute, "n1", "r2", time.Hour, 1, 2),
			},
			"a booking reuses a device before the other is released": {
				start(0, "n1", "r1", time.Hour, 0),
				start(time.Minute, "n1", "r2", time.Hour, 0),
				endAt(2*time.Minute, "r1", CauseRelease),
			},
			"a booking names a device twice": {start(0, "n1", "r1", time.Hour, 4, 4)},
			"the daemon holds a device twice": {
				holds(0, "n1", Hold{"r1", []int32{0, 1}}, Hold{"r2", []int32{1}}),
			},
		},
		end: at(3 * time.Hour),
	})
}

func TestI2(t *testing.T) {
	created := func(d time.Duration, id, node string, safe bool) Record {
		return Record{At: at(d), Kind: RecCommandCreated, Command: id, Node: node, RetrySafe: safe}
	}
	// ran: the hardware ran id for 10 s, as run runs of the journal.
	ranRun := func(d time.Duration, id, node string, runs int) Record {
		return Record{At: at(d), Kind: RecExecuted, Command: id, Node: node, Runs: runs, Took: 10 * time.Second}
	}
	ran := func(d time.Duration, id, node string) Record { return ranRun(d, id, node, 1) }
	down := func(d time.Duration, node string) Record {
		return Record{At: at(d), Kind: RecDown, Node: node}
	}
	lost := func(d time.Duration, node string) Record {
		return Record{At: at(d), Kind: RecJournalLost, Node: node}
	}
	got := func(d time.Duration, id, node, state, errText string) Record {
		return Record{At: at(d), Kind: RecCommandReceived, Command: id, Node: node, State: state, Error: errText}
	}
	failedLost := func(d time.Duration, id, node string) Record {
		return got(d, id, node, "failed", daemon.ErrTextJournalLost)
	}
	runCase(t, checkCase{
		checker: func() Checker { return newI2() },
		clean: []Record{
			created(0, "c5", "n1", false),
			got(time.Millisecond, "c5", "n1", "running", ""), // before any loss
			created(0, "c1", "n1", true),
			created(0, "c2", "n1", false),
			created(0, "c3", "n2", false),
			ran(time.Second, "c1", "n1"),
			ran(time.Second, "c2", "n1"),
			lost(time.Minute, "n1"),
			ran(2*time.Minute, "c1", "n1"),        // retry-safe: may run again after the loss
			ran(2*time.Minute, "c3", "n2"),        // another node's loss does not matter
			failedLost(2*time.Minute, "c2", "n1"), // redelivered after the loss: failed
			failedLost(2*time.Minute, "c5", "n1"),
			failedLost(3*time.Minute, "c5", "n1"),         // again: answered from the journal
			got(2*time.Minute, "c1", "n1", "running", ""), // retry-safe
			created(3*time.Minute, "c4", "n1", false),
			got(4*time.Minute, "c4", "n1", "running", ""), // issued after the loss
			ran(4*time.Minute, "c4", "n1"),
			// Retry-safe c6 is interrupted (n2 goes down 5 s into its 10 s
			// run) and runs again, as the journal's run 2; twice.
			created(5*time.Minute, "c6", "n2", true),
			ran(5*time.Minute, "c6", "n2"),
			down(5*time.Minute+5*time.Second, "n2"),
			ranRun(6*time.Minute, "c6", "n2", 2),
			down(6*time.Minute+10*time.Second, "n2"), // at the very end of the run: the benefit of the doubt
			ranRun(7*time.Minute, "c6", "n2", 3),
			// After a journal loss the journal counts from 1 again.
			down(7*time.Minute+time.Second, "n2"),
			lost(7*time.Minute+time.Second, "n2"),
			ranRun(8*time.Minute, "c6", "n2", 1),
		},
		bad: map[string][]Record{
			"a command runs twice": {
				created(0, "c1", "n1", true),
				ran(time.Second, "c1", "n1"),
				ran(time.Minute, "c1", "n1"),
			},
			"a command that is not retry-safe runs again after a journal loss": {
				created(0, "c1", "n1", false),
				ran(time.Second, "c1", "n1"),
				lost(time.Minute, "n1"),
				ran(2*time.Minute, "c1", "n1"),
			},
			"an in-flight command that is not retry-safe runs after a journal loss": {
				created(0, "c1", "n1", false),
				lost(time.Minute, "n1"),
				ran(2*time.Minute, "c1", "n1"),
			},
			"an in-flight command that is not retry-safe is not answered after a journal loss": {
				created(0, "c1", "n1", false),
				lost(time.Minute, "n1"),
				got(2*time.Minute, "c1", "n1", "", ""),
			},
			"an in-flight command that is not retry-safe is answered running after a journal loss": {
				created(0, "c1", "n1", false),
				lost(time.Minute, "n1"),
				got(2*time.Minute, "c1", "n1", "running", ""),
			},
			"an in-flight command that is not retry-safe fails for another reason after a journal loss": {
				created(0, "c1", "n1", false),
				lost(time.Minute, "n1"),
				got(2*time.Minute, "c1", "n1", "failed", daemon.ErrTextExpired),
			},
			"a retry-safe command runs again, its node went down after the run ended": {
				created(0, "c1", "n1", true),
				ran(time.Second, "c1", "n1"),
				down(12*time.Second, "n1"),
				ranRun(time.Minute, "c1", "n1", 2),
			},
			"a retry-safe command runs again, another node went down": {
				created(0, "c1", "n1", true),
				ran(time.Second, "c1", "n1"),
				down(5*time.Second, "n2"),
				ranRun(time.Minute, "c1", "n1", 2),
			},
			"a command that is not retry-safe runs again after it was interrupted": {
				created(0, "c1", "n1", false),
				ran(time.Second, "c1", "n1"),
				down(5*time.Second, "n1"),
				ranRun(time.Minute, "c1", "n1", 2),
			},
			"an interrupted command runs again, the journal does not count it": {
				created(0, "c1", "n1", true),
				ran(time.Second, "c1", "n1"),
				down(5*time.Second, "n1"),
				ranRun(time.Minute, "c1", "n1", 1),
			},
			"an interrupted command runs a third time without a second interruption": {
				created(0, "c1", "n1", true),
				ran(time.Second, "c1", "n1"),
				down(5*time.Second, "n1"),
				ranRun(time.Minute, "c1", "n1", 2),
				ranRun(2*time.Minute, "c1", "n1", 3),
			},
			"a command runs without being journaled": {
				created(0, "c1", "n1", true),
				ranRun(time.Second, "c1", "n1", 0),
			},
			"an unknown command runs":          {ran(time.Second, "c9", "n1")},
			"a command runs on another node":   {created(0, "c1", "n1", true), ran(time.Second, "c1", "n2")},
			"the hardware runs outside a send": {ran(time.Second, "", "n1")},
		},
		end: at(time.Hour),
	})
}

func TestI3(t *testing.T) {
	sent := func(d time.Duration, node string, gen int64) Record {
		return Record{At: at(d), Kind: RecSpecDelivered, Node: node, Gen: gen}
	}
	seen := func(d time.Duration, node string, gen int64) Record {
		return Record{At: at(d), Kind: RecSpecObserved, Node: node, Gen: gen}
	}
	unreachable := func(d time.Duration, node string) Record {
		return Record{At: at(d), Kind: RecUnreachable, Node: node}
	}
	heard := func(d time.Duration, node string) Record { return Record{At: at(d), Kind: RecHeard, Node: node} }
	runCase(t, checkCase{
		checker: func() Checker { return newI3() },
		clean: []Record{
			sent(0, "n1", 1),
			seen(time.Second, "n1", 1),
			sent(time.Minute, "n1", 2),
			sent(time.Minute+time.Second, "n1", 3),
			seen(2*time.Minute, "n1", 3), // observes both, at exactly 60 s for gen 2
			sent(3*time.Minute, "n2", 1),
			unreachable(3*time.Minute+40*time.Second, "n2"), // excused
			heard(5*time.Minute, "n2"),
			sent(5*time.Minute, "n2", 2),                // sent while n2 is marked unreachable: not judged
			sent(9*time.Minute+30*time.Second, "n1", 4), // its window outlasts the run
		},
		bad: map[string][]Record{
			"a spec is never observed": {sent(0, "n1", 1), heard(10*time.Second, "n1")},
			"a spec is observed late": {
				sent(0, "n1", 2),
				seen(30*time.Second, "n1", 1), // an older generation does not count
				seen(61*time.Second, "n1", 2),
			},
			"unreachable only after the deadline": {
				sent(0, "n1", 1),
				unreachable(90*time.Second, "n1"),
			},
			"reachable again, then not observed": {
				unreachable(0, "n1"),
				Record{At: at(10 * time.Second), Kind: RecReachable, Node: "n1"},
				sent(20*time.Second, "n1", 1),
			},
			"another node's unreachability does not excuse": {
				sent(0, "n1", 1),
				unreachable(10*time.Second, "n2"),
			},
		},
		end: at(10 * time.Minute),
	})
}

func TestI4(t *testing.T) {
	heard := func(d time.Duration, node string) Record { return Record{At: at(d), Kind: RecHeard, Node: node} }
	unreachable := func(d time.Duration, node string) Record {
		return Record{At: at(d), Kind: RecUnreachable, Node: node}
	}
	runCase(t, checkCase{
		checker: func() Checker { return newI4() },
		clean: []Record{
			heard(0, "n1"),
			heard(15*time.Second, "n2"),
			unreachable(30*time.Second, "n1"),
			heard(time.Minute, "n1"),
			unreachable(time.Minute+20*time.Second, "n1"), // exactly 20 s
		},
		bad: map[string][]Record{
			"marked 19 s after a hearing": {heard(0, "n1"), heard(11*time.Second, "n1"), unreachable(30*time.Second, "n1")},
		},
		end: at(time.Hour),
	})
}

func TestI5(t *testing.T) {
	start := func(d time.Duration, res string, end time.Duration) Record {
		return Record{At: at(d), Kind: RecBookingStart, Node: "n1", Reservation: res, Devices: []int32{0}, GPUs: 1, End: at(end)}
	}
	release := func(d time.Duration, res string) Record {
		return Record{At: at(d), Kind: RecReleaseRequested, Reservation: res}
	}
	endAt := func(d time.Duration, res, cause string) Record {
		return Record{At: at(d), Kind: RecBookingEnd, Reservation: res, Cause: cause}
	}
	runCase(t, checkCase{
		checker: func() Checker { return newI5() },
		clean: []Record{
			start(0, "r1", time.Hour),
			start(0, "r2", 10*time.Minute),
			release(time.Minute, "r1"),
			endAt(time.Minute, "r1", CauseRelease),
			endAt(10*time.Minute, "r2", CauseExpiry),
			release(11*time.Minute, "r2"), // too late: changes nothing
		},
		bad: map[string][]Record{
			"ended by connectivity":        {start(0, "r1", time.Hour), endAt(time.Minute, "r1", "unreachable")},
			"released without a request":   {start(0, "r1", time.Hour), endAt(time.Minute, "r1", CauseRelease)},
			"expired before its end":       {start(0, "r1", time.Hour), endAt(time.Minute, "r1", CauseExpiry)},
			"ended twice":                  {start(0, "r1", time.Hour), release(time.Minute, "r1"), endAt(time.Minute, "r1", CauseRelease), endAt(time.Hour, "r1", CauseExpiry)},
			"ended but was never started":  {release(time.Minute, "r9"), endAt(time.Minute, "r9", CauseRelease)},
			"released before its request":  {start(0, "r1", time.Hour), endAt(time.Minute, "r1", CauseRelease), release(2*time.Minute, "r1")},
			"expired after its end (late)": {start(0, "r1", time.Minute), endAt(2*time.Minute, "r1", CauseExpiry)},
		},
		end: at(2 * time.Hour),
	})
}

func TestI8(t *testing.T) {
	// h0 is 23:50; the next hour starts at 00:00.
	hour := h0.Truncate(time.Hour)
	start := func(d time.Duration, res string, gpus int, end time.Duration) Record {
		return Record{At: at(d), Kind: RecBookingStart, Node: "n1", Reservation: res, GPUs: gpus, End: at(end)}
	}
	endAt := func(d time.Duration, res string) Record {
		return Record{At: at(d), Kind: RecBookingEnd, Reservation: res, Cause: CauseExpiry}
	}
	window := func(d time.Duration, res string, w time.Time, secs int64) Record {
		return Record{At: at(d), Kind: RecUsageWindow, Reservation: res, Window: w, Secs: secs}
	}
	clean := []Record{
		// r1: 2 GPUs from 23:50:00.5 to 00:05:00.9, i.e. 23:50:00–00:05:00
		// whole seconds: 600 s + 300 s.
		start(500*time.Millisecond, "r1", 2, 15*time.Minute+900*time.Millisecond),
		// r2: 1 GPU, live at the end (00:20), booked until 01:00: counts
		// until 00:20.
		start(time.Minute, "r2", 1, 70*time.Minute),
		endAt(15*time.Minute+900*time.Millisecond, "r1"),
		window(16*time.Minute, "r1", hour, 1200),
		window(16*time.Minute, "r1", hour.Add(time.Hour), 600),
		window(30*time.Minute, "r2", hour, 540),
		window(30*time.Minute, "r2", hour.Add(time.Hour), 1200),
	}
	runCase(t, checkCase{
		checker: func() Checker { return newI8() },
		clean:   clean,
		bad: map[string][]Record{
			"a window is written twice": append(clean[:len(clean):len(clean)], window(31*time.Minute, "r2", hour.Add(time.Hour), 0)),
			"windows fall short":        clean[:len(clean)-1],
			"windows count too much":    append(clean[:len(clean):len(clean)], window(31*time.Minute, "r2", hour.Add(2*time.Hour), 1)),
			"a window off the hour":     {start(0, "r1", 1, time.Minute), endAt(time.Minute, "r1"), window(2*time.Minute, "r1", h0, 60)},
			"a window of no booking":    {window(time.Minute, "r9", hour, 0)},
		},
		end: at(30 * time.Minute),
	})
}

func TestProgress(t *testing.T) {
	created := func(d time.Duration, id, node string) Record {
		return Record{At: at(d), Kind: RecCommandCreated, Command: id, Node: node}
	}
	ended := func(d time.Duration, id, state, errText string) Record {
		return Record{At: at(d), Kind: RecCommandEnded, Command: id, Node: "n1", State: state, Error: errText}
	}
	booked := func(d time.Duration, res, node string) Record {
		return Record{At: at(d), Kind: RecBookingStart, Node: node, Reservation: res, Devices: []int32{0}, GPUs: 1, End: at(d + time.Hour)}
	}
	bound := func(d time.Duration, res, node string) Record {
		return Record{At: at(d), Kind: RecBound, Node: node, Reservation: res}
	}
	released := func(d time.Duration, res string) Record {
		return Record{At: at(d), Kind: RecBookingEnd, Reservation: res, Cause: CauseRelease}
	}
	ran := func(d time.Duration, id string) Record {
		return Record{At: at(d), Kind: RecExecuted, Command: id, Node: "n1", Runs: 1}
	}
	end := at(time.Hour)
	t.Run("strict", func(t *testing.T) {
		runCase(t, checkCase{
			checker: func() Checker { return newProgress(true) },
			clean: []Record{
				created(0, "c1", "n1"),
				created(0, "c2", "n1"),
				booked(0, "r1", "n1"),
				booked(0, "r2", "n1"),
				ran(0, "c1"),
				ended(time.Second, "c1", "succeeded", ""),
				ended(2*time.Second, "c2", "succeeded", ""),
				bound(time.Second, "r1", "n1"),
				released(10*time.Second, "r2"), // too short-lived to judge
				booked(time.Minute, "r3", "n2"),
				bound(2*time.Minute, "r3", "n2"),    // exactly 60 s
				created(58*time.Minute, "c3", "n1"), // its deadline is after the end
				booked(59*time.Minute+30*time.Second, "r4", "n1"),
			},
			bad: map[string][]Record{
				"a command expires": {created(0, "c1", "n1"), ended(5*time.Minute, "c1", "expired", "")},
				"a command fails":   {created(0, "c1", "n1"), ended(time.Second, "c1", "failed", "boom")},
				"a reboot interrupts a command": {
					created(0, "c1", "n1"), ended(time.Second, "c1", "failed", daemon.ErrTextRebooted),
				},
				"a reboot interrupts a retry-safe command, which runs again": {
					created(0, "c1", "n1"), ran(0, "c1"), ran(time.Minute, "c1"), ended(2*time.Minute, "c1", "succeeded", ""),
				},
				"a command never ends":        {created(0, "c1", "n1")},
				"a booking is never bound":    {booked(0, "r1", "n1")},
				"a booking is bound too late": {booked(0, "r1", "n1"), bound(61*time.Second, "r1", "n1")},
				"another node binds it":       {booked(0, "r1", "n1"), bound(time.Second, "r1", "n2")},
				"released after its window, never bound": {
					booked(0, "r1", "n1"), released(2*time.Minute, "r1"),
				},
			},
			end: end,
		})
	})
	t.Run("chaos", func(t *testing.T) {
		runCase(t, checkCase{
			checker: func() Checker { return newProgress(false) },
			clean: []Record{
				created(0, "c1", "n1"),
				created(0, "c2", "n1"),
				booked(0, "r1", "n1"),
				booked(0, "r2", "n1"),
				ended(5*time.Minute, "c1", "expired", ""),
				ran(0, "c2"),
				ran(30*time.Second, "c2"), // run again after a crash: allowed under chaos
				ended(time.Minute, "c2", "succeeded", ""),
				bound(time.Second, "r2", "n1"),
			},
			bad: map[string][]Record{
				"no command succeeds": {
					created(0, "c1", "n1"), created(0, "c2", "n1"),
					ended(time.Minute, "c1", "failed", "boom"), ended(5*time.Minute, "c2", "expired", ""),
				},
				"no booking is bound": {booked(0, "r1", "n1"), booked(0, "r2", "n1")},
			},
			end: end,
		})
		// Too short a run is not judged.
		require.Empty(t, Check(newProgress(false), []Record{created(0, "c1", "n1"), booked(0, "r1", "n1")}, at(30*time.Second)))
	})
}

func TestInvariantsListed(t *testing.T) {
	inv := Invariants()
	require.Len(t, inv, 7)
	for i, name := range []string{"I1", "I2", "I3", "I4", "I5", "I8", ProgressName} {
		require.Regexp(t, "^"+name+": ", inv[i])
		require.Regexp(t, `\(.*(the daemon core|the stub.s ).*\)$`, inv[i])
	}
}
