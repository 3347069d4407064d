package daemon_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/ids"
)

// states returns, per command id, the states of the updates in msgs, and
// the order the updates came in as "<id> <state>".
func states(msgs []*gatewayv1.SessionRequest) (map[string][]gatewayv1.CommandState, []string) {
	got := map[string][]gatewayv1.CommandState{}
	var order []string
	for _, u := range updates(msgs) {
		got[u.GetCommandId()] = append(got[u.GetCommandId()], u.GetState())
		order = append(order, u.GetCommandId()+" "+u.GetState().String())
	}
	return got, order
}

// bootAgain waits out the reboot downtime and establishes the session the
// machine dials when it is back, keeping what was sent before.
func (h *harness) bootAgain() {
	h.t.Helper()
	require.Equal(h.t, daemon.StateRebooting, h.a.Status().State)
	kept := h.take()
	h.advance(h.cfg.RebootDowntime)
	h.establish()
	h.sent = append(kept, h.sent...)
}

// TestRebootWaitsForCommandsQueuedBeforeIt: delivered [logs.collect,
// node.reboot], logs.collect runs to its end and succeeds, then the machine
// reboots; a command queued after the reboot and delivered while it waits
// is not run before the reboot, and runs when delivered again after it.
func TestRebootWaitsForCommandsQueuedBeforeIt(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{RebootDowntime: 3 * time.Second}, 1)
	h.establish()
	deadline := h.now.Add(time.Hour)
	logs := ids.New(ids.Command, h.now)
	reboot := ids.New(ids.Command, h.now)
	after := ids.New(ids.Command, h.now.Add(time.Millisecond))
	h.receive(cmd(logs, "logs.collect", deadline, true))       // 300 ms
	h.receive(cmd(reboot, "node.reboot", deadline, false))     // 100 ms
	h.receive(cmd(after, "inventory.refresh", deadline, true)) // queued after the reboot
	require.Equal(t, 2, h.a.Status().Running, "logs.collect and the waiting reboot")

	h.advance(200 * time.Millisecond) // the reboot's own 100 ms are over; logs.collect still runs
	require.Equal(t, daemon.StateEstablished, h.a.Status().State, "the reboot waits for logs.collect")
	require.Empty(t, h.closed)
	h.advance(200 * time.Millisecond)
	_, order := states(h.take())
	require.Equal(t, []string{
		logs + " COMMAND_STATE_RUNNING",
		reboot + " COMMAND_STATE_RUNNING",
		logs + " COMMAND_STATE_SUCCEEDED",
		reboot + " COMMAND_STATE_SUCCEEDED",
	}, order)
	require.Equal(t, daemon.StateRebooting, h.a.Status().State)
	require.Len(t, h.closed, 1)
	require.Equal(t, "rebooting", h.closed[0].Reason)
	require.Zero(t, h.hw.runs["inventory.refresh"], "queued after the reboot: not run before it")
	_, ok := h.j.Get(after)
	require.False(t, ok, "not journaled: it was not started")

	h.bootAgain()
	require.Len(t, h.reboots, 1)
	require.Empty(t, updates(h.take()), "nothing was interrupted")
	// The new session redelivers what is still open on the control plane,
	// in id order.
	h.receive(cmd(logs, "logs.collect", deadline, true))
	h.receive(cmd(reboot, "node.reboot", deadline, false))
	h.receive(cmd(after, "inventory.refresh", deadline, true))
	h.advance(time.Second)
	got, _ := states(h.take())
	require.Equal(t, []gatewayv1.CommandState{succeeded}, got[logs], "answered from the journal")
	require.Equal(t, []gatewayv1.CommandState{succeeded}, got[reboot], "answered from the journal")
	require.Equal(t, []gatewayv1.CommandState{running, succeeded}, got[after])
	require.Equal(t, 1, h.hw.runs["logs.collect"])
	require.Equal(t, 1, h.hw.runs["node.reboot"])
	require.Equal(t, 1, h.hw.runs["inventory.refresh"])
	require.Len(t, h.reboots, 1)
	require.Equal(t, daemon.StateEstablished, h.a.Status().State)
}

