// Package acceptance decides whether a machine's reported inventory meets
// its pool's acceptance rules (pools.gpu_model, pools.expect_gpu_count). It
// is pure: the controllers' acceptance reconciler calls Evaluate with the
// inventory of a succeeded diag.nvml command and adopts or fails the node.
//
// To add a rule, add a field to Rules (and a pools column), check it in
// Evaluate and append a human sentence to the reasons.
package acceptance

import (
	"fmt"
	"sort"
	"strings"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// Rules are a pool's acceptance rules. The zero value accepts any machine.
type Rules struct {
	// GpuModel, when non-empty, must be a case-insensitive substring of
	// every GPU's model ("H100" matches "NVIDIA H100 80GB HBM3").
	GpuModel string
	// ExpectGpuCount, when > 0, must equal the number of GPUs.
	ExpectGpuCount int
}

// Evaluate checks inv against rules. It returns ok, or false and a reason
// made of human sentences joined by "; ", e.g. "expected 8 GPUs, found 7".
// A machine without GPUs fails a pool with GpuModel or ExpectGpuCount set.
// Every pool refuses an inventory whose GPU indexes are negative or repeat,
// since devices are booked by index.
func Evaluate(rules Rules, inv *gatewayv1.Inventory) (ok bool, reason string) {
	gpus := inv.GetGpus()
	var reasons []string

	seen := make(map[int32]bool, len(gpus))
	for _, g := range gpus {
		switch {
		case g.GetIndex() < 0:
			reasons = append(reasons, fmt.Sprintf("GPU index %d is negative", g.GetIndex()))
		case seen[g.GetIndex()]:
			reasons = append(reasons, fmt.Sprintf("GPU index %d is reported twice", g.GetIndex()))
		}
		seen[g.GetIndex()] = true
	}

	if want := strings.TrimSpace(rules.GpuModel); want != "" {
		if len(gpus) == 0 {
			reasons = append(reasons, fmt.Sprintf("expected %s GPUs, found no GPUs", want))
		} else if bad := mismatched(gpus, want); len(bad) > 0 {
			reasons = append(reasons, fmt.Sprintf("expected %s GPUs, found %s", want, strings.Join(bad, ", ")))
		}
	}
	if rules.ExpectGpuCount > 0 && len(gpus) != rules.ExpectGpuCount {
		reasons = append(reasons, fmt.Sprintf("expected %s, found %d", plural(rules.ExpectGpuCount, "GPU"), len(gpus)))
	}
	if len(reasons) > 0 {
		return false, strings.Join(reasons, "; ")
	}
	return true, ""
}

// mismatched describes the GPU models that do not contain want, as
// `"NVIDIA L40S" (GPUs 0, 1, 2, 3)`, in order of first index.
func mismatched(gpus []*gatewayv1.Gpu, want string) []string {
	lower := strings.ToLower(want)
	byModel := map[string][]int32{}
	var order []string
	for _, g := range gpus {
		if strings.Contains(strings.ToLower(g.GetModel()), lower) {
			continue
		}
		if _, ok := byModel[g.GetModel()]; !ok {
			order = append(order, g.GetModel())
		}
		byModel[g.GetModel()] = append(byModel[g.GetModel()], g.GetIndex())
	}
	out := make([]string, 0, len(order))
	for _, model := range order {
		idx := byModel[model]
		sort.Slice(idx, func(i, j int) bool { return idx[i] < idx[j] })
		nums := make([]string, len(idx))
		for i, n := range idx {
			nums[i] = fmt.Sprint(n)
		}
		word := "GPU"
		if len(idx) > 1 {
			word = "GPUs"
		}
		out = append(out, fmt.Sprintf("%q (%s %s)", model, word, strings.Join(nums, ", ")))
	}
	return out
}

func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}
