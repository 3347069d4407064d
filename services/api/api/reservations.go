package api

import (
	"context"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

// Bounds of ReserveRequest.start_time.
const (
	// startSkew is how far in the past a start_time may be (clock skew
	// between client and server); such a start means now.
	startSkew = time.Minute
	// maxStartAhead is how far in the future a reservation may start.
	maxStartAhead = 366 * 24 * time.Hour
	// defaultReservationPageSize is ListReservations' page size when the
	// request names none.
	defaultReservationPageSize = 100
)

type reservationService struct{ *Server }

// Reserve reserves gpus GPUs of one node of pool_id for duration from
// start_time (default now; a start up to a minute in the past means now,
// one further back or more than 366 days ahead is refused) for the caller's
// tenant, in one transaction with its event, the scheduler's poke and the
// audit row, all written by the one statement of store.CreateReservation. A request_id already used by the
// tenant returns that reservation unchanged. A reservation no node of the
// pool can ever hold is returned failed with the reason. Errors:
// InvalidArgument (start_time; protovalidate: gpus, duration), NotFound
// (pool_id: missing, or another tenant's pool not offered to the caller's
// tenant: the same answer, so that the pool's existence does not leak),
// PermissionDenied (a pool the caller sees, as its owner or root-admin, but
// not offered to its tenant), ResourceExhausted (the quota and the GPUs in
// use in the message).
func (s *reservationService) Reserve(ctx context.Context, req *connect.Request[computev1.ReserveRequest]) (*connect.Response[computev1.ReserveResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	now := s.db.Now()
	start := now
	if msg.StartTime != nil {
		if err := msg.StartTime.CheckValid(); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("start_time: %w", err))
		}
		st := msg.StartTime.AsTime().UTC().Truncate(time.Microsecond)
		switch {
		case st.Before(now.Add(-startSkew)):
			return nil, connect.NewError(connect.CodeInvalidArgument,
				fmt.Errorf("start_time: %s is in the past", st.Format(time.RFC3339)))
		case st.After(now.Add(maxStartAhead)):
			return nil, connect.NewError(connect.CodeInvalidArgument,
				fmt.Errorf("start_time: %s is more than 366 days ahead", st.Format(time.RFC3339)))
		case st.After(now):
			start = st
		}
	}
	end := start.Add(msg.Duration.AsDuration()).Truncate(time.Microsecond)
	audit, err := iam.DeferAudit(ctx)
	if err != nil {
		return nil, mapError(err)
	}
	n := store.NewReservation{ID: ids.New(ids.Reservation, now), TenantID: p.TenantID, PoolID: msg.PoolId,
		GPUs: msg.Gpus, StartAt: start, EndAt: end, RequestID: msg.RequestId, CreatedBy: p.TokenID,
		Audit: reserveAudit(audit, now, msg.PoolId, msg.Gpus, start, end, msg.RequestId)}
	var created store.CreatedReservation
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		created, err = store.CreateReservation(ctx, tx, now, n)
		return err
	})
	if err == nil {
		audit.Written()
	}
	var (
		nf       *store.NotOfferedError
		quota    *store.QuotaError
		conflict *store.RequestConflictError
	)
	switch {
	case errors.As(err, &conflict):
		return nil, connect.NewError(connect.CodeAlreadyExists, conflict)
	case errors.Is(err, store.ErrNotFound):
		return nil, poolNotFound("pool_id", msg.PoolId)
	case errors.As(err, &nf) && !p.Scope().Includes(nf.OwnerTenantID):
		// Another tenant's pool, not offered to this one: as if missing.
		return nil, poolNotFound("pool_id", msg.PoolId)
	case errors.As(err, &nf):
		return nil, connect.NewError(connect.CodePermissionDenied, fmt.Errorf("pool_id: %w", nf))
	case errors.As(err, &quota):
		return nil, connect.NewError(connect.CodeResourceExhausted, quota)
	case err != nil:
		return nil, mapError(err)
	}
	r := created.Reservation
	if !created.Existing {
		s.logger.InfoContext(ctx, "reservation created", "reservation.id", r.ID, "tenant.id", r.TenantID,
			"pool.id", r.PoolID, "gpus", r.GPUs, "state", r.State)
	}
	return connect.NewResponse(&computev1.ReserveResponse{Reservation: reservationToProto(r)}), nil
}

