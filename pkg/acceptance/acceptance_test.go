package acceptance_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/acceptance"
	"github.com/better-compute/better-compute/pkg/fakehw"
)

var (
	h100Pool = acceptance.Rules{GpuModel: "H100", ExpectGpuCount: 8}
	l40sPool = acceptance.Rules{GpuModel: "L40S", ExpectGpuCount: 4}
	cpuPool  = acceptance.Rules{}
)

func inventory(t *testing.T, variant string) *gatewayv1.Inventory {
	t.Helper()
	m, err := fakehw.New(variant, "machine-1")
	require.NoError(t, err)
	return m.Inventory()
}

func TestEvaluateFakeVariants(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		variant string
		rules   acceptance.Rules
		ok      bool
		reason  string // exact reason, when ok is false
	}{
		{"hgx-h100 in the H100 pool", fakehw.VariantHGXH100, h100Pool, true, ""},
		{"hgx-h100-gpu-missing in the H100 pool", fakehw.VariantHGXH100GPUMissing, h100Pool, false,
			"expected 8 GPUs, found 7"},
		{"l40s in the H100 pool", fakehw.VariantL40S, h100Pool, false,
			`expected H100 GPUs, found "NVIDIA L40S" (GPUs 0, 1, 2, 3); expected 8 GPUs, found 4`},
		{"cpu in the H100 pool", fakehw.VariantCPU, h100Pool, false,
			"expected H100 GPUs, found no GPUs; expected 8 GPUs, found 0"},
		{"l40s in the L40S pool", fakehw.VariantL40S, l40sPool, true, ""},
		{"hgx-h100 in the L40S pool", fakehw.VariantHGXH100, l40sPool, false,
			`expected L40S GPUs, found "NVIDIA H100 80GB HBM3" (GPUs 0, 1, 2, 3, 4, 5, 6, 7); expected 4 GPUs, found 8`},
		{"cpu in the L40S pool", fakehw.VariantCPU, l40sPool, false,
			"expected L40S GPUs, found no GPUs; expected 4 GPUs, found 0"},
		{"cpu in the CPU pool", fakehw.VariantCPU, cpuPool, true, ""},
		{"hgx-h100 in the CPU pool", fakehw.VariantHGXH100, cpuPool, true, ""},
		{"hgx-h100-gpu-missing in the CPU pool", fakehw.VariantHGXH100GPUMissing, cpuPool, true, ""},
		{"l40s in the CPU pool", fakehw.VariantL40S, cpuPool, true, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ok, reason := acceptance.Evaluate(tc.rules, inventory(t, tc.variant))
			require.Equal(t, tc.ok, ok, "reason: %s", reason)
			require.Equal(t, tc.reason, reason)
		})
	}
}

// TestEvaluateEveryVariant keeps the table above honest when fakehw grows a
// variant: every variant passes a pool without rules.
func TestEvaluateEveryVariant(t *testing.T) {
	t.Parallel()
	for _, v := range fakehw.Variants() {
		ok, reason := acceptance.Evaluate(cpuPool, inventory(t, v))
		require.True(t, ok, "%s: %s", v, reason)
	}
}

func TestEvaluateRules(t *testing.T) {
	t.Parallel()
	gpu := func(i int32, model string) *gatewayv1.Gpu {
		return &gatewayv1.Gpu{Index: i, Model: model, Healthy: true}
	}
	tests := []struct {
		name   string
		rules  acceptance.Rules
		inv    *gatewayv1.Inventory
		ok     bool
		reason string
	}{
		{"model is a case-insensitive substring", acceptance.Rules{GpuModel: "h100 80gb"},
			&gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{gpu(0, "NVIDIA H100 80GB HBM3")}}, true, ""},
		{"one GPU of another model", acceptance.Rules{GpuModel: "H100"},
			&gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{gpu(0, "NVIDIA H100 80GB HBM3"), gpu(1, "NVIDIA A100")}},
			false, `expected H100 GPUs, found "NVIDIA A100" (GPU 1)`},
		{"count only", acceptance.Rules{ExpectGpuCount: 1},
			&gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{gpu(0, "x"), gpu(1, "x")}}, false, "expected 1 GPU, found 2"},
		{"nil inventory in a CPU pool", acceptance.Rules{}, nil, true, ""},
		{"nil inventory in a GPU pool", acceptance.Rules{ExpectGpuCount: 2}, nil, false, "expected 2 GPUs, found 0"},
		{"repeated index", acceptance.Rules{},
			&gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{gpu(0, "x"), gpu(0, "x")}}, false, "GPU index 0 is reported twice"},
		{"negative index", acceptance.Rules{},
			&gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{gpu(-1, "x")}}, false, "GPU index -1 is negative"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ok, reason := acceptance.Evaluate(tc.rules, tc.inv)
			require.Equal(t, tc.ok, ok, "reason: %s", reason)
			require.Equal(t, tc.reason, reason)
		})
	}
}
