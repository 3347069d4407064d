package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
)

// fuzzNodeID is the node of the session FuzzSessionMessage's messages come
// on.
const fuzzNodeID = "node_01JFUZZ000000000000000000"

// storable reports whether s is text PostgreSQL can hold in a text column or
// a jsonb string: valid UTF-8 without NUL.
func storable(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// requireStorable fails unless every string of ss is storable.
func requireStorable(t *testing.T, field string, ss ...string) {
	t.Helper()
	for _, s := range ss {
		if !storable(s) {
			t.Fatalf("%s %q is not text the database can hold", field, s)
		}
	}
}

// requireFieldError fails unless err is InvalidArgument with a message that
// names a field of the message (or says what is wrong with the message).
func requireFieldError(t *testing.T, err error) {
	t.Helper()
	var cerr *connect.Error
	if !errors.As(err, &cerr) || cerr.Code() != connect.CodeInvalidArgument {
		t.Fatalf("not an InvalidArgument Connect error: %T %v", err, err)
	}
	for _, p := range []string{"hello.", "command_update.", "report is empty", "allocation_bound."} {
		if strings.HasPrefix(cerr.Message(), p) {
			return
		}
	}
	t.Fatalf("the error names no field: %q", cerr.Message())
}

// FuzzSessionMessage feeds arbitrary bytes, decoded as a SessionRequest,
// through the decoders the gateway runs on each message of a session
// (decode.go) (a RenewCertificate is relayed to JoinService as it is, which
// checks it: its FuzzRenewNodeCertificate): none may panic; a
// decoder returns a value or an InvalidArgument error naming the field,
// never both; every text it hands to the database is text PostgreSQL can
// hold (the update batcher writes the updates of many sessions in one
// statement, which one bad string would fail for all), and a command
// result is JSON that decodes back to the result.
func FuzzSessionMessage(f *testing.F) {
	key, err := pki.GenerateKey()
	if err != nil {
		f.Fatal(err)
	}
	csr, err := pki.NewCSR(key, fuzzNodeID)
	if err != nil {
		f.Fatal(err)
	}
	inv := &gatewayv1.Inventory{Hostname: "gpu-01", CpuCores: 64, MemoryBytes: 1 << 40, DriverVersion: "550.54",
		Gpus: []*gatewayv1.Gpu{{Index: 0, Uuid: "GPU-0", Model: "NVIDIA H100 80GB HBM3", MemoryBytes: 80 << 30, PciBusId: "0000:01:00.0", Healthy: true}}}
	for _, m := range []*gatewayv1.SessionRequest{
		{Msg: &gatewayv1.SessionRequest_Hello{Hello: &gatewayv1.Hello{NodeId: fuzzNodeID, BootId: "boot-1", AgentVersion: "bcd/1.0",
			ObservedGeneration: 3, Journal: []*gatewayv1.JournalEntry{{CommandId: "cmd_01JFUZZ000000000000000000"}}}}},
		{Msg: &gatewayv1.SessionRequest_Hello{Hello: &gatewayv1.Hello{}}},
		{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{CommandId: "cmd_01JFUZZ000000000000000000",
			State: gatewayv1.CommandState_COMMAND_STATE_SUCCEEDED, Result: &gatewayv1.CommandResult{Inventory: inv}}}},
		{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{CommandId: "cmd_01JFUZZ000000000000000000",
			State: gatewayv1.CommandState_COMMAND_STATE_FAILED, Error: "refused: the command has no signature\nline 2",
			Result: &gatewayv1.CommandResult{Output: "log line\n"}}}},
		{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{CommandId: "cmd_x",
			State: gatewayv1.CommandState_COMMAND_STATE_QUEUED}}},
		{Msg: &gatewayv1.SessionRequest_CommandUpdate{CommandUpdate: &gatewayv1.CommandUpdate{}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_ObservedGeneration{ObservedGeneration: 7}}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_Inventory{Inventory: inv}}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_AllocationBound{AllocationBound: &gatewayv1.AllocationBound{
			ReservationId: "res_01JFUZZ000000000000000000", CdiDevices: []string{"nvidia.com/gpu=0", "nvidia.com/gpu=1"}, Generation: 4}}}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_AllocationBound{AllocationBound: &gatewayv1.AllocationBound{}}}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_AllocationUnbound{AllocationUnbound: &gatewayv1.AllocationUnbound{
			ReservationId: "res_01JFUZZ000000000000000000", Generation: 5}}}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_SpecRefused{SpecRefused: &gatewayv1.SpecRefused{
			Generation: 6, Reason: "refused: the desired state has no signature"}}}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{Report: &gatewayv1.Report_SshRefused{SshRefused: &gatewayv1.SshRefused{
			Reason: "unknown CA\t" + strings.Repeat("é", 1100), KeyId: "key-1", User: "root"}}}}},
		{Msg: &gatewayv1.SessionRequest_Report{Report: &gatewayv1.Report{}}},
		{Msg: &gatewayv1.SessionRequest_Heartbeat{Heartbeat: &gatewayv1.Heartbeat{Seq: 9, ObservedGeneration: 7}}},
		{Msg: &gatewayv1.SessionRequest_RenewCertificate{RenewCertificate: &gatewayv1.RenewCertificate{CsrDer: csr}}},
		{Msg: &gatewayv1.SessionRequest_RenewCertificate{RenewCertificate: &gatewayv1.RenewCertificate{CsrDer: csr[:len(csr)-1]}}},
		{},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}

	f.Fuzz(func(t *testing.T, b []byte) {
		var req gatewayv1.SessionRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			return // Connect ends a session whose message does not decode
		}
		// What Server.receive does first: a message that breaks
		// gateway.proto's rules ends its session with InvalidArgument.
		err := checkMessage(&req)
		// Its hand checks (validate.go) refuse what protovalidate over the
		// whole message refuses, in the same words.
		if full := service.Validate(&req); (err == nil) != (full == nil) || (err != nil && err.Error() != full.Error()) {
			t.Fatalf("checkMessage: %v; protovalidate: %v", err, full)
		}
		if err != nil {
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("checkMessage: %v", err)
			}
			return
		}
		switch m := req.GetMsg().(type) {
		case *gatewayv1.SessionRequest_Hello:
			h, err := decodeHello(m.Hello)
			if err != nil {
				if h != nil {
					t.Fatalf("a hello and an error: %v", err)
				}
				requireFieldError(t, err)
				return
			}
			if h.GetNodeId() == "" {
				t.Fatal("accepted a hello without node_id")
			}
			requireStorable(t, "hello", h.GetBootId(), h.GetAgentVersion())
		case *gatewayv1.SessionRequest_CommandUpdate:
			fuzzCommandUpdate(t, m.CommandUpdate)
		case *gatewayv1.SessionRequest_Report:
			fuzzReport(t, m.Report)
		case *gatewayv1.SessionRequest_Heartbeat, nil:
			// Numbers only; handle answers an empty message itself.
		case *gatewayv1.SessionRequest_RenewCertificate:
			// Relayed as it is; JoinService decides (FuzzRenewNodeCertificate).
		default:
			t.Fatalf("session message %T has no case here: give it a decoder in decode.go and a case in this target", m)
		}
	})
}

