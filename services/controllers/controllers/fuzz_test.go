package controllers

import (
	"bytes"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/acceptance"
	"github.com/better-compute/better-compute/pkg/store"
)

// FuzzAcceptanceResult feeds arbitrary bytes, as the stored result of a
// succeeded diag.nvml command (commands.result, which the gateway wrote as
// protojson of a CommandResult into jsonb), with arbitrary pool rules, to
// judge, which adopts or fails the node. It must never panic; it answers
// with exactly one of an adoption and a failure; it adopts only a node whose
// inventory passes acceptance.Evaluate, recording one device per GPU with
// distinct indexes ≥ 0, the inventory as it decodes and the pool's labels;
// a failure has a reason, bounded by the sizes of the result and of the
// pool's model, which the reason quotes once; any inventory
// it records decodes back to the reported one.
func FuzzAcceptanceResult(f *testing.F) {
	h100 := &gatewayv1.Inventory{Hostname: "gpu-01", CpuCores: 64, MemoryBytes: 1 << 40, DriverVersion: "550.54", Gpus: []*gatewayv1.Gpu{
		{Index: 0, Uuid: "GPU-0", Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 80 << 30, PciBusId: "0000:01:00.0", Healthy: true},
		{Index: 1, Uuid: "GPU-1", Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 80 << 30, PciBusId: "0000:02:00.0", Healthy: true},
	}}
	l40s := &gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{{Index: 0, Model: "NVIDIA L40S"}, {Index: 0, Model: "NVIDIA L40S"}, {Index: -1}}}
	for _, r := range []*gatewayv1.CommandResult{{Inventory: h100}, {Inventory: l40s}, {Inventory: &gatewayv1.Inventory{}}, {Output: "x"}, {}} {
		b, err := protojson.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, "H100", int32(2))
		f.Add(b, "", int32(0))
		f.Add(b, " h100 ", int32(8))
	}
	for _, s := range []string{"", "null", "{}", `{"inventory": null}`, `{"inventory": {"gpus": [{"index": "1"}, {"index": 1}]}}`,
		`{"inventory": {"gpus": [{"index": 2147483648}]}}`, `{"inventory": {"unknown": 1}}`, `[]`, `{"inventory": {"gpus": {}}}`} {
		f.Add([]byte(s), "H100", int32(1))
	}

	f.Fuzz(func(t *testing.T, result []byte, gpuModel string, expect int32) {
		// jsonb holds no \u0000 (the gateway's decoder makes NUL U+FFFD):
		// such a result is never stored.
		if bytes.Contains(result, []byte(`\u0000`)) {
			return
		}
		c := store.AcceptanceCheck{NodeID: "node_01JFUZZ000000000000000000", PoolID: "pool_01JFUZZ000000000000000000",
			SiteID: "site_01JFUZZ000000000000000000", OwnerTenantID: "ten_01JFUZZ000000000000000000", GPUModel: gpuModel,
			ExpectGPUCount: expect, CommandID: "cmd_01JFUZZ000000000000000000", CommandState: "succeeded", CommandResult: result}
		adoption, failure := (&Acceptance{}).judge(c)
		if (adoption == nil) == (failure == nil) {
			t.Fatalf("want one of an adoption and a failure, got %v and %v", adoption, failure)
		}
		var reported gatewayv1.CommandResult
		readable := len(result) > 0 && ResultJSON.Unmarshal(result, &reported) == nil && reported.GetInventory() != nil
		inv := reported.GetInventory()

		if failure != nil {
			if failure.Reason == "" || failure.NodeID != c.NodeID || failure.PoolID != c.PoolID {
				t.Fatalf("failure %+v", failure)
			}
			if len(failure.Reason) > 16*len(result)+len(gpuModel)+1024 {
				t.Fatalf("a reason of %d bytes for a result of %d and a pool model of %d", len(failure.Reason), len(result), len(gpuModel))
			}
			if failure.Inventory != nil {
				requireInventory(t, failure.Inventory, inv)
				requireDevices(t, failure.Devices, inv)
			}
			if !readable && (failure.Inventory != nil || failure.Devices != nil) {
				t.Fatalf("a failure records an inventory from an unreadable result: %s", failure.Inventory)
			}
			return
		}
		if !readable {
			t.Fatalf("adopted a node whose result does not decode to an inventory: %q", result)
		}
		if ok, reason := acceptance.Evaluate(acceptance.Rules{GpuModel: gpuModel, ExpectGpuCount: int(expect)}, inv); !ok {
			t.Fatalf("adopted a node that fails acceptance: %s", reason)
		}
		if adoption.NodeID != c.NodeID || adoption.PoolID != c.PoolID || adoption.OwnerTenantID != c.OwnerTenantID {
			t.Fatalf("adoption %+v is not of the checked node", adoption)
		}
		requireInventory(t, adoption.Inventory, inv)
		requireDevices(t, adoption.Devices, inv)
		seen := map[int32]bool{}
		for _, d := range adoption.Devices {
			if d.Index < 0 || seen[d.Index] {
				t.Fatalf("adopted with devices %+v", adoption.Devices)
			}
			seen[d.Index] = true
			if want := strings.TrimSpace(gpuModel); want != "" && !strings.Contains(strings.ToLower(d.Model), strings.ToLower(want)) {
				t.Fatalf("adopted a %q for a pool of %q", d.Model, gpuModel)
			}
		}
		if expect > 0 && len(adoption.Devices) != int(expect) {
			t.Fatalf("adopted %d GPUs for a pool of %d", len(adoption.Devices), expect)
		}
		var spec gatewayv1.NodeSpec
		if err := protojson.Unmarshal(adoption.Spec, &spec); err != nil || spec.GetLabels()[LabelPool] != c.PoolID ||
			spec.GetLabels()[LabelSite] != c.SiteID {
			t.Fatalf("adopted with spec %s: %v", adoption.Spec, err)
		}
	})
}

// requireInventory checks that the recorded inventory (protojson) decodes
// to the reported one.
func requireInventory(t *testing.T, recorded []byte, reported *gatewayv1.Inventory) {
	t.Helper()
	var back gatewayv1.Inventory
	if err := protojson.Unmarshal(recorded, &back); err != nil || !proto.Equal(&back, reported) {
		t.Fatalf("recorded inventory %s is not the reported %v: %v", recorded, reported, err)
	}
}

// requireDevices checks that devices are the inventory's GPUs, in order.
func requireDevices(t *testing.T, devices []store.NodeDevice, inv *gatewayv1.Inventory) {
	t.Helper()
	if len(devices) != len(inv.GetGpus()) {
		t.Fatalf("%d devices for %d GPUs", len(devices), len(inv.GetGpus()))
	}
	for i, g := range inv.GetGpus() {
		d := devices[i]
		if d.Index != g.GetIndex() || d.UUID != g.GetUuid() || d.Model != g.GetModel() || d.MemoryBytes != g.GetMemoryBytes() ||
			d.Healthy != g.GetHealthy() {
			t.Fatalf("device %+v is not GPU %v", d, g)
		}
	}
}
