package gateway

import (
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/store"
)

// The decoders of the daemon's Session messages: pure checks of what a
// message says, run before anything is written, which answer bad input with
// InvalidArgument naming the field (the session then ends). FuzzSessionMessage
// feeds them arbitrary messages. To check a new message, add its decoder here
// and its case to the fuzz target.
//
// PostgreSQL text and jsonb cannot hold NUL, which proto strings may carry,
// and one such string fails its whole statement (the update batcher's
// holds the updates of many sessions). So a decoder hands the database no
// NUL: in free text it becomes U+FFFD (storableText), and an id or name
// with one, which names nothing, is refused (checkName).

// storableText returns s with each NUL made U+FFFD, the replacement
// character.
func storableText(s string) string { return strings.ReplaceAll(s, "\x00", "\uFFFD") }

// storableMessage makes every string of m, of the messages in it and the
// keys of its maps storableText, in place.
func storableMessage(m protoreflect.Message) {
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList():
			l := v.List()
			for i := range l.Len() {
				switch {
				case fd.Kind() == protoreflect.StringKind:
					l.Set(i, protoreflect.ValueOfString(storableText(l.Get(i).String())))
				case fd.Message() != nil:
					storableMessage(l.Get(i).Message())
				}
			}
		case fd.IsMap():
			mp := v.Map()
			var bad []protoreflect.MapKey
			mp.Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				switch {
				case fd.MapValue().Kind() == protoreflect.StringKind:
					mp.Set(k, protoreflect.ValueOfString(storableText(mv.String())))
				case fd.MapValue().Message() != nil:
					storableMessage(mv.Message())
				}
				if fd.MapKey().Kind() == protoreflect.StringKind && strings.ContainsRune(k.String(), 0) {
					bad = append(bad, k)
				}
				return true
			})
			for _, k := range bad {
				mv := mp.Get(k)
				mp.Clear(k)
				mp.Set(protoreflect.ValueOfString(storableText(k.String())).MapKey(), mv)
			}
		case fd.Kind() == protoreflect.StringKind:
			m.Set(fd, protoreflect.ValueOfString(storableText(v.String())))
		case fd.Message() != nil:
			storableMessage(v.Message())
		}
		return true
	})
}

// checkName refuses (InvalidArgument naming field) an id or name that holds
// a NUL.
func checkName(field, s string) error {
	if strings.ContainsRune(s, 0) {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s holds a NUL character", field))
	}
	return nil
}

// decodeHello checks a Hello (node_id is required) and returns it with its
// boot_id and agent_version storableText.
func decodeHello(h *gatewayv1.Hello) (*gatewayv1.Hello, error) {
	if h.GetNodeId() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("hello.node_id is required"))
	}
	if strings.ContainsRune(h.GetBootId(), 0) || strings.ContainsRune(h.GetAgentVersion(), 0) {
		h = proto.CloneOf(h)
		h.BootId, h.AgentVersion = storableText(h.BootId), storableText(h.AgentVersion)
	}
	return h, nil
}

// decodeCommandUpdate checks a CommandUpdate of node nodeID and returns it
// as the update batcher records it (store.SessionCommandUpdate without Now):
// command_id is required and holds no NUL, state is one a daemon reports
// (commandStates), result, when set, is encoded as protojson, and result and
// error are storable (storableMessage, storableText).
func decodeCommandUpdate(nodeID string, u *gatewayv1.CommandUpdate) (store.SessionCommandUpdate, error) {
	if u.GetCommandId() == "" {
		return store.SessionCommandUpdate{}, connect.NewError(connect.CodeInvalidArgument, errors.New("command_update.command_id is required"))
	}
	if err := checkName("command_update.command_id", u.GetCommandId()); err != nil {
		return store.SessionCommandUpdate{}, err
	}
	state, ok := commandStates[u.GetState()]
	if !ok {
		return store.SessionCommandUpdate{}, connect.NewError(connect.CodeInvalidArgument,
			errors.New("command_update.state must be DELIVERED, RUNNING, SUCCEEDED or FAILED"))
	}
	var result []byte
	if u.GetResult() != nil {
		r := proto.CloneOf(u.GetResult())
		storableMessage(r.ProtoReflect())
		var err error
		if result, err = protojson.Marshal(r); err != nil {
			return store.SessionCommandUpdate{}, connect.NewError(connect.CodeInvalidArgument, errors.New("command_update.result cannot be encoded"))
		}
	}
	return store.SessionCommandUpdate{NodeID: nodeID, CommandID: u.GetCommandId(), State: state, Result: result,
		Error: storableText(u.GetError())}, nil
}

// decodeReport checks that a Report carries a report.
func decodeReport(r *gatewayv1.Report) error {
	if r.GetReport() == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("report is empty"))
	}
	return nil
}

// decodeSpecRefused returns a SpecRefused report as it is recorded: its
// reason storableText.
func decodeSpecRefused(r *gatewayv1.SpecRefused) *gatewayv1.SpecRefused {
	if strings.ContainsRune(r.GetReason(), 0) {
		r = proto.CloneOf(r)
		r.Reason = storableText(r.Reason)
	}
	return r
}

// decodeSSHRefused returns an SshRefused report of node nodeID as it is
// recorded. Its strings are within gateway.proto's bounds and free of
// control characters: checkMessage refused the message otherwise.
func decodeSSHRefused(nodeID string, r *gatewayv1.SshRefused) store.SSHRefusal {
	return store.SSHRefusal{NodeID: nodeID, Reason: r.GetReason(), KeyID: r.GetKeyId(), User: r.GetUser()}
}

// decodeAllocationBound checks an AllocationBound report: reservation_id is
// required, and neither it nor a CDI device name holds a NUL.
func decodeAllocationBound(b *gatewayv1.AllocationBound) (*gatewayv1.AllocationBound, error) {
	if b.GetReservationId() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("allocation_bound.reservation_id is required"))
	}
	if err := checkName("allocation_bound.reservation_id", b.GetReservationId()); err != nil {
		return nil, err
	}
	for i, d := range b.GetCdiDevices() {
		if err := checkName(fmt.Sprintf("allocation_bound.cdi_devices[%d]", i), d); err != nil {
			return nil, err
		}
	}
	return b, nil
}