// TestRebootWaitsAtMostUntilDeadlines: the reboot waits for an earlier
// command only until that command's deadline (then it is past it and is
// failed as interrupted), and never past the reboot's own deadline (then a
// retry-safe command still running is run again after the boot).
func TestRebootWaitsAtMostUntilDeadlines(t *testing.T) {
	t.Parallel()
	t.Run("the earlier command's deadline", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, daemon.Config{RebootDowntime: time.Second}, 1)
		h.establish()
		diag := ids.New(ids.Command, h.now)
		reboot := ids.New(ids.Command, h.now)
		h.receive(cmd(diag, "diag.nvml", h.now.Add(500*time.Millisecond), true)) // 800 ms
		h.receive(cmd(reboot, "node.reboot", h.now.Add(time.Hour), false))
		h.advance(499 * time.Millisecond)
		require.Equal(t, daemon.StateEstablished, h.a.Status().State)
		h.advance(time.Millisecond)
		require.Equal(t, daemon.StateRebooting, h.a.Status().State, "rebooted at diag.nvml's deadline")
		h.bootAgain()
		got, _ := states(h.take())
		require.Equal(t, []gatewayv1.CommandState{running, succeeded}, got[reboot])
		require.Equal(t, []gatewayv1.CommandState{running, failed}, got[diag], "past its deadline: not run again")
		e, ok := h.j.Get(diag)
		require.True(t, ok)
		require.Equal(t, daemon.ErrTextRebooted, e.Error)
		require.Equal(t, 1, h.hw.runs["diag.nvml"])
	})
	t.Run("the reboot's own deadline", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, daemon.Config{RebootDowntime: time.Second}, 1)
		h.establish()
		diag := ids.New(ids.Command, h.now)
		reboot := ids.New(ids.Command, h.now)
		deadline := h.now.Add(time.Hour)
		h.receive(cmd(diag, "diag.nvml", deadline, true)) // 800 ms
		h.receive(cmd(reboot, "node.reboot", h.now.Add(400*time.Millisecond), false))
		h.advance(400 * time.Millisecond)
		require.Equal(t, daemon.StateRebooting, h.a.Status().State, "rebooted at its own deadline")
		h.bootAgain()
		got, _ := states(h.take())
		require.Equal(t, []gatewayv1.CommandState{running, succeeded}, got[reboot])
		require.Equal(t, []gatewayv1.CommandState{running}, got[diag], "interrupted, retry-safe: nothing to report yet")
		h.receive(cmd(diag, "diag.nvml", deadline, true))
		h.advance(time.Second)
		got, _ = states(h.take())
		require.Equal(t, []gatewayv1.CommandState{running, succeeded}, got[diag], "run again after the boot")
		require.Equal(t, 2, h.hw.runs["diag.nvml"])
	})
}

// TestRetrySafeCommandInterruptedRunsAgain: a retry-safe command that was
// running when the machine went down (a crash, a reboot from outside) is
// run again when the gateway redelivers it after the boot, and succeeds;
// the journal records the second run.
func TestRetrySafeCommandInterruptedRunsAgain(t *testing.T) {
	t.Parallel()
	for _, external := range []bool{false, true} {
		name := "crash"
		if external {
			name = "reboot from outside"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, daemon.Config{}, 1)
			h.establish()
			deadline := h.now.Add(time.Hour)
			id := ids.New(ids.Command, h.now)
			h.receive(cmd(id, "diag.nvml", deadline, true))
			h.take()
			e, ok := h.j.Get(id)
			require.True(t, ok)
			require.Equal(t, 1, e.Runs)

			h.advance(100 * time.Millisecond)
			if external {
				h.hw.Reboot()
			}
			h.restart() // the machine went down while diag.nvml ran
			hello := h.establish()
			require.Len(t, hello.GetJournal(), 1)
			require.Equal(t, running, hello.GetJournal()[0].GetState(), "started, to be run again")
			require.Empty(t, updates(h.take()), "no failure to report")
			e, _ = h.j.Get(id)
			require.Equal(t, running, e.State)
			require.Equal(t, daemon.ErrTextInterrupted, e.Interrupted)

			// The gateway redelivers it: it runs again, journaled first.
			h.receive(cmd(id, "diag.nvml", deadline, true))
			u := updates(h.take())
			require.Len(t, u, 1)
			require.Equal(t, running, u[0].GetState())
			e, _ = h.j.Get(id)
			require.Equal(t, 2, e.Runs, "the journal records the second run")
			require.Empty(t, e.Interrupted)
			require.Equal(t, 2, h.hw.runs["diag.nvml"])
			// A duplicate delivery while it runs is answered RUNNING.
			h.receive(cmd(id, "diag.nvml", deadline, true))
			u = updates(h.take())
			require.Len(t, u, 1)
			require.Equal(t, running, u[0].GetState())

			h.advance(time.Second)
			u = updates(h.take())
			require.Len(t, u, 1)
			require.Equal(t, succeeded, u[0].GetState())
			require.Len(t, u[0].GetResult().GetInventory().GetGpus(), 8)
			// Finished: answered from the journal, not run a third time.
			h.receive(cmd(id, "diag.nvml", deadline, true))
			require.Equal(t, succeeded, updates(h.take())[0].GetState())
			require.Equal(t, 2, h.hw.runs["diag.nvml"])
		})
	}
}

