package api

import (
	"context"
	"errors"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

type tenantService struct{ *Server }

// CreateTenant creates a tenant under parent_id, by default under the
// caller's tenant (a root administrator's is the root tenant). Errors:
// NotFound (parent_id), AlreadyExists (name).
func (s *tenantService) CreateTenant(ctx context.Context, req *connect.Request[computev1.CreateTenantRequest]) (*connect.Response[computev1.CreateTenantResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	parent := msg.ParentId
	if parent == "" {
		parent = p.TenantID
	}
	now := s.db.Now()
	t := store.Tenant{ID: ids.New(ids.Tenant, now), Name: msg.Name, ParentID: parent, CreatedAt: now}
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := store.GetTenant(ctx, tx, parent); errors.Is(err, store.ErrNotFound) {
			return connect.NewError(connect.CodeNotFound, errors.New("parent_id: tenant "+parent+" not found"))
		} else if err != nil {
			return err
		}
		if err := store.CreateTenant(ctx, tx, t); err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, t.ID, "tenant "+t.Name+" under "+parent)
	})
	if store.IsConstraint(err, store.ConstraintTenantName) {
		return nil, connect.NewError(connect.CodeAlreadyExists, errors.New("name: a tenant with this name already exists"))
	}
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "tenant created", "tenant.id", t.ID, "tenant.name", t.Name, "tenant.parent_id", parent)
	return connect.NewResponse(&computev1.CreateTenantResponse{Tenant: tenantToProto(t)}), nil
}

// ListTenants lists every tenant for a root administrator and the caller's
// own tenant otherwise, ordered by id.
func (s *tenantService) ListTenants(ctx context.Context, _ *connect.Request[computev1.ListTenantsRequest]) (*connect.Response[computev1.ListTenantsResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	tenants, err := store.ListTenants(ctx, s.db.Pool, store.TenantFilter{Scope: p.Scope()})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListTenantsResponse{Tenants: make([]*computev1.Tenant, len(tenants))}
	for i, t := range tenants {
		res.Tenants[i] = tenantToProto(t)
	}
	return connect.NewResponse(res), nil
}

func tenantToProto(t store.Tenant) *computev1.Tenant {
	return &computev1.Tenant{Id: t.ID, Name: t.Name, ParentId: t.ParentID, CreatedAt: timestamppb.New(t.CreatedAt)}
}
