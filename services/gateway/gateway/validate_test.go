package gateway_test

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// TestInvalidSessionMessageEndsOnlyThatSession: a session message whose
// node-supplied strings break gateway.proto's rules (too long, a control
// character, not a hostname, too many items) ends that session with
// InvalidArgument naming the field, and records nothing of it; another
// session on the same gateway goes on.
func TestInvalidSessionMessageEndsOnlyThatSession(t *testing.T) {
	t.Parallel()
	update := func(cmdID, errText string) *gatewayv1.SessionRequest {
		return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{
			CommandId: cmdID, State: gatewayv1.CommandState_COMMAND_STATE_FAILED, Error: errText}}}
	}
	result := func(cmdID string, inv *gatewayv1.Inventory) *gatewayv1.SessionRequest {
		return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{
			CommandId: cmdID, State: gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED,
			Result: &gatewayv1.CommandResult{Inventory: inv}}}}
	}
	report := func(r *gatewayv1.Report) *gatewayv1.SessionRequest {
		return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_Report{Report: r}}
	}
	for _, tc := range []struct {
		name  string
		msg   func(cmdID string) *gatewayv1.SessionRequest
		field string
	}{
		{"oversize command error", func(id string) *gatewayv1.SessionRequest {
			return update(id, strings.Repeat("x", 64<<10))
		}, "command_update.error"},
		{"control character in command error", func(id string) *gatewayv1.SessionRequest {
			return update(id, "failed\x1b[2J\x1b[Hall clear")
		}, "command_update.error"},
		{"newline in command error", func(id string) *gatewayv1.SessionRequest {
			return update(id, "failed\nlevel=INFO msg=\"forged log line\"")
		}, "command_update.error"},
		{"hostname that is no hostname", func(id string) *gatewayv1.SessionRequest {
			return result(id, &gatewayv1.Inventory{Hostname: "gpu 01; rm -rf"})
		}, "command_update.result.inventory.hostname"},
		{"too many gpus", func(id string) *gatewayv1.SessionRequest {
			gpus := make([]*gatewayv1.Gpu, 1000)
			for i := range gpus {
				gpus[i] = &gatewayv1.Gpu{Index: int32(i)}
			}
			return result(id, &gatewayv1.Inventory{Hostname: "gpu-01", Gpus: gpus})
		}, "command_update.result.inventory.gpus"},
		{"control character in gpu model", func(id string) *gatewayv1.SessionRequest {
			return result(id, &gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{{Model: "H100\u202egnp.exe"}}})
		}, "command_update.result.inventory.gpus[0].model"},
		{"oversize spec refusal", func(string) *gatewayv1.SessionRequest {
			return report(&gatewayv1.Report{Report: &gatewayv1.Report_SpecRefused{SpecRefused: &gatewayv1.SpecRefused{
				Generation: 1, Reason: strings.Repeat("é", 5000)}}})
		}, "report.spec_refused.reason"},
		{"control character in ssh user", func(string) *gatewayv1.SessionRequest {
			return report(&gatewayv1.Report{Report: &gatewayv1.Report_SshRefused{SshRefused: &gatewayv1.SshRefused{
				Reason: "unknown CA", User: "root\r\n"}}})
		}, "report.ssh_refused.user"},
		{"too many cdi devices", func(string) *gatewayv1.SessionRequest {
			return report(&gatewayv1.Report{Report: &gatewayv1.Report_AllocationBound{AllocationBound: &gatewayv1.AllocationBound{
				ReservationId: "res_1", CdiDevices: make([]string, 1000)}}})
		}, "report.allocation_bound.cdi_devices"},
		{"oversize renewal csr", func(string) *gatewayv1.SessionRequest {
			return &gatewayv1.SessionRequest{Msg: &gatewayv1.SessionRequest_RenewCertificate{RenewCertificate: &gatewayv1.RenewCertificate{
				CsrDer: make([]byte, 64<<10)}}}
		}, "renew_certificate.csr_der"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, options{})
			g := e.startGateway(noResync)
			bad, good := e.newNode(), e.newNode()
			cmdID := e.queueCommand(bad.id, "diag.nvml", "user")
			b, _ := e.connect(g, bad, nil)
			require.Equal(t, cmdID, b.next().GetCommand().GetCommandId())
			d, _ := e.connect(g, good, nil)

			b.send(tc.msg(cmdID))
			err := b.ended()
			require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%v", err)
			require.Contains(t, err.Error(), tc.field)
			require.Equal(t, "delivered", e.command(cmdID).State, "nothing of the message is recorded")

			// The other session is still served.
			d.heartbeat(1, 0)
			require.Equal(t, int64(1), d.nextAck())
			d.observed(3)
			eventually(t, func() bool { return e.nodeRow(good.id).Observed == 3 }, "the other session's report is stored")
			require.Equal(t, 1, g.srv.Sessions())
		})
	}
}

