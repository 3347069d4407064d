package gateway

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// BenchmarkDecodeCommandUpdate measures decodeCommandUpdate on the update
// of nvmlUpdate(8), a diag.nvml result of 8 GPUs.
func BenchmarkDecodeCommandUpdate(b *testing.B) {
	u := nvmlUpdate(8).GetCommandUpdate()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeCommandUpdate(fuzzNodeID, u); err != nil {
			b.Fatal(err)
		}
	}
}

// TestDecodeCommandUpdateEncodesTheResultOnce: the result of a command
// update is encoded as JSON into one buffer (appendResultJSON), not
// through protojson's reflection, which allocated for every field of every
// GPU.
func TestDecodeCommandUpdateEncodesTheResultOnce(t *testing.T) {
	u := nvmlUpdate(8).GetCommandUpdate()
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := decodeCommandUpdate(fuzzNodeID, u); err != nil {
			t.Fatal(err)
		}
	})
	require.LessOrEqual(t, allocs, 1.0)
}

// fill sets every field of m and of the messages in it to a value that is
// not its zero value (two elements for a list), so that an encoder that
// leaves a field out, or a field added to gateway.proto that it does not
// know, shows.
func fill(t *testing.T, m protoreflect.Message, depth int) {
	t.Helper()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		one := func(n int) protoreflect.Value {
			switch fd.Kind() {
			case protoreflect.StringKind:
				return protoreflect.ValueOfString(string(fd.Name()) + ` "q" \ é ☃ ` + strings.Repeat("x", n))
			case protoreflect.Int32Kind:
				return protoreflect.ValueOfInt32(-2147483648 + int32(n))
			case protoreflect.Int64Kind:
				return protoreflect.ValueOfInt64(-9223372036854775808 + int64(n))
			case protoreflect.BoolKind:
				return protoreflect.ValueOfBool(true)
			case protoreflect.MessageKind:
				v := m.NewField(fd)
				if fd.IsList() {
					v = protoreflect.ValueOfMessage(v.List().NewElement().Message())
				}
				fill(t, v.Message(), depth+1)
				return v
			}
			t.Fatalf("%s: a field of kind %s, which appendResultJSON does not encode", fd.FullName(), fd.Kind())
			return protoreflect.Value{}
		}
		switch {
		case fd.IsList():
			l := m.NewField(fd).List()
			l.Append(one(1))
			l.Append(one(2))
			m.Set(fd, protoreflect.ValueOfList(l))
		case fd.IsMap():
			t.Fatalf("%s: a map, which appendResultJSON does not encode", fd.FullName())
		default:
			m.Set(fd, one(0))
		}
	}
}

// TestResultJSONIsProtojsons: appendResultJSON encodes a command result as
// the same JSON as protojson (the API answers the stored jsonb, which
// normalizes the text): for a result with every field set, with each set
// to its extreme values, and with fields left at zero; and it decodes back
// to the result.
func TestResultJSONIsProtojsons(t *testing.T) {
	t.Parallel()
	full := &gatewayv1.CommandResult{}
	fill(t, full.ProtoReflect(), 0)
	require.NotEmpty(t, full.GetInventory().GetGpus())
	results := []*gatewayv1.CommandResult{
		full,
		{},
		{Inventory: &gatewayv1.Inventory{}},
		{Output: "a\tb\nc\r\x01\x1f\x7f\u2028\u2029</script>&'\"\\"},
		{Inventory: &gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{{}, nil, {Index: 1}}}},
		{Inventory: &gatewayv1.Inventory{CpuCores: 2147483647, MemoryBytes: 9223372036854775807,
			Gpus: []*gatewayv1.Gpu{{Index: -1, MemoryBytes: -1}}}},
		nvmlUpdate(8).GetCommandUpdate().GetResult(),
	}
	for _, r := range results {
		got := appendResultJSON(nil, r)
		want, err := protojson.Marshal(r)
		require.NoError(t, err)
		var g, w any
		require.NoError(t, json.Unmarshal(got, &g), "%s", got)
		require.NoError(t, json.Unmarshal(want, &w))
		require.Equal(t, w, g, "%s", got)
		var back gatewayv1.CommandResult
		require.NoError(t, protojson.Unmarshal(got, &back))
		require.True(t, proto.Equal(r, &back), "%v\n%v", r, &back)
	}
}
