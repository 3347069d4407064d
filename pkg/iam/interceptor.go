package iam

import (
	"context"
	"errors"
	"fmt"
	"path"

	"connectrpc.com/connect"
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
// does re-authenticates itself (the API's events watch does). Errors:
// Unauthenticated (missing or bad token), PermissionDenied (role lacks the
// permission, or the procedure has no rule), Internal wrapping a database
// error (for the masking of service.HandlerOptions, which makes a failure
// to reach the database Unavailable).
func NewInterceptor(a *Authenticator, policy Policy) connect.Interceptor {
	return &interceptor{authn: a, policy: policy}
}

type interceptor struct {
	authn  *Authenticator
	policy Policy
}

func (i *interceptor) authorize(ctx context.Context, procedure, authorization string) (context.Context, error) {
	rule, ok := i.policy[procedure]
	if !ok {
		return nil, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("%s has no authorization rule", path.Base(procedure)))
	}
	if rule.Public {
		return ctx, nil
	}
	p, err := i.authn.Authenticate(ctx, authorization)
	if errors.Is(err, ErrUnauthenticated) {
		return nil, connect.NewError(connect.CodeUnauthenticated, err)
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("authenticate: %w", err))
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

func (i *interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		ctx, err := i.authorize(ctx, req.Spec().Procedure, req.Header().Get("Authorization"))
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
		ctx, err := i.authorize(ctx, conn.Spec().Procedure, conn.RequestHeader().Get("Authorization"))
		if err != nil {
			return err
		}
		return next(ctx, conn)
	}
}
