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

type joinTokenService struct{ *Server }

// visiblePool returns the pool with id when p may touch it, and NotFound
// otherwise (a foreign pool is not told apart from a missing one).
func (s *Server) visiblePool(ctx context.Context, p iam.Principal, field, id string) (store.Pool, error) {
	pool, err := store.GetPool(ctx, s.db.Pool, id)
	if errors.Is(err, store.ErrNotFound) || (err == nil && !p.InTenant(pool.OwnerTenantID)) {
		return store.Pool{}, connect.NewError(connect.CodeNotFound, errors.New(field+": pool "+id+" not found"))
	}
	if err != nil {
		return store.Pool{}, mapError(err)
	}
	return pool, nil
}

// CreateJoinToken mints a join token for a pool of the caller's tenant and
// returns its secret once. Errors: NotFound (pool_id).
func (s *joinTokenService) CreateJoinToken(ctx context.Context, req *connect.Request[computev1.CreateJoinTokenRequest]) (*connect.Response[computev1.CreateJoinTokenResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	if _, err := s.visiblePool(ctx, p, "pool_id", msg.PoolId); err != nil {
		return nil, err
	}
	secret, err := iam.NewSecret(iam.JoinTokenPrefix)
	if err != nil {
		return nil, mapError(err)
	}
	now := s.db.Now()
	jt := store.JoinToken{ID: ids.New(ids.JoinToken, now), PoolID: msg.PoolId, Hash: iam.HashSecret(secret),
		MaxUses: msg.MaxUses, ExpiresAt: now.Add(time.Duration(msg.TtlSeconds) * time.Second), CreatedBy: p.TokenID,
		CreatedAt: now}
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		if err := store.CreateJoinToken(ctx, tx, jt); err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, jt.ID, fmt.Sprintf("join token for pool %s, %d use(s)", jt.PoolID, jt.MaxUses))
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "join token created", "join_token.id", jt.ID, "pool.id", jt.PoolID, "max_uses", jt.MaxUses)
	return connect.NewResponse(&computev1.CreateJoinTokenResponse{JoinToken: joinTokenToProto(jt), Secret: secret}), nil
}

// ListJoinTokens lists the join tokens of the caller's tenant's pools (all
// for root-admin), optionally of one pool. Errors: NotFound (pool_id).
func (s *joinTokenService) ListJoinTokens(ctx context.Context, req *connect.Request[computev1.ListJoinTokensRequest]) (*connect.Response[computev1.ListJoinTokensResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if req.Msg.PoolId != "" {
		if _, err := s.visiblePool(ctx, p, "pool_id", req.Msg.PoolId); err != nil {
			return nil, err
		}
	}
	tokens, err := store.ListJoinTokens(ctx, s.db.Pool, store.JoinTokenFilter{PoolID: req.Msg.PoolId, OwnerTenantID: p.TenantScope()})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListJoinTokensResponse{}
	for _, jt := range tokens {
		res.JoinTokens = append(res.JoinTokens, joinTokenToProto(jt))
	}
	return connect.NewResponse(res), nil
}

// RevokeJoinToken revokes a join token; revoking it again is a no-op that
// returns it. Errors: NotFound (join_token_id).
func (s *joinTokenService) RevokeJoinToken(ctx context.Context, req *connect.Request[computev1.RevokeJoinTokenRequest]) (*connect.Response[computev1.RevokeJoinTokenResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	id := req.Msg.JoinTokenId
	jt, err := store.GetJoinToken(ctx, s.db.Pool, id)
	if errors.Is(err, store.ErrNotFound) {
		return nil, notFound("join token", id)
	}
	if err != nil {
		return nil, mapError(err)
	}
	if _, err := s.visiblePool(ctx, p, "pool_id", jt.PoolID); err != nil {
		return nil, notFound("join token", id)
	}
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		if jt, err = store.RevokeJoinToken(ctx, tx, id, s.db.Now()); err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, id, "revoked")
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "join token revoked", "join_token.id", jt.ID, "pool.id", jt.PoolID)
	return connect.NewResponse(&computev1.RevokeJoinTokenResponse{JoinToken: joinTokenToProto(jt)}), nil
}

func joinTokenToProto(jt store.JoinToken) *computev1.JoinToken {
	return &computev1.JoinToken{
		Id: jt.ID, PoolId: jt.PoolID, MaxUses: jt.MaxUses, Uses: jt.Uses,
		ExpiresAt: timestamppb.New(jt.ExpiresAt), RevokedAt: timestampOrNil(jt.RevokedAt),
		CreatedAt: timestamppb.New(jt.CreatedAt),
	}
}
