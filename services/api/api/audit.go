package api

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/store"
)

// defaultAuditPageSize is ListAudit's page size when the request names none.
const defaultAuditPageSize = 100

type auditService struct{ *Server }

// ListAudit lists audit rows newest first: the caller's tenant's, or every
// row for a root administrator (calls that did not authenticate write
// none). Pages hold
// page_size rows (default 100, at most 1000); next_page_token is the last
// row's id when the page is full, and 0 at the end.
func (s *auditService) ListAudit(ctx context.Context, req *connect.Request[computev1.ListAuditRequest]) (*connect.Response[computev1.ListAuditResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	size := int(req.Msg.PageSize)
	if size == 0 {
		size = defaultAuditPageSize
	}
	rows, err := store.ListAudit(ctx, s.db.Pool, store.AuditFilter{Scope: p.Scope(), Before: req.Msg.PageToken, Limit: size})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListAuditResponse{Entries: make([]*computev1.AuditEntry, len(rows))}
	for i, e := range rows {
		res.Entries[i] = &computev1.AuditEntry{Id: e.ID, At: timestamppb.New(e.At), TenantId: e.TenantID, TokenId: e.TokenID,
			Role: e.Role, Procedure: e.Procedure, Target: e.Target, Outcome: e.Outcome, Detail: e.Detail}
	}
	if len(rows) == size {
		res.NextPageToken = rows[len(rows)-1].ID
	}
	return connect.NewResponse(res), nil
}
