package iam

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/pkg/ratelimit"
)

// Rule is the authorization of one RPC.
type Rule struct {
	// Public RPCs need no token at all.
	Public bool
	// Permission is what the caller's role must grant; empty admits any
	// authenticated caller. Which tenant's resources the caller reaches is
	// Principal.Scope's to say, applied by the store's queries.
	Permission Permission
	// Mutating RPCs change state: each call, allowed or refused, writes one
	// audit row (NewAuditInterceptor, AuditInTx).
	Mutating bool
	// Target names the request field (proto name, e.g. "node_id") holding
	// the id, or for a create the name, of the resource a mutating RPC acts
	// on; the audit row of a call the handler did not record itself (a
	// refusal) takes its target from it. Empty: no target.
	Target string
}

// Policy maps Connect procedures ("/bc.compute.v1.NodeService/ListNodes") to
// their rules. A procedure missing from the policy is refused for everyone.
type Policy map[string]Rule

// NewInterceptor returns a Connect handler interceptor that authenticates
// every request with a and authorizes it by policy, and puts the Principal
// in the handler's context (PrincipalFrom) and in the call's audit record
// (so that a refusal is audited with its caller). It checks a streaming
// call once, when it opens: a long stream that must end when its token
// does re-authenticates itself (the API's events watch does). The source of
// a call, to which a.Failures applies, is its TCP peer, or with
// trustForwarded the last address of its X-Forwarded-For
// (ratelimit.Source). Errors: Unauthenticated (missing or bad token),
// ResourceExhausted with a Retry-After header (the source failed too often:
// ThrottledError, ratelimit.Error), PermissionDenied (role lacks the
// permission, or the procedure has no rule), Internal wrapping a database
// error (for the masking of service.HandlerOptions, which makes a failure
// to reach the database Unavailable).
func NewInterceptor(a *Authenticator, policy Policy, trustForwarded bool) connect.Interceptor {
	return &interceptor{authn: a, policy: policy, trustForwarded: trustForwarded}
}

type interceptor struct {
	authn          *Authenticator
	policy         Policy
	trustForwarded bool
}

func (i *interceptor) authorize(ctx context.Context, procedure string, peer connect.Peer, header http.Header) (context.Context, error) {
	rule, ok := i.policy[procedure]
	if !ok {
		return nil, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("%s has no authorization rule", path.Base(procedure)))
	}
	if rule.Public {
		return ctx, nil
	}
	p, err := i.authn.AuthenticateFrom(ctx, header.Get("Authorization"), ratelimit.Source(peer.Addr, header, i.trustForwarded))
	if err != nil {
		return nil, AuthError(err)
	}
	if rec := auditFrom(ctx); rec != nil {
		rec.setPrincipal(p)
	}
	if rule.Permission != "" && !p.Can(rule.Permission) {
		return nil, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("role %s may not call %s (needs %s)", p.Role, path.Base(procedure), rule.Permission))
	}
	return WithPrincipal(ctx, p), nil
}

// AuthError is the Connect error of a refusal of Authenticate or
// AuthenticateFrom: Unauthenticated for ErrUnauthenticated,
// ResourceExhausted with a Retry-After header for a ThrottledError
// (ratelimit.Error), Internal wrapping any other (the database's) error.
func AuthError(err error) *connect.Error {
	var terr *ThrottledError
	switch {
	case errors.As(err, &terr):
		return ratelimit.Error("failed authentications", terr.RetryAfter)
	case errors.Is(err, ErrUnauthenticated):
		return connect.NewError(connect.CodeUnauthenticated, err)
	default:
		return connect.NewError(connect.CodeInternal, fmt.Errorf("authenticate: %w", err))
	}
}

func (i *interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		ctx, err := i.authorize(ctx, req.Spec().Procedure, req.Peer(), req.Header())
		if err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (i *interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i *interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, err := i.authorize(ctx, conn.Spec().Procedure, conn.Peer(), conn.RequestHeader())
		if err != nil {
			return err
		}
		return next(ctx, conn)
	}
}
