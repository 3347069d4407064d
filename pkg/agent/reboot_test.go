package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/ids"
)

// retrySafe marks a Command message retry-safe.
func retrySafe(m *gatewayv1.SessionResponse) *gatewayv1.SessionResponse {
	m.GetCommand().RetrySafe = true
	return m
}

// updateOrder returns the node's command updates as "<id> <state>", in the
// order the gateway received them.
func updateOrder(g *fakeGateway, node string) []string {
	var out []string
	for _, m := range g.received(node) {
		if u := m.GetCommandUpdate(); u != nil {
			out = append(out, u.GetCommandId()+" "+u.GetState().String())
		}
	}
	return out
}

// TestRebootWaitsForEarlierCommands: delivered [logs.collect, node.reboot]
// (as `commands run logs.collect; commands run node.reboot` does),
// logs.collect runs to its end and succeeds, then the machine reboots.
func TestRebootWaitsForEarlierCommands(t *testing.T) {
	cp := newControlPlane(t, 1)
	cfg := cp.config(t.TempDir(), 1)
	// logs.collect takes well longer than the reboot's own run.
	durations := &fakehw.Durations{ByKind: map[string]time.Duration{
		fakehw.KindLogsCollect: time.Second, fakehw.KindNodeReboot: 10 * time.Millisecond,
	}, Default: 10 * time.Millisecond}
	r, _ := start(t, cfg, agent.Deps{Hardware: fakeHardware("", durations)})
	waitEstablished(t, r)
	m := r.Machines()[0]
	node := m.NodeID()
	boot := m.Status().BootID

	now := clock.New().Now()
	logs := ids.New(ids.Command, now)
	reboot := ids.New(ids.Command, now)
	cp.gw.send(t, node, retrySafe(command(logs, "logs.collect")))
	cp.gw.send(t, node, command(reboot, "node.reboot"))
	require.Eventually(t, func() bool { return len(cp.gw.helloes(node)) == 2 && m.State() == daemon.StateEstablished }, waitFor, tick)
	require.Equal(t, []string{
		logs + " COMMAND_STATE_RUNNING",
		reboot + " COMMAND_STATE_RUNNING",
		logs + " COMMAND_STATE_SUCCEEDED",
		reboot + " COMMAND_STATE_SUCCEEDED",
	}, updateOrder(cp.gw, node))
	require.NotEqual(t, boot, cp.gw.helloes(node)[1].GetBootId(), "rebooted")
	require.Equal(t, 2, m.Status().Runs)
}

// TestRetrySafeCommandRunsAgainAfterRestart: a retry-safe command running
// when the daemon stops (a crash, the machine going down) runs again when
// the gateway delivers it again after the restart, and succeeds.
func TestRetrySafeCommandRunsAgainAfterRestart(t *testing.T) {
	cp := newControlPlane(t, 1)
	cfg := cp.config(t.TempDir(), 1)
	// The first run never ends on its own.
	durations := &fakehw.Durations{ByKind: map[string]time.Duration{fakehw.KindDiagNVML: time.Hour}, Default: 10 * time.Millisecond}
	ctx, cancel := context.WithCancel(t.Context())
	r, err := startRunner(ctx, cfg, agent.Deps{Hardware: fakeHardware("", durations)})
	require.NoError(t, err)
	waitEstablished(t, r)
	node := r.Machines()[0].NodeID()
	id := ids.New(ids.Command, clock.New().Now())
	cp.gw.send(t, node, retrySafe(command(id, "diag.nvml")))
	require.Eventually(t, func() bool { return len(cp.gw.updates(node, id)) == 1 }, waitFor, tick)
	cancel()
	require.NoError(t, r.Wait())

	r2, _ := start(t, cfg, agent.Deps{}) // the usual durations
	waitEstablished(t, r2)
	hello := cp.gw.helloes(node)[1]
	require.Len(t, hello.GetJournal(), 1)
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_RUNNING, hello.GetJournal()[0].GetState(), "started, to be run again")
	cp.gw.send(t, node, retrySafe(command(id, "diag.nvml")))
	require.Eventually(t, func() bool { return len(cp.gw.updates(node, id)) == 3 }, waitFor, tick)
	u := cp.gw.updates(node, id)
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_RUNNING, u[1].GetState())
	require.Equal(t, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, u[2].GetState())
	require.NotEmpty(t, u[2].GetResult().GetInventory().GetGpus())
	require.Equal(t, 1, r2.Machines()[0].Status().Runs, "run again by the new process")
}
