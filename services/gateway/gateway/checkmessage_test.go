package gateway

import (
	"strings"
	"testing"

	validatepb "buf.build/gen/go/bufbuild/protovalidate/protocolbuffers/go/buf/validate"
	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/runtime/protoimpl"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/service/servicetest"
)

// nvmlUpdate returns a succeeded diag.nvml update of a machine with n GPUs,
// the session message the command path checks most.
func nvmlUpdate(n int) *gatewayv1.SessionRequest {
	inv := &gatewayv1.Inventory{Hostname: "gpu-01", CpuCores: 64, MemoryBytes: 1 << 40, DriverVersion: "550.54.15"}
	for i := range n {
		inv.Gpus = append(inv.Gpus, &gatewayv1.Gpu{Index: int32(i), Uuid: "GPU-4d3a7f1e-9c2b-4b8e-a1d0-5f6e7a8b9c0" + string(rune('0'+i%10)),
			Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 80 << 30, PciBusId: "00000000:1" + string(rune('0'+i%10)) + ":00.0", Healthy: true})
	}
	return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{
		CommandId: "cmd_01JFUZZ000000000000000000", State: gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED,
		Result: &gatewayv1.CommandResult{Inventory: inv, Output: "line one\n\tline two\n"}}}}
}

// BenchmarkCheckMessage measures checkMessage on nvmlUpdate(8).
func BenchmarkCheckMessage(b *testing.B) {
	req := nvmlUpdate(8)
	b.ReportAllocs()
	for b.Loop() {
		if err := checkMessage(req); err != nil {
			b.Fatal(err)
		}
	}
}

// TestCheckMessageRefusesHandCheckedFields checks, for each field whose
// rules checkMessage tests by hand, that a value breaking each of them is
// refused with InvalidArgument naming the field, word for word as
// protovalidate over the whole message (service.Validate) refuses it, and
// that a value keeping them passes.
func TestCheckMessageRefusesHandCheckedFields(t *testing.T) {
	t.Parallel()
	long := func(n int) string { return strings.Repeat("a", n) }
	for _, tc := range []struct {
		name, field string
		set         func(*gatewayv1.SessionRequest, string)
		good        []string
		bad         []string
	}{
		{"error", "command_update.error",
			func(r *gatewayv1.SessionRequest, s string) { r.GetCommandUpdate().Error = s },
			[]string{"", "nvml: GPU 3 fell off the bus", long(4096), strings.Repeat("é", 4096)},
			[]string{long(4097), strings.Repeat("é", 4097), "two\nlines", "tab\there", "nul\x00", "bidi\u202e", "sep\u2028", "par\u2029", "c1\u0085"}},
		{"output", "command_update.result.output",
			func(r *gatewayv1.SessionRequest, s string) { r.GetCommandUpdate().GetResult().Output = s },
			[]string{"", "a\n\tb\n", long(262144)},
			[]string{long(262145), strings.Repeat("é", 131073), "cr\r", "esc\x1b[0m", "del\x7f", "c1\u009f", "bom\ufeff", "sep\u2028"}},
		{"driver_version", "command_update.result.inventory.driver_version",
			func(r *gatewayv1.SessionRequest, s string) {
				r.GetCommandUpdate().GetResult().GetInventory().DriverVersion = s
			},
			[]string{"", "550.54.15", long(64)},
			[]string{long(65), "5\n5", "v\u200b"}},
		{"gpu uuid", "command_update.result.inventory.gpus[3].uuid",
			func(r *gatewayv1.SessionRequest, s string) {
				r.GetCommandUpdate().GetResult().GetInventory().Gpus[3].Uuid = s
			},
			[]string{"", "GPU-0", long(64)},
			[]string{long(65), "GPU 0", "GPU-é", "GPU-\t", "GPU-\x7f"}},
		{"gpu model", "command_update.result.inventory.gpus[3].model",
			func(r *gatewayv1.SessionRequest, s string) {
				r.GetCommandUpdate().GetResult().GetInventory().Gpus[3].Model = s
			},
			[]string{"", "NVIDIA H100 80GB HBM3", strings.Repeat("é", 128)},
			[]string{long(129), "H100\n", "H100\u200e"}},
		{"gpu pci_bus_id", "command_update.result.inventory.gpus[3].pci_bus_id",
			func(r *gatewayv1.SessionRequest, s string) {
				r.GetCommandUpdate().GetResult().GetInventory().Gpus[3].PciBusId = s
			},
			[]string{"", "00000000:17:00.0", long(32)},
			[]string{long(33), "0000 17", "00\u00a0"}},
		{"report gpu uuid", "report.inventory.gpus[3].uuid",
			func(r *gatewayv1.SessionRequest, s string) {
				inv := r.GetCommandUpdate().GetResult().GetInventory()
				inv.Gpus[3].Uuid = s
				r.Msg = &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_Inventory{Inventory: inv}}}
			},
			[]string{"GPU-3"}, []string{"GPU 3"}},
		{"report driver_version", "report.inventory.driver_version",
			func(r *gatewayv1.SessionRequest, s string) {
				inv := r.GetCommandUpdate().GetResult().GetInventory()
				inv.DriverVersion = s
				r.Msg = &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_Inventory{Inventory: inv}}}
			},
			[]string{"550"}, []string{"5\x005"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for _, s := range tc.good {
				req := nvmlUpdate(8)
				tc.set(req, s)
				require.NoError(t, checkMessage(req), "%q", s)
			}
			for _, s := range tc.bad {
				req := nvmlUpdate(8)
				tc.set(req, s)
				err := checkMessage(req)
				require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%q: %v", s, err)
				var cerr *connect.Error
				require.ErrorAs(t, err, &cerr)
				require.True(t, strings.HasPrefix(cerr.Message(), tc.field+": "), "%q: %s", s, cerr.Message())
				require.Equal(t, service.Validate(req).Error(), err.Error(), "%q", s)
			}
		})
	}
}