// GetReservation returns a reservation of the caller's tenant (any for
// root-admin). Errors: NotFound (missing or another tenant's).
func (s *reservationService) GetReservation(ctx context.Context, req *connect.Request[computev1.GetReservationRequest]) (*connect.Response[computev1.GetReservationResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	r, err := store.GetReservation(ctx, s.db.Pool, p.Scope(), req.Msg.ReservationId)
	if err != nil {
		return nil, mapError(notFoundOr(err, "reservation", req.Msg.ReservationId))
	}
	return connect.NewResponse(&computev1.GetReservationResponse{Reservation: reservationToProto(r)}), nil
}

// ListReservations lists the reservations of the caller's tenant (all for
// root-admin) by id, that is by creation time, optionally of one pool and
// state. Pages hold page_size rows (default 100); next_page_token is the
// last id of a full page, "" at the end. Errors: NotFound for a pool_id
// that does not exist or that the caller's tenant neither owns nor was
// offered.
func (s *reservationService) ListReservations(ctx context.Context, req *connect.Request[computev1.ListReservationsRequest]) (*connect.Response[computev1.ListReservationsResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	if msg.PoolId != "" {
		// A pool the caller does not see reads as one that does not exist,
		// as in every other call that names a pool.
		if _, err := s.seenPool(ctx, p, "pool_id", msg.PoolId); err != nil {
			return nil, err
		}
	}
	size := int(msg.PageSize)
	if size == 0 {
		size = defaultReservationPageSize
	}
	rs, err := store.ListReservations(ctx, s.db.Pool, store.ReservationFilter{Scope: p.Scope(),
		PoolID: msg.PoolId, State: msg.State, After: msg.PageToken, Limit: size})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListReservationsResponse{Reservations: make([]*computev1.Reservation, len(rs))}
	for i, r := range rs {
		res.Reservations[i] = reservationToProto(r)
	}
	if len(rs) == size {
		res.NextPageToken = rs[len(rs)-1].ID
	}
	return connect.NewResponse(res), nil
}

// ReleaseReservation ends a reservation of the caller's tenant now, in one
// transaction (store.EndReservation): its bookings end, its node's spec
// drops the allocation (signed with signedIntent) and the gateway is poked,
// a reservation.released event and the audit row are written. An ended
// reservation is returned unchanged. Errors: NotFound (missing or another
// tenant's).
func (s *reservationService) ReleaseReservation(ctx context.Context, req *connect.Request[computev1.ReleaseReservationRequest]) (*connect.Response[computev1.ReleaseReservationResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	id := req.Msg.ReservationId
	var (
		r     store.Reservation
		ended store.EndedReservation
	)
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		var err error
		if ended, err = store.EndReservation(ctx, tx, s.intent, p.Scope(), s.db.Now(), id, store.ReservationReleased); err != nil {
			return notFoundOr(err, "reservation", id)
		}
		if r, err = store.GetReservation(ctx, tx, p.Scope(), id); err != nil {
			return err
		}
		detail := "released"
		if !ended.Changed {
			detail = "already " + ended.State
		}
		return s.auditInTx(ctx, tx, id, detail)
	})
	if err != nil {
		return nil, mapError(err)
	}
	if ended.Changed {
		s.logger.InfoContext(ctx, "reservation released", "reservation.id", id, "tenant.id", r.TenantID,
			"node.id", ended.NodeID)
	}
	return connect.NewResponse(&computev1.ReleaseReservationResponse{Reservation: reservationToProto(r), AlreadyEnded: !ended.Changed}), nil
}

// reserveAudit is the audit row of a Reserve at now (its target, the
// reservation's id, is CreateReservation's to set): the detail of a
// reservation created pending or failed names its GPUs, pool, times and
// state; that of an existing one returned, the request id.
func reserveAudit(d iam.DeferredAudit, now time.Time, pool string, gpus int32, start, end time.Time, requestID string) *store.ReservationAudit {
	created := func(state string) string {
		return d.Entry(now, "", fmt.Sprintf("%d GPUs of pool %s from %s to %s: %s", gpus, pool,
			start.UTC().Format(time.RFC3339), end.UTC().Format(time.RFC3339), state)).Detail
	}
	return &store.ReservationAudit{Entry: d.Entry(now, "", ""), Pending: created(store.ReservationPending),
		Failed:   created(store.ReservationFailed),
		Existing: d.Entry(now, "", fmt.Sprintf("request_id %q: existing reservation returned", requestID)).Detail}
}

func reservationToProto(r store.Reservation) *computev1.Reservation {
	return &computev1.Reservation{
		Id: r.ID, TenantId: r.TenantID, PoolId: r.PoolID, Gpus: r.GPUs,
		StartTime: timestamppb.New(r.StartAt), EndTime: timestamppb.New(r.EndAt),
		State: r.State, Reason: r.Reason, NodeId: r.NodeID, Binding: r.Binding, DeviceIndexes: r.DeviceIndexes,
		RequestId: r.RequestID, CreatedAt: timestamppb.New(r.CreatedAt), UpdatedAt: timestamppb.New(r.UpdatedAt),
		ActiveAt: timestampOrNil(r.ActiveAt), EndedAt: timestampOrNil(r.EndedAt),
	}
}