// TestValidSessionMessagesAreAccepted: the messages of a daemon within the
// rules (text with tabs and newlines in a command's output, an empty
// hostname, an error at its longest) are recorded.
func TestValidSessionMessagesAreAccepted(t *testing.T) {
	t.Parallel()
	e := setup(t, options{})
	g := e.startGateway(noResync)
	n := e.newNode()
	ok := e.queueCommand(n.id, "logs.collect", "user")
	failing := e.queueCommand(n.id, "diag.nvml", "user")
	d, _ := e.connect(g, n, nil)
	got := map[string]bool{}
	for range 2 {
		got[d.next().GetCommand().GetCommandId()] = true
	}
	require.Equal(t, map[string]bool{ok: true, failing: true}, got)

	output := "line 1\tok\nline 2\tok\n"
	d.update(ok, gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, &gatewayv1.CommandResult{Output: output,
		Inventory: &gatewayv1.Inventory{Gpus: []*gatewayv1.Gpu{{Model: "NVIDIA H100 80GB HBM3", Uuid: "GPU-1", PciBusId: "00000000:17:00.0"}}}}, "")
	longest := strings.Repeat("é", 4096)
	d.update(failing, gatewayv1.CommandState_COMMAND_STATE_FAILED, nil, longest)
	eventually(t, func() bool { return e.command(failing).State == "failed" }, "failed stored")
	require.Equal(t, longest, e.command(failing).Error)
	require.Equal(t, "succeeded", e.command(ok).State)
	require.Contains(t, string(e.command(ok).Result), `line 1\tok\nline 2\tok\n`)
}

// TestHeartbeatHasNoRules: Heartbeat, its fields and the messages they hold
// carry no option at all, so no protovalidate rule: the gateway's check of
// session messages (checkMessage) skips heartbeats on that ground, and this
// test fails the day a rule is added to them.
func TestHeartbeatHasNoRules(t *testing.T) {
	t.Parallel()
	seen := map[protoreflect.FullName]bool{}
	var check func(md protoreflect.MessageDescriptor)
	check = func(md protoreflect.MessageDescriptor) {
		if seen[md.FullName()] {
			return
		}
		seen[md.FullName()] = true
		requireNoOptions(t, md.FullName(), md.Options())
		for i := range md.Fields().Len() {
			fd := md.Fields().Get(i)
			requireNoOptions(t, fd.FullName(), fd.Options())
			if fd.Message() != nil {
				check(fd.Message())
			}
		}
		for i := range md.Oneofs().Len() {
			requireNoOptions(t, md.Oneofs().Get(i).FullName(), md.Oneofs().Get(i).Options())
		}
	}
	check((&gatewayv1.Heartbeat{}).ProtoReflect().Descriptor())
	require.True(t, seen["google.protobuf.Timestamp"], "the walk reaches sent_at's message")
}

func requireNoOptions(t *testing.T, name protoreflect.FullName, opts proto.Message) {
	t.Helper()
	if opts == nil || !opts.ProtoReflect().IsValid() {
		return
	}
	n := 0
	opts.ProtoReflect().Range(func(protoreflect.FieldDescriptor, protoreflect.Value) bool { n++; return true })
	require.Zero(t, n, "%s has options", name)
	require.Empty(t, opts.ProtoReflect().GetUnknown(), "%s has options", name)
}
