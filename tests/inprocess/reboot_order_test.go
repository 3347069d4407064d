package inprocess_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
)

// TestRebootRunsAfterCommandsQueuedBeforeIt is the operator's sequence
// `commands run logs.collect; commands run node.reboot` through the API and
// the gateway: logs.collect runs to its end and succeeds, delivered once;
// then the machine reboots. Then the same with the machine down while both
// are queued (inventory.refresh, node.reboot), so that they are delivered
// together at Hello.
func TestRebootRunsAfterCommandsQueuedBeforeIt(t *testing.T) {
	d := fakehw.DefaultDurations()
	d.ByKind[fakehw.KindLogsCollect] = 2 * time.Second
	d.ByKind[fakehw.KindInventoryRefresh] = 2 * time.Second
	f, m := setupCommands(t, d)
	require.Equal(t, bootID(t, m, 0), m.Status().BootID)

	logs := f.run(t, "logs.collect", time.Minute)
	reboot := f.run(t, "node.reboot", time.Minute)
	done := f.waitState(t, logs.GetId(), "succeeded", 20*time.Second)
	require.Equal(t, int32(1), done.GetDeliveries())
	require.NotEmpty(t, done.GetResultJson())
	f.waitState(t, reboot.GetId(), "succeeded", 20*time.Second)
	boot1 := bootID(t, m, 1)
	require.Eventually(t, func() bool {
		s := m.Status()
		return s.BootID == boot1 && s.State == daemon.StateEstablished
	}, 20*time.Second, 20*time.Millisecond, "rebooted once logs.collect was done")

	// Queued while the machine is down: delivered together at Hello.
	f.stop()
	inv := f.run(t, "inventory.refresh", time.Minute)
	reboot2 := f.run(t, "node.reboot", time.Minute)
	f.start(t, d) // a start of the fakedaemon is a boot: boot 2
	m = f.runner.Machines()[0]
	done = f.waitState(t, inv.GetId(), "succeeded", 30*time.Second)
	require.Equal(t, int32(1), done.GetDeliveries())
	f.waitState(t, reboot2.GetId(), "succeeded", 30*time.Second)
	boot3 := bootID(t, m, 3)
	require.Eventually(t, func() bool {
		s := m.Status()
		return s.BootID == boot3 && s.State == daemon.StateEstablished
	}, 20*time.Second, 20*time.Millisecond, "rebooted once inventory.refresh was done")
	require.Equal(t, []string{"command.queued", "command.succeeded"}, f.events(t, inv.GetId()))
}
