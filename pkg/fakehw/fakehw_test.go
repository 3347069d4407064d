package fakehw_test

import (
	"maps"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/better-compute/better-compute/pkg/fakehw"
)

func TestVariants(t *testing.T) {
	t.Parallel()
	require.Equal(t, []string{"cpu", "hgx-h100", "hgx-h100-gpu-missing", "l40s"}, fakehw.Variants())
}

// TestKinds: Kinds lists exactly the kinds Run knows, each with a duration
// of its own in DefaultDurations.
func TestKinds(t *testing.T) {
	t.Parallel()
	kinds := fakehw.Kinds()
	require.True(t, slices.IsSorted(kinds))
	require.ElementsMatch(t, kinds, slices.Collect(maps.Keys(fakehw.DefaultDurations().ByKind)))
	m, err := fakehw.New("hgx-h100", "machine-a")
	require.NoError(t, err)
	for _, k := range kinds {
		_, _, err := m.Run(k, nil)
		require.NoError(t, err, k)
	}
}

func TestNewInventory(t *testing.T) {
	t.Parallel()
	uuidRE := regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	for _, tc := range []struct {
		variant   string
		model     string
		memGiB    int64
		indexes   []int32
		cores     int32
		hasDriver bool
	}{
		{"hgx-h100", "NVIDIA H100 80GB HBM3", 80, []int32{0, 1, 2, 3, 4, 5, 6, 7}, 224, true},
		{"hgx-h100-gpu-missing", "NVIDIA H100 80GB HBM3", 80, []int32{0, 1, 2, 4, 5, 6, 7}, 224, true},
		{"l40s", "NVIDIA L40S", 48, []int32{0, 1, 2, 3}, 64, true},
		{"cpu", "", 0, nil, 32, false},
	} {
		t.Run(tc.variant, func(t *testing.T) {
			t.Parallel()
			m, err := fakehw.New(tc.variant, "machine-a")
			require.NoError(t, err)
			inv := m.Inventory()
			require.Equal(t, m.Hostname(), inv.GetHostname())
			require.True(t, strings.HasPrefix(inv.GetHostname(), tc.variant+"-"))
			require.Equal(t, tc.cores, inv.GetCpuCores())
			require.Positive(t, inv.GetMemoryBytes())
			require.Equal(t, tc.hasDriver, inv.GetDriverVersion() != "")
			require.Len(t, inv.GetGpus(), len(tc.indexes))
			require.Equal(t, len(tc.indexes), m.GPUCount())
			seen := map[string]bool{}
			for i, g := range inv.GetGpus() {
				require.Equal(t, tc.indexes[i], g.GetIndex())
				require.True(t, m.HasGPU(g.GetIndex()))
				require.Equal(t, tc.model, g.GetModel())
				require.Equal(t, tc.memGiB<<30, g.GetMemoryBytes())
				require.Regexp(t, uuidRE, g.GetUuid())
				require.Equal(t, fakehw.GPUUUID("machine-a", g.GetIndex()), g.GetUuid())
				require.NotEmpty(t, g.GetPciBusId())
				require.True(t, g.GetHealthy())
				require.False(t, seen[g.GetUuid()], "duplicate uuid")
				seen[g.GetUuid()] = true
			}
			if tc.variant == "hgx-h100-gpu-missing" {
				require.False(t, m.HasGPU(3))
			}
			// Inventory returns a fresh message each time.
			inv.Gpus = nil
			require.Len(t, m.Inventory().GetGpus(), len(tc.indexes))
		})
	}
}

func TestNewErrors(t *testing.T) {
	t.Parallel()
	_, err := fakehw.New("dgx-b200", "m")
	require.ErrorContains(t, err, `unknown hardware variant "dgx-b200"`)
	require.ErrorContains(t, err, "cpu, hgx-h100, hgx-h100-gpu-missing, l40s")
	_, err = fakehw.New("cpu", "")
	require.ErrorContains(t, err, "machine id")
}

func TestStableIdentity(t *testing.T) {
	t.Parallel()
	a1, err := fakehw.New("hgx-h100", "machine-a")
	require.NoError(t, err)
	a2, err := fakehw.New("hgx-h100", "machine-a")
	require.NoError(t, err)
	b, err := fakehw.New("hgx-h100", "machine-b")
	require.NoError(t, err)
	require.True(t, proto.Equal(a1.Inventory(), a2.Inventory()))
	require.Equal(t, a1.BootID(), a2.BootID())
	require.NotEqual(t, a1.Inventory().GetGpus()[0].GetUuid(), b.Inventory().GetGpus()[0].GetUuid())
	require.NotEqual(t, a1.Hostname(), b.Hostname())
	require.NotEqual(t, a1.BootID(), b.BootID())
}

func TestReboot(t *testing.T) {
	t.Parallel()
	m, err := fakehw.New("l40s", "machine-a")
	require.NoError(t, err)
	first := m.BootID()
	require.Equal(t, uint64(0), m.Boot())
	second := m.Reboot()
	require.NotEqual(t, first, second)
	require.Equal(t, second, m.BootID())
	require.Equal(t, uint64(1), m.Boot())
	m.SetBoot(0)
	require.Equal(t, first, m.BootID())
}

func TestRun(t *testing.T) {
	t.Parallel()
	m, err := fakehw.New("hgx-h100", "machine-a")
	require.NoError(t, err)
	for _, tc := range []struct {
		name, kind, args string
		wantInventory    bool
		wantOutput       string
		wantErr          string
	}{
		{name: "diag", kind: "diag.nvml", wantInventory: true},
		{name: "refresh", kind: "inventory.refresh", wantInventory: true},
		{name: "logs default", kind: "logs.collect", wantOutput: "seq=19 "},
		{name: "logs lines", kind: "logs.collect", args: `{"lines":2}`, wantOutput: "seq=1 "},
		{name: "logs bad lines", kind: "logs.collect", args: `{"lines":0}`, wantErr: "lines must be between 1 and 1000"},
		{name: "logs bad json", kind: "logs.collect", args: `[1]`, wantErr: "must be a JSON object"},
		{name: "reboot", kind: "node.reboot", wantOutput: "rebooting"},
		{name: "unknown", kind: "gpu.reset", wantErr: `unknown command kind "gpu.reset"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var args []byte
			if tc.args != "" {
				args = []byte(tc.args)
			}
			res, d, err := m.Run(tc.kind, args)
			require.Positive(t, d)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			if tc.wantInventory {
				require.True(t, proto.Equal(m.Inventory(), res.GetInventory()))
			}
			require.Contains(t, res.GetOutput(), tc.wantOutput)
		})
	}
	res, _, err := m.Run("logs.collect", []byte(`{"lines":2}`))
	require.NoError(t, err)
	require.Equal(t, 2, strings.Count(res.GetOutput(), "\n"))
}

func TestDurations(t *testing.T) {
	t.Parallel()
	m, err := fakehw.New("cpu", "m")
	require.NoError(t, err)
	require.Equal(t, fakehw.DefaultDurations().ByKind["diag.nvml"], m.Duration("diag.nvml"))
	m.SetDurations(fakehw.Durations{Default: 7})
	require.Equal(t, fakehw.Durations{Default: 7}.Default, m.Duration("diag.nvml"))
}