// TestInterruptedRetrySafeCommandPastDeadlineFails: an interrupted
// retry-safe command whose deadline passed before it was delivered again is
// not run again: it fails as interrupted.
func TestInterruptedRetrySafeCommandPastDeadlineFails(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	id := ids.New(ids.Command, h.now)
	deadline := h.now.Add(10 * time.Second)
	h.receive(cmd(id, "diag.nvml", deadline, true))
	h.take()
	h.restart()
	h.establish()
	require.Empty(t, updates(h.take()))
	h.advance(11 * time.Second)
	h.take()
	h.receive(cmd(id, "diag.nvml", deadline, true))
	u := updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, failed, u[0].GetState())
	require.Equal(t, daemon.ErrTextInterrupted, u[0].GetError())
	require.Equal(t, 1, h.hw.runs["diag.nvml"])

	// One never delivered again is failed when its deadline has passed
	// (at the next connect), so the journal can forget it.
	other := ids.New(ids.Command, h.now)
	h.receive(cmd(other, "diag.nvml", h.now.Add(10*time.Second), true))
	h.take()
	h.restart()
	h.establish()
	require.Empty(t, updates(h.take()))
	h.advance(11 * time.Second)
	h.disconnect()
	h.redial()
	u = updates(h.take())
	require.Len(t, u, 1)
	require.Equal(t, other, u[0].GetCommandId())
	require.Equal(t, failed, u[0].GetState())
	require.Equal(t, daemon.ErrTextInterrupted, u[0].GetError())
}

// TestNotRetrySafeCommandInterruptedFails: a command that is not
// retry-safe, running when the machine went down, is reported FAILED as
// interrupted and never run again, also when redelivered.
func TestNotRetrySafeCommandInterruptedFails(t *testing.T) {
	t.Parallel()
	t.Run("crash", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, daemon.Config{}, 1)
		h.establish()
		deadline := h.now.Add(time.Hour)
		id := ids.New(ids.Command, h.now)
		h.receive(cmd(id, "diag.nvml", deadline, false))
		h.take()
		h.restart()
		h.establish()
		u := updates(h.take())
		require.Len(t, u, 1)
		require.Equal(t, failed, u[0].GetState())
		require.Equal(t, daemon.ErrTextInterrupted, u[0].GetError())
		h.receive(cmd(id, "diag.nvml", deadline, false))
		h.advance(time.Minute)
		u = updates(h.take())
		require.Len(t, u, 1)
		require.Equal(t, failed, u[0].GetState(), "answered from the journal")
		require.Equal(t, 1, h.hw.runs["diag.nvml"])
	})
	t.Run("node.reboot at its deadline", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, daemon.Config{RebootDowntime: time.Second}, 1)
		h.establish()
		deadline := h.now.Add(time.Hour)
		diag := ids.New(ids.Command, h.now)
		reboot := ids.New(ids.Command, h.now)
		h.receive(cmd(diag, "diag.nvml", deadline, false))
		h.receive(cmd(reboot, "node.reboot", h.now.Add(400*time.Millisecond), false))
		h.advance(399 * time.Millisecond)
		require.Equal(t, daemon.StateEstablished, h.a.Status().State, "the reboot waits for diag.nvml until its own deadline")
		h.advance(time.Millisecond)
		h.bootAgain()
		got, _ := states(h.take())
		require.Equal(t, []gatewayv1.CommandState{running, failed}, got[diag])
		e, _ := h.j.Get(diag)
		require.Equal(t, daemon.ErrTextRebooted, e.Error)
		h.receive(cmd(diag, "diag.nvml", deadline, false))
		h.advance(time.Minute)
		got, _ = states(h.take())
		require.Equal(t, []gatewayv1.CommandState{failed}, got[diag], "answered from the journal")
		require.Equal(t, 1, h.hw.runs["diag.nvml"])
	})
}
