package fakedaemon

import (
	"bytes"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/fakehw"
)

// TestHardware: the fake machine of a HardwareSpec.
func TestHardware(t *testing.T) {
	t.Run("a new machine", func(t *testing.T) {
		a, err := Config{}.hardware(agent.HardwareSpec{})
		require.NoError(t, err)
		b, err := Config{}.hardware(agent.HardwareSpec{})
		require.NoError(t, err)
		require.Regexp(t, `^[0-9a-f]{32}$`, a.MachineID())
		require.NotEqual(t, a.MachineID(), b.MachineID(), "a random id each")
		require.Equal(t, DefaultVariant, a.Variant())
		want, err := fakehw.New(DefaultVariant, a.MachineID())
		require.NoError(t, err)
		require.Equal(t, want.BootID(), a.BootID(), "boot 0")
		require.Equal(t, want.Hostname(), a.Hostname())
	})
	t.Run("seeded", func(t *testing.T) {
		hw, err := Config{Variant: fakehw.VariantCPU, MachineIDSeed: "s"}.hardware(agent.HardwareSpec{Index: 3, Boot: 2})
		require.NoError(t, err)
		require.Equal(t, MachineID("s", 3), hw.MachineID())
		require.Equal(t, fakehw.VariantCPU, hw.Variant())
		want, err := fakehw.New(fakehw.VariantCPU, MachineID("s", 3))
		require.NoError(t, err)
		want.SetBoot(2)
		require.Equal(t, want.BootID(), hw.BootID())
	})
	t.Run("a joined machine keeps its id and variant", func(t *testing.T) {
		var logs bytes.Buffer
		spec := agent.HardwareSpec{Index: 1, MachineID: "m-1", Variant: fakehw.VariantL40S, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
		hw, err := Config{Variant: fakehw.VariantCPU, MachineIDSeed: "s"}.hardware(spec)
		require.NoError(t, err)
		require.Equal(t, "m-1", hw.MachineID())
		require.Equal(t, fakehw.VariantL40S, hw.Variant())
		require.Contains(t, logs.String(), `msg="keeping the variant the machine joined with" variant=l40s requested=cpu`)
		logs.Reset()
		_, err = Config{Variant: fakehw.VariantL40S}.hardware(spec)
		require.NoError(t, err)
		require.Empty(t, logs.String(), "the variant asked for")
	})
	t.Run("durations", func(t *testing.T) {
		d := fakehw.Durations{ByKind: map[string]time.Duration{fakehw.KindLogsCollect: time.Minute}, Default: time.Second}
		hw, err := Config{Durations: &d}.hardware(agent.HardwareSpec{})
		require.NoError(t, err)
		_, took, err := hw.Run(fakehw.KindLogsCollect, nil)
		require.NoError(t, err)
		require.Equal(t, time.Minute, took)
		_, took, err = hw.Run(fakehw.KindDiagNVML, nil)
		require.NoError(t, err)
		require.Equal(t, time.Second, took)
		hw, err = Config{}.hardware(agent.HardwareSpec{})
		require.NoError(t, err)
		_, took, err = hw.Run(fakehw.KindDiagNVML, nil)
		require.NoError(t, err)
		require.Equal(t, fakehw.DefaultDurations().ByKind[fakehw.KindDiagNVML], took)
	})
	t.Run("unknown variant", func(t *testing.T) {
		_, err := Config{Variant: "dgx"}.hardware(agent.HardwareSpec{})
		require.ErrorContains(t, err, `unknown hardware variant "dgx"`)
	})
}
