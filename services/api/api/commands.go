package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/batch"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// defaultCommandPageSize is ListCommands' page size when the request gives
// none.
const defaultCommandPageSize = 500

type commandService struct{ *Server }

// RunCommand queues a command for a node of the caller's tenant (any node
// for root-admin), with deadline now + timeout (store.DefaultCommandTimeout
// when unset; a set timeout is 1 s to 24 h, so an explicit zero is
// InvalidArgument rather than the default), signed when the deployment signs intent, in one transaction
// with its audit row, its command.queued event and the gateway's poke. A
// request_id already used on the node returns the command it queued (and
// writes only the audit row). Errors: NotFound (node_id; another tenant's
// node too), FailedPrecondition (node not adopted or revoked, with the
// reason), AlreadyExists (request_id used for another kind),
// InvalidArgument (protovalidate: node_id, kind, timeout, request_id).
func (s *commandService) RunCommand(ctx context.Context, req *connect.Request[computev1.RunCommandRequest]) (*connect.Response[computev1.RunCommandResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	audit, err := iam.DeferAudit(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	timeout := store.DefaultCommandTimeout
	if msg.Timeout != nil {
		timeout = msg.Timeout.AsDuration()
	}
	a, err := s.commandQueue().Do(ctx, queueItem{cmd: store.NewCommand{NodeID: msg.NodeId, Kind: msg.Kind,
		RequestID: msg.RequestId, CreatedBy: p.TokenID, Scope: p.Scope(), Traceparent: telemetry.Traceparent(ctx)},
		timeout: timeout, audit: audit})
	if err == nil {
		err = a.err
	}
	if errors.Is(err, store.ErrNotFound) {
		// Unknown, or another tenant's (QueueCommands checks the tenant
		// on the row it locks).
		return nil, notFound("node", msg.NodeId)
	}
	if errors.Is(err, store.ErrNodeNotRunnable) {
		return nil, connect.NewError(connect.CodeFailedPrecondition, err)
	}
	var cerr *connect.Error
	if errors.As(err, &cerr) {
		return nil, cerr
	}
	if err != nil {
		return nil, mapError(err)
	}
	q := a.queued
	if !q.Existing {
		s.commandsCreated.Add(ctx, 1, s.kindAttrs.Get(q.Kind, ""))
	}
	s.logger.InfoContext(ctx, "command queued", telemetry.KeyCommandID, q.ID, telemetry.KeyNodeID, q.NodeID, "kind", q.Kind,
		"existing", q.Existing)
	return connect.NewResponse(&computev1.RunCommandResponse{Command: commandToProto(q.Command)}), nil
}

// queueItem is one RunCommand call for the command queue: the command
// (its id and deadline are set when its batch is written), its timeout and
// its audit row.
type queueItem struct {
	cmd     store.NewCommand
	timeout time.Duration
	audit   iam.DeferredAudit
}

// queueAnswer is what the command queue did with one queueItem.
type queueAnswer struct {
	queued store.QueuedCommand
	// err refuses this call alone (store.QueueResult.Err, or AlreadyExists
	// for a request id used for another kind); nothing was written for it.
	err error
}

// commandQueueWorkers is how many batches of RunCommand calls are written
// at once (database connections the queue keeps busy).
const commandQueueWorkers = 2

// commandQueue returns the batcher of RunCommand calls, started on first
// use; Close stops it.
func (s *Server) commandQueue() *batch.Batcher[queueItem, queueAnswer] {
	s.queueOnce.Do(func() {
		s.queue = batch.New(s.queueCommands, batch.Options{Workers: commandQueueWorkers, MaxBatch: 256})
	})
	return s.queue
}

// queueCommands writes a batch of RunCommand calls in one statement
// (store.QueueCommands, a transaction of its own) with the audit row of each
// call that queued a command or found the one of its request id; the calls
// refused write nothing, and the audit interceptor records their refusal.
func (s *Server) queueCommands(ctx context.Context, items []queueItem) ([]queueAnswer, error) {
	now := s.db.Now()
	cmds := make([]store.NewCommand, len(items))
	for i, it := range items {
		cmds[i] = it.cmd
		cmds[i].ID = ids.New(ids.Command, now)
		cmds[i].Deadline = now.Add(it.timeout)
		// Target, Detail, At and Outcome are QueueCommands'.
		a := it.audit.Entry(now, "", "")
		cmds[i].Audit = &a
	}
	res, err := store.QueueCommands(ctx, s.db.AutoCommit(), s.intent, now, cmds)
	if err != nil {
		return nil, err
	}
	s.pokeGateways(res)
	out := make([]queueAnswer, len(items))
	for i, r := range res {
		out[i] = queueAnswer{queued: r.QueuedCommand, err: r.Err}
		if r.Err != nil {
			continue
		}
		if q := r.QueuedCommand; q.Existing && q.Kind != cmds[i].Kind {
			out[i].err = connect.NewError(connect.CodeAlreadyExists, fmt.Errorf(
				"request_id: already used for %s command %s on this node", q.Kind, q.ID))
			continue
		}
		items[i].audit.Written()
	}
	return out, nil
}

// pokeGateways publishes, right after the commit, the pokes QueueCommands
// also wrote to the outbox, each naming its outbox row
// (store.OutboxIDHeader): the gateways claim the commands without waiting
// for the outbox relay, whose copy of the same row they then drop (pokes are
// idempotent hints; the copy would find nothing left to claim), and which
// is what a poke lost here falls back on.
func (s *Server) pokeGateways(res []store.QueueResult) {
	if s.nc == nil {
		return
	}
	type poke struct {
		id    int64
		nodes []string
	}
	pokes := map[string]*poke{}
	for _, r := range res {
		if r.Err != nil || r.Existing || r.GatewayID == "" {
			continue
		}
		p := pokes[r.GatewayID]
		if p == nil {
			p = &poke{id: r.PokeID}
			pokes[r.GatewayID] = p
		}
		if !slices.Contains(p.nodes, r.NodeID) {
			p.nodes = append(p.nodes, r.NodeID)
		}
	}
	for gw, p := range pokes {
		payload, err := json.Marshal(store.Poke{NodeIDs: p.nodes})
		if err == nil {
			m := &nats.Msg{Subject: store.SubjectPokeGatewayPrefix + gw, Data: payload, Header: nats.Header{}}
			m.Header.Set(store.OutboxIDHeader, strconv.FormatInt(p.id, 10))
			err = s.nc.PublishMsg(m)
		}
		if err != nil {
			s.logger.Warn("poke gateway (the outbox relay pokes it)", "gateway_id", gw, telemetry.KeyError, err)
		}
	}
}

// GetCommand returns a command of the caller's tenant's nodes (any for
// root-admin). Errors: NotFound (command_id; another tenant's too).
func (s *commandService) GetCommand(ctx context.Context, req *connect.Request[computev1.GetCommandRequest]) (*connect.Response[computev1.GetCommandResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	c, err := store.GetCommand(ctx, s.db.Pool, p.Scope(), req.Msg.CommandId)
	if err != nil {
		return nil, mapError(notFoundOr(err, "command", req.Msg.CommandId))
	}
	return connect.NewResponse(&computev1.GetCommandResponse{Command: commandToProto(c)}), nil
}

// ListCommands lists the commands of the caller's tenant's nodes (all for
// root-admin), optionally of one node, newest first, paged by the last id.
// Errors: NotFound (node_id of another tenant or unknown).
func (s *commandService) ListCommands(ctx context.Context, req *connect.Request[computev1.ListCommandsRequest]) (*connect.Response[computev1.ListCommandsResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	if msg.NodeId != "" {
		if _, err := store.GetNode(ctx, s.db.Pool, p.Scope(), msg.NodeId); err != nil {
			return nil, mapError(notFoundOr(err, "node", msg.NodeId))
		}
	}
	size := int(msg.PageSize)
	if size == 0 {
		size = defaultCommandPageSize
	}
	cmds, err := store.ListCommands(ctx, s.db.Pool, store.CommandFilter{Scope: p.Scope(), NodeID: msg.NodeId,
		Before: msg.PageToken, Limit: size})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListCommandsResponse{Commands: make([]*computev1.Command, len(cmds))}
	for i, c := range cmds {
		res.Commands[i] = commandToProto(c)
	}
	if len(cmds) == size {
		res.NextPageToken = cmds[len(cmds)-1].ID
	}
	return connect.NewResponse(res), nil
}

func commandToProto(c store.Command) *computev1.Command {
	return &computev1.Command{
		Id:         c.ID,
		NodeId:     c.NodeID,
		Kind:       c.Kind,
		State:      c.State,
		RetrySafe:  c.RetrySafe,
		Deadline:   timestamppb.New(c.Deadline),
		ResultJson: string(c.Result),
		Error:      c.Error,
		Deliveries: c.Deliveries,
		RequestId:  c.RequestID,
		CreatedAt:  timestamppb.New(c.CreatedAt),
		UpdatedAt:  timestamppb.New(c.UpdatedAt),
		FinishedAt: timestampOrNil(c.FinishedAt),
	}
}
