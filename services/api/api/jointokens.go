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

// poolNotFound is the NotFound of pool id named by request field: the one
// answer for a pool that does not exist and for one the caller may not
// see, so that the two cannot be told apart.
func poolNotFound(field, id string) error {
	return connect.NewError(connect.CodeNotFound, errors.New(field+": pool "+id+" not found"))
}

// seenPool returns the pool with id when p sees it (store.GetPool in p's
// scope: it owns the pool or the pool is offered to its tenant). A pool p
// does not see is poolNotFound, as a missing one is.
func (s *Server) seenPool(ctx context.Context, p iam.Principal, field, id string) (store.Pool, error) {
	pool, err := store.GetPool(ctx, s.db.Pool, p.Scope(), id)
	if errors.Is(err, store.ErrNotFound) {
		return store.Pool{}, poolNotFound(field, id)
	}
	if err != nil {
		return store.Pool{}, mapError(err)
	}
	return pool, nil
}

// ownedPool returns the pool with id when p owns it (its scope includes the
// owner: any pool for root-admin), for what only a pool's owner does (what:
// "offer it"). A pool p does not see is poolNotFound; one offered to p's
// tenant that another tenant owns is PermissionDenied, since p knows it
// exists.
func (s *Server) ownedPool(ctx context.Context, p iam.Principal, field, id, what string) (store.Pool, error) {
	pool, err := s.seenPool(ctx, p, field, id)
	if err != nil {
		return store.Pool{}, err
	}
	if !p.Scope().Includes(pool.OwnerTenantID) {
		return store.Pool{}, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("%s: pool %s is offered to your tenant but owned by another: only its owner may %s", field, id, what))
	}
	return pool, nil
}

// CreateJoinToken mints a join token for a pool of the caller's tenant and
// returns its secret once. The join token gives no more than its minter
// has: a pool the minter's tenant owns (any pool for root-admin), and an
// expiry no later than the minting API token's. Errors: NotFound (pool_id:
// missing, or neither owned by nor offered to the caller's tenant),
// PermissionDenied (pool_id: offered to the caller's tenant, owned by
// another), InvalidArgument (ttl_seconds: past the minting token's expiry,
// with the most allowed).
func (s *joinTokenService) CreateJoinToken(ctx context.Context, req *connect.Request[computev1.CreateJoinTokenRequest]) (*connect.Response[computev1.CreateJoinTokenResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	if _, err := s.ownedPool(ctx, p, "pool_id", msg.PoolId, "mint its join tokens"); err != nil {
		return nil, err
	}
	now := s.db.Now()
	expires := now.Add(time.Duration(msg.TtlSeconds) * time.Second)
	// A join token never outlives the token that mints it, as an API token
	// does not (CreateToken): an expiring credential cannot leave a way in
	// behind it.
	if p.ExpiresAt != nil && expires.After(*p.ExpiresAt) {
		left := int64(p.ExpiresAt.Sub(now) / time.Second)
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(
			"ttl_seconds: a join token may not outlive the API token that mints it (yours expires at %s): ask for at most %d seconds",
			p.ExpiresAt.UTC().Format(time.RFC3339), max(left, 0)))
	}
	secret, err := iam.NewSecret(iam.JoinTokenPrefix)
	if err != nil {
		return nil, mapError(err)
	}
	jt := store.JoinToken{ID: ids.New(ids.JoinToken, now), PoolID: msg.PoolId, Hash: iam.HashSecret(secret),
		MaxUses: msg.MaxUses, ExpiresAt: expires, CreatedBy: p.TokenID, CreatedAt: now}
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		if err := store.CreateJoinToken(ctx, tx, p.Scope(), jt); err != nil {
			return notFoundOr(err, "pool_id: pool", jt.PoolID)
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
// for root-admin), optionally of one pool. Errors: NotFound (pool_id:
// missing, or neither owned by nor offered to the caller's tenant),
// PermissionDenied (pool_id: offered to the caller's tenant, owned by
// another).
func (s *joinTokenService) ListJoinTokens(ctx context.Context, req *connect.Request[computev1.ListJoinTokensRequest]) (*connect.Response[computev1.ListJoinTokensResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if req.Msg.PoolId != "" {
		if _, err := s.ownedPool(ctx, p, "pool_id", req.Msg.PoolId, "list its join tokens"); err != nil {
			return nil, err
		}
	}
	tokens, err := store.ListJoinTokens(ctx, s.db.Pool, store.JoinTokenFilter{Scope: p.Scope(), PoolID: req.Msg.PoolId})
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
	var jt store.JoinToken
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		// A join token is its pool owner's, even where the pool is
		// offered to the caller's tenant (store.GetJoinToken).
		if jt, err = store.RevokeJoinToken(ctx, tx, p.Scope(), id, s.db.Now()); err != nil {
			return notFoundOr(err, "join token", id)
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
