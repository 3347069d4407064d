package gateway

import (
	"errors"

	"connectrpc.com/connect"

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
// holds the updates of many sessions). gateway.proto refuses a NUL in
// every string a daemon sends (its rules refuse control characters), and
// checkMessage runs those rules on every message before its decoder
// (TestEverySessionStringRefusesNUL checks that no string lacks one), so
// the decoders hand the database no NUL without looking for one.

// decodeHello checks a Hello (node_id is required) and returns it.
func decodeHello(h *gatewayv1.Hello) (*gatewayv1.Hello, error) {
	if h.GetNodeId() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("hello.node_id is required"))
	}
	return h, nil
}

// decodeCommandUpdate checks a CommandUpdate of node nodeID and returns it
// as the update batcher records it (store.SessionCommandUpdate without Now):
// command_id is required, state is one a daemon reports (commandStates),
// and result, when set, is encoded as protojson encodes it
// (appendResultJSON).
func decodeCommandUpdate(nodeID string, u *gatewayv1.CommandUpdate) (store.SessionCommandUpdate, error) {
	if u.GetCommandId() == "" {
		return store.SessionCommandUpdate{}, connect.NewError(connect.CodeInvalidArgument, errors.New("command_update.command_id is required"))
	}
	state, ok := commandStates[u.GetState()]
	if !ok {
		return store.SessionCommandUpdate{}, connect.NewError(connect.CodeInvalidArgument,
			errors.New("command_update.state must be DELIVERED, RUNNING, SUCCEEDED or FAILED"))
	}
	var result []byte
	if r := u.GetResult(); r != nil {
		result = appendResultJSON(make([]byte, 0, resultJSONSize(r)), r)
	}
	return store.SessionCommandUpdate{NodeID: nodeID, CommandID: u.GetCommandId(), State: state, Result: result,
		Error: u.GetError()}, nil
}

// decodeReport checks that a Report carries a report.
func decodeReport(r *gatewayv1.Report) error {
	if r.GetReport() == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("report is empty"))
	}
	return nil
}

// decodeSSHRefused returns an SshRefused report of node nodeID as it is
// recorded. Its strings are within gateway.proto's bounds and free of
// control characters: checkMessage refused the message otherwise.
func decodeSSHRefused(nodeID string, r *gatewayv1.SshRefused) store.SSHRefusal {
	return store.SSHRefusal{NodeID: nodeID, Reason: r.GetReason(), KeyID: r.GetKeyId(), User: r.GetUser()}
}

// decodeAllocationBound checks an AllocationBound report: reservation_id is
// required.
func decodeAllocationBound(b *gatewayv1.AllocationBound) (*gatewayv1.AllocationBound, error) {
	if b.GetReservationId() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("allocation_bound.reservation_id is required"))
	}
	return b, nil
}