// TestHandRulesMatchProto checks that the rules checkMessage tests by hand
// are gateway.proto's: the same limit and pattern for every field of
// handChecked.
func TestHandRulesMatchProto(t *testing.T) {
	t.Parallel()
	want := map[protoreflect.FullName]struct {
		rule    textRule
		pattern string
	}{
		"bc.gateway.v1.CommandUpdate.error":      {ruleError, `^[^\p{Cc}\p{Cf}\p{Zl}\p{Zp}]*$`},
		"bc.gateway.v1.CommandResult.output":     {ruleOutput, `^[^\x00-\x08\x0B-\x1F\x7F-\x9F\p{Cf}\p{Zl}\p{Zp}]*$`},
		"bc.gateway.v1.Inventory.driver_version": {ruleDriverVersion, `^[^\p{Cc}\p{Cf}\p{Zl}\p{Zp}]*$`},
		"bc.gateway.v1.Gpu.uuid":                 {ruleGPUUUID, `^[!-~]*$`},
		"bc.gateway.v1.Gpu.model":                {ruleGPUModel, `^[^\p{Cc}\p{Cf}\p{Zl}\p{Zp}]*$`},
		"bc.gateway.v1.Gpu.pci_bus_id":           {ruleGPUPCIBusID, `^[!-~]*$`},
	}
	require.Len(t, handChecked, len(want))
	for d := range handChecked {
		fd := d.(protoreflect.FieldDescriptor)
		w, ok := want[fd.FullName()]
		require.True(t, ok, "%s is hand-checked", fd.FullName())
		// A copy: the options are the descriptor's, which protovalidate reads.
		rules := proto.Clone(proto.GetExtension(fd.Options(), validatepb.E_Field).(*validatepb.FieldRules).GetString()).(*validatepb.StringRules)
		require.Equal(t, w.pattern, rules.GetPattern(), "%s", fd.FullName())
		if w.rule.bytes {
			require.Equal(t, uint64(w.rule.maxLen), rules.GetMaxBytes(), "%s", fd.FullName())
			require.False(t, rules.HasMaxLen(), "%s", fd.FullName())
		} else {
			require.Equal(t, uint64(w.rule.maxLen), rules.GetMaxLen(), "%s", fd.FullName())
			require.False(t, rules.HasMaxBytes(), "%s", fd.FullName())
		}
		// No other string rule the hand check would leave out.
		rules.ClearPattern()
		rules.ClearMaxLen()
		rules.ClearMaxBytes()
		require.Empty(t, protoimpl.X.MessageStringOf(rules), "%s has more rules", fd.FullName())
	}
}

// TestCheckMessageCommandUpdateAllocatesNothing: a command update within
// the rules, the message the command path checks most, is checked by hand
// (commandUpdateHolds) without protovalidate, whose walk of its GPUs
// allocates (and grows the session goroutine's stack) for every message.
func TestCheckMessageCommandUpdateAllocatesNothing(t *testing.T) {
	req := nvmlUpdate(8)
	require.NoError(t, checkMessage(req))
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = checkMessage(req) }))
}

