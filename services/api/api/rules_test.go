package api

import (
	"strings"
	"testing"

	"buf.build/go/protovalidate"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/service/servicetest"
)

// runCommandRequest is a RunCommand request as the CLI sends it.
func runCommandRequest() *computev1.RunCommandRequest {
	return &computev1.RunCommandRequest{NodeId: "node_01JFUZZ000000000000000000", Kind: "diag.nvml",
		Timeout: durationpb.New(300e9), RequestId: "cli-0f9c2b7e-51d4-4c8a-9e3b-7a2d1c6b5e40"}
}

// TestRunCommandValidatesWithoutAllocating: the API's validator passes a
// RunCommand request within the rules by its hand check (ruleChecks), without
// protovalidate, which allocated on every call (its request_id pattern and
// duration rules).
func TestRunCommandValidatesWithoutAllocating(t *testing.T) {
	req := runCommandRequest()
	require.NoError(t, ruleChecks.Validate(req))
	require.Positive(t, testing.AllocsPerRun(100, func() { _ = service.RuleChecks(nil).Validate(req) }),
		"protovalidate alone allocates")
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = ruleChecks.Validate(req) }))
}

// TestRuleChecksAnswerAsProtovalidate: for requests keeping and breaking
// each rule a hand check checks, the API's validator answers as
// protovalidate does: nil for the same ones, the same refusal for the
// others.
func TestRuleChecksAnswerAsProtovalidate(t *testing.T) {
	t.Parallel()
	set := func(f func(r *computev1.RunCommandRequest)) *computev1.RunCommandRequest {
		r := runCommandRequest()
		f(r)
		return r
	}
	var reqs []*computev1.RunCommandRequest
	for _, id := range []string{"", "n", strings.Repeat("n", 64), strings.Repeat("n", 65), strings.Repeat("é", 64),
		strings.Repeat("é", 65), "node 1\n"} {
		reqs = append(reqs, set(func(r *computev1.RunCommandRequest) { r.NodeId = id }))
	}
	for _, kind := range []string{"", "diag.nvml", "inventory.refresh", "logs.collect", "node.reboot", "Diag.nvml", "rm -rf"} {
		reqs = append(reqs, set(func(r *computev1.RunCommandRequest) { r.Kind = kind }))
	}
	for _, d := range []*durationpb.Duration{nil, {}, {Seconds: 1}, {Nanos: 999999999}, {Seconds: 1, Nanos: 1},
		{Seconds: 86399, Nanos: 999999999}, {Seconds: 86400}, {Seconds: 86400, Nanos: 1}, {Seconds: 86401}, {Seconds: -1},
		{Seconds: -5, Nanos: -1}, {Seconds: 5, Nanos: -1}, {Seconds: 5, Nanos: 1e9}, {Seconds: 315576000001}} {
		reqs = append(reqs, set(func(r *computev1.RunCommandRequest) { r.Timeout = d }))
	}
	for _, id := range []string{"", "r", strings.Repeat("r", 128), strings.Repeat("r", 129), strings.Repeat("é", 128),
		strings.Repeat("é", 129), "tab\t", "nl\n", "del\x7f", "c1\u0085", "bidi\u202e", "zwj\u200d", "sep\u2028",
		"par\u2029", "emoji 🚀", "nul\x00"} {
		reqs = append(reqs, set(func(r *computev1.RunCommandRequest) { r.RequestId = id }))
	}
	passed := servicetest.RequireSameRefusals(t, reqs,
		func(r *computev1.RunCommandRequest) error { return ruleChecks.Validate(r) },
		func(r *computev1.RunCommandRequest) error { return protovalidate.Validate(r) })
	require.Positive(t, passed)
	require.Less(t, passed, len(reqs))
}

// TestRuleChecksPinTheProtosRules pins every protovalidate rule of the
// messages the API checks by hand (ruleChecks) and of the messages in
// them: a rule added or changed in compute.proto fails here until the
// hand check (and this list) says it too.
func TestRuleChecksPinTheProtosRules(t *testing.T) {
	t.Parallel()
	want := map[protoreflect.FullName]map[protoreflect.FullName]string{
		"bc.compute.v1.RunCommandRequest": {
			"bc.compute.v1.RunCommandRequest.node_id":    `string:{min_len:1 max_len:64}`,
			"bc.compute.v1.RunCommandRequest.kind":       `string:{in:"diag.nvml" in:"inventory.refresh" in:"logs.collect" in:"node.reboot"}`,
			"bc.compute.v1.RunCommandRequest.timeout":    `duration:{lte:{seconds:86400} gte:{seconds:1}}`,
			"bc.compute.v1.RunCommandRequest.request_id": `string:{max_len:128 pattern:"^[^\\p{Cc}\\p{Cf}\\p{Zl}\\p{Zp}]*$"}`,
		},
	}
	got := map[protoreflect.FullName]map[protoreflect.FullName]string{}
	for name := range ruleChecks {
		mt, err := protoregistry.GlobalTypes.FindMessageByName(name)
		require.NoError(t, err)
		got[name] = servicetest.ProtoRules(mt.Descriptor())
	}
	require.Equal(t, want, got)
}
