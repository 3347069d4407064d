package api

import (
	"context"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/ratelimit"
)

// ticketProcedures are "ticket issuance": the RPCs that hand out a
// credential to a node (a tunnel ticket, an SSH certificate), limited per
// source address by Config.TicketBurst and TicketRate.
var ticketProcedures = map[string]bool{
	computev1connect.TunnelServiceCreateTicketProcedure:        true,
	computev1connect.TunnelServiceIssueSshCertificateProcedure: true,
}

// ticketLimit returns the interceptor that limits ticketProcedures per
// source address (ratelimit.Source: the TCP peer, or X-Forwarded-For with
// Config.TrustForwardedFor): over the limit, a call is refused with
// ResourceExhausted and a Retry-After header (ratelimit.Error) before its
// handler runs. Installed after authentication, so that a refusal is
// audited with its caller.
func (s *Server) ticketLimit() connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if req.Spec().IsClient || !ticketProcedures[req.Spec().Procedure] {
				return next(ctx, req)
			}
			if ok, retry := s.tickets.Allow(ratelimit.Source(req.Peer().Addr, req.Header(), s.cfg.TrustForwardedFor)); !ok {
				return nil, ratelimit.Error("tunnel tickets and SSH certificates", retry)
			}
			return next(ctx, req)
		}
	})
}