// fuzzCommandUpdate checks decodeCommandUpdate on u.
func fuzzCommandUpdate(t *testing.T, u *gatewayv1.CommandUpdate) {
	t.Helper()
	upd, err := decodeCommandUpdate(fuzzNodeID, u)
	if err != nil {
		if upd.CommandID != "" || upd.State != "" || upd.Result != nil {
			t.Fatalf("an update and an error: %+v, %v", upd, err)
		}
		requireFieldError(t, err)
		return
	}
	if upd.NodeID != fuzzNodeID || upd.CommandID == "" || upd.State != commandStates[u.GetState()] {
		t.Fatalf("update %+v does not say what %v does", upd, u)
	}
	requireStorable(t, "command_update", upd.CommandID, upd.Error)
	if u.GetResult() == nil {
		if upd.Result != nil {
			t.Fatalf("a result from an update without one: %s", upd.Result)
		}
		return
	}
	// jsonb refuses the escape \u0000 as well as a NUL.
	if !json.Valid(upd.Result) || bytes.Contains(upd.Result, []byte(`\u0000`)) {
		t.Fatalf("result %s is not JSON the database can hold", upd.Result)
	}
	var back gatewayv1.CommandResult
	if err := protojson.Unmarshal(upd.Result, &back); err != nil {
		t.Fatalf("result %s does not decode: %v", upd.Result, err)
	}
	// JSON has no room for the fields this gateway does not know.
	want := proto.CloneOf(u.GetResult())
	discardUnknown(want.ProtoReflect())
	in, err := protojson.Marshal(want)
	if err == nil && !bytes.Contains(in, []byte(`\u0000`)) && !proto.Equal(&back, want) {
		t.Fatalf("result %s is not the update's %v", upd.Result, want)
	}
}

// discardUnknown drops the unknown fields of m and of every message in it.
func discardUnknown(m protoreflect.Message) {
	m.SetUnknown(nil)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i := range v.List().Len() {
				discardUnknown(v.List().Get(i).Message())
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				discardUnknown(mv.Message())
				return true
			})
		case !fd.IsList() && !fd.IsMap() && fd.Message() != nil:
			discardUnknown(v.Message())
		}
		return true
	})
}

// fuzzReport checks the decoders of a Report.
func fuzzReport(t *testing.T, r *gatewayv1.Report) {
	t.Helper()
	if err := decodeReport(r); err != nil {
		if r.GetReport() != nil {
			t.Fatalf("refused a report that carries one: %v", err)
		}
		requireFieldError(t, err)
		return
	}
	switch m := r.GetReport().(type) {
	case *gatewayv1.Report_ObservedGeneration, *gatewayv1.Report_Inventory, *gatewayv1.Report_AllocationUnbound:
		// Recorded as numbers, or not recorded (logged).
	case *gatewayv1.Report_SpecRefused:
		requireStorable(t, "spec_refused.reason", m.SpecRefused.GetReason())
	case *gatewayv1.Report_SshRefused:
		ref := decodeSSHRefused(fuzzNodeID, m.SshRefused)
		requireStorable(t, "ssh_refused", ref.Reason, ref.KeyID, ref.User)
	case *gatewayv1.Report_AllocationBound:
		b, err := decodeAllocationBound(m.AllocationBound)
		if err != nil {
			if b != nil {
				t.Fatalf("an allocation and an error: %v", err)
			}
			requireFieldError(t, err)
			return
		}
		if b.GetReservationId() == "" {
			t.Fatal("accepted an allocation_bound without reservation_id")
		}
		requireStorable(t, "allocation_bound", append([]string{b.GetReservationId()}, b.GetCdiDevices()...)...)
	default:
		t.Fatalf("report %T has no case here: give it a decoder in decode.go and a case in this target", m)
	}
}
