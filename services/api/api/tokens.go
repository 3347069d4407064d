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
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/store"
)

type tokenService struct{ *Server }

// tenantFor returns the scope of the one tenant a call that names a
// tenant_id acts in: id, or the caller's own tenant when id is empty, when
// the caller's scope includes it (p.Scope().Narrow). Another tenant, for a
// caller that is not root-admin, is NotFound like a missing one.
func (s *Server) tenantFor(ctx context.Context, q store.DBTX, p iam.Principal, id string) (store.Scope, error) {
	if id == "" {
		id = p.TenantID
	}
	scope, ok := p.Scope().Narrow(id)
	if !ok {
		return store.Scope{}, connect.NewError(connect.CodeNotFound, errors.New("tenant_id: tenant "+id+" not found"))
	}
	if _, err := store.GetTenant(ctx, q, id); errors.Is(err, store.ErrNotFound) {
		return store.Scope{}, connect.NewError(connect.CodeNotFound, errors.New("tenant_id: tenant "+id+" not found"))
	} else if err != nil {
		return store.Scope{}, err
	}
	return scope, nil
}

// CreateToken mints an API token of tenant_id (default: the caller's
// tenant) and returns its secret once; only its SHA-256 is stored. A
// tenant-admin mints tokens of its own tenant with roles tenant-admin,
// tenant-member or viewer; a root-admin mints any role for any tenant, but
// root-admin tokens only in its own (the root) tenant. Errors: NotFound
// (tenant_id), PermissionDenied (role stronger than the caller's),
// InvalidArgument (role root-admin outside the root tenant).
func (s *tokenService) CreateToken(ctx context.Context, req *connect.Request[computev1.CreateTokenRequest]) (*connect.Response[computev1.CreateTokenResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	role, err := iam.ParseRole(msg.Role)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("role: %w", err))
	}
	var (
		secret string
		tok    store.APIToken
	)
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		scope, err := s.tenantFor(ctx, tx, p, msg.TenantId)
		if err != nil {
			return err
		}
		tenant := scope.Tenant()
		if !p.MayGrant(role) {
			return connect.NewError(connect.CodePermissionDenied,
				fmt.Errorf("role: a %s may not mint %s tokens", p.Role, role))
		}
		if role == iam.RoleRootAdmin && tenant != p.TenantID {
			return connect.NewError(connect.CodeInvalidArgument,
				fmt.Errorf("role: root-admin tokens belong to the root tenant %s, not %s", p.TenantID, tenant))
		}
		now := s.db.Now()
		var expires *time.Time
		if msg.TtlSeconds > 0 {
			t := now.Add(time.Duration(msg.TtlSeconds) * time.Second)
			expires = &t
		}
		// A token never outlives the token that mints it, so an expiring
		// credential cannot be turned into a permanent one.
		if p.ExpiresAt != nil && (expires == nil || expires.After(*p.ExpiresAt)) {
			left := int64(p.ExpiresAt.Sub(now) / time.Second)
			return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf(
				"ttl_seconds: a token may not outlive the token that mints it (yours expires at %s): ask for at most %d seconds",
				p.ExpiresAt.UTC().Format(time.RFC3339), max(left, 0)))
		}
		// protovalidate refused a name of spaces only; drop those around it.
		secret, tok, err = iam.MintAPIToken(ctx, tx, now, tenant, strings.TrimSpace(msg.Name), role, expires)
		if err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, tok.ID, fmt.Sprintf("token %q of tenant %s with role %s", tok.Name, tenant, role))
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.authn.Minted(tok.Hash) // a refusal of its hash cached before goes (iam.Authenticator.Authenticate)
	s.logger.InfoContext(ctx, "api token created", "api_token.id", tok.ID, "tenant.id", tok.TenantID, "role", tok.Role)
	return connect.NewResponse(&computev1.CreateTokenResponse{Token: apiTokenToProto(tok), Secret: secret}), nil
}

// ListTokens lists the API tokens of tenant_id (default: the caller's
// tenant), revoked and expired ones included, never their secrets or
// hashes. Errors: NotFound (tenant_id of another tenant, unless root-admin).
func (s *tokenService) ListTokens(ctx context.Context, req *connect.Request[computev1.ListTokensRequest]) (*connect.Response[computev1.ListTokensResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	scope, err := s.tenantFor(ctx, s.db.Pool, p, req.Msg.TenantId)
	if err != nil {
		return nil, mapError(err)
	}
	tokens, err := store.ListAPITokens(ctx, s.db.Pool, scope)
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListTokensResponse{Tokens: make([]*computev1.ApiToken, len(tokens))}
	for i, t := range tokens {
		res.Tokens[i] = apiTokenToProto(t)
	}
	return connect.NewResponse(res), nil
}

// RevokeToken revokes an API token at once: this server refuses it from the
// next call on (its cache entry is dropped after the commit, and its open
// tunnels are authorized again, so that they close), other API servers once the revocation's outbox message reaches them over NATS, or
// after their Config.TokenCacheTTL at worst. Revoking it again changes
// nothing and returns it. Errors: NotFound (token_id: missing, or of another
// tenant), PermissionDenied (a token stronger than the caller's),
// FailedPrecondition (token_id: the last root-admin token, not counting
// those expiring within store.RootAdminExpiryMargin).
func (s *tokenService) RevokeToken(ctx context.Context, req *connect.Request[computev1.RevokeTokenRequest]) (*connect.Response[computev1.RevokeTokenResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	id := req.Msg.TokenId
	var tok store.APIToken
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		old, err := store.GetAPIToken(ctx, tx, p.Scope(), id)
		if err != nil {
			return notFoundOr(err, "api token", id)
		}
		if !p.MayGrant(iam.Role(old.Role)) {
			return connect.NewError(connect.CodePermissionDenied,
				fmt.Errorf("token_id: a %s may not revoke %s tokens", p.Role, old.Role))
		}
		detail := "revoked"
		if old.RevokedAt != nil {
			detail = "already revoked"
		} else if old.Role == string(iam.RoleRootAdmin) {
			n, err := store.CountLiveRootAdminTokens(ctx, tx, s.db.Now(), id)
			if err != nil {
				return err
			}
			if n == 0 {
				return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf(
					"token_id: %s is the last live root-admin token (tokens expiring within %s do not count); "+
						"mint another root-admin token that lasts longer before revoking it", id, store.RootAdminExpiryMargin))
			}
		}
		if err := store.RevokeAPIToken(ctx, tx, p.Scope(), id, s.db.Now()); err != nil {
			return err
		}
		if tok, err = store.GetAPIToken(ctx, tx, p.Scope(), id); err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, id, detail)
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.authn.Invalidate(id)
	s.tunnels.recheck(id) // its tunnels close now
	s.logger.InfoContext(ctx, "api token revoked", "api_token.id", tok.ID, "tenant.id", tok.TenantID)
	return connect.NewResponse(&computev1.RevokeTokenResponse{Token: apiTokenToProto(tok)}), nil
}

func apiTokenToProto(t store.APIToken) *computev1.ApiToken {
	return &computev1.ApiToken{
		Id: t.ID, TenantId: t.TenantID, Name: t.Name, Role: t.Role,
		ExpiresAt: timestampOrNil(t.ExpiresAt), RevokedAt: timestampOrNil(t.RevokedAt),
		CreatedAt: timestamppb.New(t.CreatedAt), LastUsedAt: timestampOrNil(t.LastUsedAt),
	}
}