// TestCommandUpdateHandCheckIsProtovalidates: for command updates keeping
// and breaking each rule commandUpdateHolds checks, checkMessage answers as
// protovalidate over the whole message does (service.Validate): nil for
// the same ones, and the same refusal word for word for the others.
func TestCommandUpdateHandCheckIsProtovalidates(t *testing.T) {
	t.Parallel()
	label := func(n int) string { return strings.Repeat("a", n) }
	update := func(set func(u *gatewayv1.CommandUpdate)) *gatewayv1.SessionRequest {
		req := nvmlUpdate(8)
		set(req.GetCommandUpdate())
		return req
	}
	var reqs []*gatewayv1.SessionRequest
	for _, id := range []string{"", "c", "cmd_01JFUZZ", label(64), label(65), "cmd 1", "cmd_é", "cmd\x00"} {
		reqs = append(reqs, update(func(u *gatewayv1.CommandUpdate) { u.CommandId = id }))
	}
	for _, st := range []int32{-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 1000} {
		reqs = append(reqs, update(func(u *gatewayv1.CommandUpdate) { u.State = gatewayv1.CommandState(st) }))
	}
	for _, h := range []string{"", "gpu-01", "gpu-01.", "GPU-01.example.com", "a", "1a", "a1", "123", "1.2.3.4",
		"a.123", "123.a", "-a", "a-", "a--b", "a..b", ".", "..", ".a", "a_b", "a b", "é", "xn--bcher-kva",
		label(63), label(64), label(63) + "." + label(63) + "." + label(63) + "." + label(61),
		label(63) + "." + label(63) + "." + label(63) + "." + label(62),
		label(63) + "." + label(63) + "." + label(63) + "." + label(61) + "."} {
		reqs = append(reqs, update(func(u *gatewayv1.CommandUpdate) { u.GetResult().GetInventory().Hostname = h }))
	}
	for _, n := range []int{0, 1, 64, 65} {
		reqs = append(reqs, update(func(u *gatewayv1.CommandUpdate) {
			u.GetResult().GetInventory().Gpus = nvmlUpdate(n).GetCommandUpdate().GetResult().GetInventory().GetGpus()
		}))
	}
	reqs = append(reqs,
		update(func(u *gatewayv1.CommandUpdate) { u.Result = nil }),
		update(func(u *gatewayv1.CommandUpdate) { u.GetResult().Inventory = nil }),
		update(func(u *gatewayv1.CommandUpdate) { u.GetResult().GetInventory().Gpus[2] = nil }),
		update(func(u *gatewayv1.CommandUpdate) { u.CommandId, u.Error = "", "two\nlines" }))
	passed := servicetest.RequireSameRefusals(t, reqs, checkMessage,
		func(r *gatewayv1.SessionRequest) error { return service.Validate(r) })
	require.Greater(t, passed, 0)
	require.Less(t, passed, len(reqs))
}

// TestCommandUpdateRulesAreHandChecked pins every protovalidate rule of a
// CommandUpdate and of the messages in it, which commandUpdateHolds checks
// by hand: a rule added or changed in gateway.proto fails here until the
// hand check (and this list) says it too.
func TestCommandUpdateRulesAreHandChecked(t *testing.T) {
	t.Parallel()
	want := map[protoreflect.FullName]string{
		"bc.gateway.v1.CommandUpdate.command_id": `string:{min_len:1 max_len:64 pattern:"^[!-~]*$"}`,
		"bc.gateway.v1.CommandUpdate.state":      `enum:{defined_only:true}`,
		"bc.gateway.v1.CommandUpdate.error":      `string:{max_len:4096 pattern:"^[^\\p{Cc}\\p{Cf}\\p{Zl}\\p{Zp}]*$"}`,
		"bc.gateway.v1.CommandResult.output":     `string:{max_bytes:262144 pattern:"^[^\\x00-\\x08\\x0B-\\x1F\\x7F-\\x9F\\p{Cf}\\p{Zl}\\p{Zp}]*$"}`,
		"bc.gateway.v1.Inventory.gpus":           `repeated:{max_items:64}`,
		"bc.gateway.v1.Inventory.hostname":       `ignore:IGNORE_IF_ZERO_VALUE string:{max_len:253 hostname:true}`,
		"bc.gateway.v1.Inventory.driver_version": `string:{max_len:64 pattern:"^[^\\p{Cc}\\p{Cf}\\p{Zl}\\p{Zp}]*$"}`,
		"bc.gateway.v1.Gpu.uuid":                 `string:{max_len:64 pattern:"^[!-~]*$"}`,
		"bc.gateway.v1.Gpu.model":                `string:{max_len:128 pattern:"^[^\\p{Cc}\\p{Cf}\\p{Zl}\\p{Zp}]*$"}`,
		"bc.gateway.v1.Gpu.pci_bus_id":           `string:{max_len:32 pattern:"^[!-~]*$"}`,
		"bc.gateway.v1.SessionRequest.msg:oneof": `required:true`,
	}
	got := servicetest.ProtoRules((&gatewayv1.CommandUpdate{}).ProtoReflect().Descriptor())
	// The path from the session message to the update: its oneof.
	const oneof = "bc.gateway.v1.SessionRequest.msg:oneof"
	got[oneof] = servicetest.ProtoRules((&gatewayv1.SessionRequest{}).ProtoReflect().Descriptor())[oneof]
	require.Equal(t, want, got)
}
