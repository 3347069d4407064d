package api

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Page sizes of ListNodes.
const (
	defaultNodePageSize = 500
)

type nodeService struct{ *Server }

// ListNodes lists the nodes the caller's tenant owns (all for root-admin),
// optionally of one pool, ordered by id and paged by the last id. A pool
// offered to the caller's tenant that another tenant owns lists no node
// (its nodes are its owner's). Errors: NotFound (pool_id: missing, or
// neither owned by nor offered to the caller's tenant).
func (s *nodeService) ListNodes(ctx context.Context, req *connect.Request[computev1.ListNodesRequest]) (*connect.Response[computev1.ListNodesResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	if msg.PoolId != "" {
		if _, err := s.seenPool(ctx, p, "pool_id", msg.PoolId); err != nil {
			return nil, err
		}
	}
	size := int(msg.PageSize)
	if size == 0 {
		size = defaultNodePageSize
	}
	nodes, err := store.ListNodes(ctx, s.db.Pool, store.NodeFilter{Scope: p.Scope(), PoolID: msg.PoolId,
		After: msg.PageToken, Limit: size})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListNodesResponse{Nodes: make([]*computev1.Node, len(nodes))}
	for i, n := range nodes {
		res.Nodes[i] = nodeToProto(n)
	}
	if len(nodes) == size {
		res.NextPageToken = nodes[len(nodes)-1].ID
	}
	return connect.NewResponse(res), nil
}

// GetNode returns one node of the caller's tenant (any for root-admin).
func (s *nodeService) GetNode(ctx context.Context, req *connect.Request[computev1.GetNodeRequest]) (*connect.Response[computev1.GetNodeResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	n, err := store.GetNode(ctx, s.db.Pool, p.Scope(), req.Msg.NodeId)
	if err != nil {
		return nil, notFoundOr(err, "node", req.Msg.NodeId)
	}
	return connect.NewResponse(&computev1.GetNodeResponse{Node: nodeToProto(n)}), nil
}

func nodeToProto(n store.Node) *computev1.Node {
	out := &computev1.Node{
		Id:                 n.ID,
		PoolId:             n.PoolID,
		ProvisionState:     n.ProvisionState,
		ProvisionReason:    n.ProvisionReason,
		Reachable:          n.Reachable,
		Cordoned:           n.Cordoned,
		CordonReason:       n.CordonReason,
		Hostname:           n.Hostname,
		Variant:            n.Variant,
		GatewayId:          n.GatewayID,
		LastSeen:           timestampOrNil(n.LastSeen),
		SpecGeneration:     n.SpecGeneration,
		ObservedGeneration: n.ObservedGeneration,
		CreatedAt:          timestamppb.New(n.CreatedAt),
		BootId:             n.BootID,
		RevokedAt:          timestampOrNil(n.RevokedAt),
		RevokeReason:       n.RevokeReason,
		CertNotAfter:       timestampOrNil(n.CertNotAfter),
	}
	var models []string
	for _, d := range n.Devices {
		out.Gpus = append(out.Gpus, &computev1.Gpu{Index: d.Index, Uuid: d.UUID, Model: d.Model, MemoryBytes: d.MemoryBytes})
		if !contains(models, d.Model) {
			models = append(models, d.Model)
		}
	}
	// One model in the usual case; a mixed node lists its models.
	out.GpuModel = strings.Join(models, ", ")
	return out
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func timestampOrNil(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}

// RevokeNode revokes every certificate of a node of the caller's tenant (any
// for root-admin) and the node itself, and fails the node's placed
// reservations (their bookings end now), in one transaction with its audit
// row and the poke that makes the gateway close the node's session: the node
// can no longer open a session or renew its certificate. The reason is
// trimmed of spaces (spaces only: no reason) and recorded on the node
// (revoke_reason). Revoking a revoked node changes nothing and returns it
// with already_revoked: it keeps the first revocation's time and reason (the
// audit row records the reason given again, as not applied), so a retried
// revoke succeeds. Errors: NotFound (node_id; another tenant's node too).
func (s *nodeService) RevokeNode(ctx context.Context, req *connect.Request[computev1.RevokeNodeRequest]) (*connect.Response[computev1.RevokeNodeResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	// A reason of spaces only is none.
	id, reason := req.Msg.NodeId, strings.TrimSpace(req.Msg.Reason)
	var (
		rev    store.RevokedNode
		failed []string
	)
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		now := s.db.Now()
		if rev, err = store.RevokeNode(ctx, tx, p.Scope(), now, id, reason); err != nil {
			return notFoundOr(err, "node", id)
		}
		// The node can never bind or hold GPUs again: its reservations
		// fail now, so their tenants stop being charged and get their
		// quota back.
		why := "node " + id + " was revoked"
		if rev.Reason != "" {
			why += ": " + rev.Reason
		}
		if failed, err = store.FailNodeReservations(ctx, tx, s.intent, now, id, why); err != nil {
			return err
		}
		detail := fmt.Sprintf("revoked %d certificate(s), failed %d reservation(s)", rev.CertificatesRevoked, len(failed))
		if reason != "" {
			detail += ": " + reason
		}
		if !rev.Newly {
			// The first revocation's time and reason stand.
			detail = fmt.Sprintf("already revoked at %s (reason %q)", rev.RevokedAt.UTC().Format(time.RFC3339), rev.Reason)
			if rev.CertificatesRevoked > 0 || len(failed) > 0 {
				detail += fmt.Sprintf("; revoked %d certificate(s), failed %d reservation(s)", rev.CertificatesRevoked, len(failed))
			}
			if reason != "" {
				detail += fmt.Sprintf("; the reason given now (%q) was not recorded", reason)
			}
		}
		return s.auditInTx(ctx, tx, id, detail)
	})
	if err != nil {
		return nil, mapError(err)
	}
	n, err := store.GetNode(ctx, s.db.Pool, p.Scope(), id)
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "node revoked", telemetry.KeyNodeID, id, "certificates_revoked", rev.CertificatesRevoked,
		"newly", rev.Newly, "reason", reason, "reservations_failed", len(failed))
	return connect.NewResponse(&computev1.RevokeNodeResponse{Node: nodeToProto(n), CertificatesRevoked: int32(rev.CertificatesRevoked),
		AlreadyRevoked: !rev.Newly}), nil
}

// CordonNode cordons a node of the caller's tenant (any for root-admin) with
// a reason (trimmed of spaces): the scheduler places nothing new on it, its
// reservations stay. Cordoning a cordoned node updates the reason, with a
// node.cordoned event only when the reason changes; the answer says whether
// it was cordoned already and with which reason. The change, its event and
// its audit row are one transaction. Errors: NotFound (node_id; another
// tenant's node too), FailedPrecondition (the node is revoked),
// InvalidArgument (reason: empty, spaces only, too long or with control
// characters).
func (s *nodeService) CordonNode(ctx context.Context, req *connect.Request[computev1.CordonNodeRequest]) (*connect.Response[computev1.CordonNodeResponse], error) {
	// protovalidate refused a reason of spaces only; drop those around it.
	id, reason := req.Msg.NodeId, strings.TrimSpace(req.Msg.Reason)
	var res store.CordonResult
	n, err := s.setCordon(ctx, id, func(tx pgx.Tx, scope store.Scope) (string, error) {
		var err error
		res, err = store.CordonNode(ctx, tx, scope, s.db.Now(), id, reason)
		if errors.Is(err, store.ErrNodeRevoked) {
			return "", connect.NewError(connect.CodeFailedPrecondition, err)
		}
		if !res.Changed {
			return "already cordoned: " + reason, err
		}
		return "cordoned: " + reason, err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&computev1.CordonNodeResponse{Node: nodeToProto(n), AlreadyCordoned: res.WasCordoned,
		PreviousReason: res.PreviousReason, Changed: res.Changed}), nil
}

// UncordonNode lets the scheduler place on a node of the caller's tenant
// (any for root-admin) again; uncordoning a node that is not cordoned
// changes nothing (Changed false). The change, its node.uncordoned event and its audit row
// are one transaction. Errors: NotFound (node_id; another tenant's node too).
func (s *nodeService) UncordonNode(ctx context.Context, req *connect.Request[computev1.UncordonNodeRequest]) (*connect.Response[computev1.UncordonNodeResponse], error) {
	id := req.Msg.NodeId
	var changed bool
	n, err := s.setCordon(ctx, id, func(tx pgx.Tx, scope store.Scope) (string, error) {
		var err error
		changed, err = store.UncordonNode(ctx, tx, scope, s.db.Now(), id)
		if !changed {
			return "not cordoned", err
		}
		return "uncordoned", err
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&computev1.UncordonNodeResponse{Node: nodeToProto(n), Changed: changed}), nil
}

// setCordon runs change on node id in the caller's scope (which returns the
// audit detail; a node outside the scope is ErrNotFound) with the audit row
// in one transaction, and returns the node afterwards.
func (s *nodeService) setCordon(ctx context.Context, id string, change func(tx pgx.Tx, scope store.Scope) (string, error)) (store.Node, error) {
	p, err := principal(ctx)
	if err != nil {
		return store.Node{}, err
	}
	var detail string
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		if detail, err = change(tx, p.Scope()); err != nil {
			return notFoundOr(err, "node", id)
		}
		return s.auditInTx(ctx, tx, id, detail)
	})
	if err != nil {
		return store.Node{}, mapError(err)
	}
	n, err := store.GetNode(ctx, s.db.Pool, p.Scope(), id)
	if err != nil {
		return store.Node{}, mapError(err)
	}
	s.logger.InfoContext(ctx, "node cordon changed", telemetry.KeyNodeID, id, "cordoned", n.Cordoned, "detail", detail)
	return n, nil
}
