package api

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

type poolService struct{ *Server }

// CreateSite creates a site. Sites are shared by every tenant, so only root
// administrators create them (Policy). Errors: AlreadyExists (name).
func (s *poolService) CreateSite(ctx context.Context, req *connect.Request[computev1.CreateSiteRequest]) (*connect.Response[computev1.CreateSiteResponse], error) {
	now := s.db.Now()
	site := store.Site{ID: ids.New(ids.Site, now), Name: req.Msg.Name, Region: req.Msg.Region, CreatedAt: now}
	err := s.db.InTx(ctx, func(tx pgx.Tx) error {
		if err := store.CreateSite(ctx, tx, site); err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, site.ID, "site "+site.Name)
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "site created", "site.id", site.ID, "site.name", site.Name)
	return connect.NewResponse(&computev1.CreateSiteResponse{Site: siteToProto(site)}), nil
}

// ListSites lists every site: sites are places shared by all tenants (their
// names and regions are not a tenant's secret); pools in them are scoped.
func (s *poolService) ListSites(ctx context.Context, _ *connect.Request[computev1.ListSitesRequest]) (*connect.Response[computev1.ListSitesResponse], error) {
	sites, err := store.ListSites(ctx, s.db.Pool)
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListSitesResponse{}
	for _, site := range sites {
		res.Sites = append(res.Sites, siteToProto(site))
	}
	return connect.NewResponse(res), nil
}

// CreatePool creates a pool owned by the caller's tenant. Errors: NotFound
// (site_id), AlreadyExists (name in the site).
func (s *poolService) CreatePool(ctx context.Context, req *connect.Request[computev1.CreatePoolRequest]) (*connect.Response[computev1.CreatePoolResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	now := s.db.Now()
	pool := store.Pool{
		ID: ids.New(ids.Pool, now), SiteID: msg.SiteId, OwnerTenantID: p.TenantID, Name: msg.Name, Kind: msg.Kind,
		AcceptanceCheck: msg.Acceptance.GetCheck(), GPUModel: msg.Acceptance.GetGpuModel(),
		ExpectGPUCount: msg.Acceptance.GetExpectGpuCount(), CreatedAt: now,
	}
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := store.GetSite(ctx, tx, msg.SiteId); errors.Is(err, store.ErrNotFound) {
			return connect.NewError(connect.CodeNotFound, errors.New("site_id: site "+msg.SiteId+" not found"))
		} else if err != nil {
			return err
		}
		if err := store.CreatePool(ctx, tx, pool); err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, pool.ID, "pool "+pool.Name+" in site "+pool.SiteID)
	})
	if err != nil {
		return nil, mapError(err)
	}
	pool.NodeCounts = map[string]int32{}
	s.logger.InfoContext(ctx, "pool created", "pool.id", pool.ID, "pool.name", pool.Name, "tenant.id", p.TenantID)
	return connect.NewResponse(&computev1.CreatePoolResponse{Pool: poolToProto(pool)}), nil
}

// ListPools lists the pools the caller's tenant owns and those offered to
// it (every pool for root-admin), optionally of one site, with node counts
// per provision state and the pool's offer to the caller's tenant (its
// quota and the GPUs in use) when there is one: what a tenant may reserve
// from.
func (s *poolService) ListPools(ctx context.Context, req *connect.Request[computev1.ListPoolsRequest]) (*connect.Response[computev1.ListPoolsResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	pools, err := store.ListPools(ctx, s.db.Pool, store.PoolFilter{Scope: p.Scope(), SiteID: req.Msg.SiteId,
		OfferTo: p.TenantID})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListPoolsResponse{}
	for _, pool := range pools {
		res.Pools = append(res.Pools, poolToProto(pool))
	}
	return connect.NewResponse(res), nil
}

func siteToProto(s store.Site) *computev1.Site {
	return &computev1.Site{Id: s.ID, Name: s.Name, Region: s.Region, CreatedAt: timestamppb.New(s.CreatedAt)}
}

func poolToProto(p store.Pool) *computev1.Pool {
	return &computev1.Pool{
		Id: p.ID, SiteId: p.SiteID, Name: p.Name, Kind: p.Kind, OwnerTenantId: p.OwnerTenantID,
		Acceptance: &computev1.Acceptance{Check: p.AcceptanceCheck, GpuModel: p.GPUModel, ExpectGpuCount: p.ExpectGPUCount},
		CreatedAt:  timestamppb.New(p.CreatedAt),
		NodeCounts: p.NodeCounts,
		Offer:      offerOrNil(p.Offer),
	}
}

func offerOrNil(o *store.Offer) *computev1.Offer {
	if o == nil {
		return nil
	}
	return offerToProto(*o)
}

// OfferPool offers a pool of the caller's tenant (any pool for root-admin)
// to tenant_id with a GPU quota, or changes the quota of the offer; the
// pool's owner may offer it to itself. Only root-admin offers a pool to
// another tenant: to anyone else another tenant reads exactly as one that
// does not exist (docs/architecture.md, I7), so that OfferPool does not
// tell whether a tenant id exists. Lowering a quota ends no reservation.
// Errors: NotFound (pool_id: missing, or another tenant's not offered to
// the caller's; tenant_id: missing or not the caller's tenant),
// PermissionDenied (pool_id: another tenant's pool offered to the caller's
// tenant).
func (s *poolService) OfferPool(ctx context.Context, req *connect.Request[computev1.OfferPoolRequest]) (*connect.Response[computev1.OfferPoolResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	msg := req.Msg
	if _, err := s.ownedPool(ctx, p, "pool_id", msg.PoolId, "offer it"); err != nil {
		return nil, err
	}
	var offer store.Offer
	err = s.db.InTx(ctx, func(tx pgx.Tx) error {
		notFound := connect.NewError(connect.CodeNotFound, errors.New("tenant_id: tenant "+msg.TenantId+" not found"))
		if !p.Scope().Includes(msg.TenantId) {
			return notFound
		}
		if _, err := store.GetTenant(ctx, tx, msg.TenantId); errors.Is(err, store.ErrNotFound) {
			return notFound
		} else if err != nil {
			return err
		}
		var err error
		if offer, err = store.UpsertOffer(ctx, tx, p.Scope(), store.Offer{PoolID: msg.PoolId, TenantID: msg.TenantId,
			GPUQuota: msg.GpuQuota, UpdatedAt: s.db.Now()}); err != nil {
			return err
		}
		return s.auditInTx(ctx, tx, msg.PoolId, fmt.Sprintf("offered to tenant %s with a quota of %d GPUs", msg.TenantId, msg.GpuQuota))
	})
	if err != nil {
		return nil, mapError(err)
	}
	s.logger.InfoContext(ctx, "pool offered", "pool.id", offer.PoolID, "tenant.id", offer.TenantID, "gpu_quota", offer.GPUQuota)
	return connect.NewResponse(&computev1.OfferPoolResponse{Offer: offerToProto(offer)}), nil
}

// ListOffers lists, by pool then tenant, the offers made to the caller's
// tenant and those of the pools it owns (all for root-admin), optionally of
// one pool, with the GPUs each tenant holds. A pool_id the caller neither
// owns nor was offered (or that does not exist) is NotFound.
func (s *poolService) ListOffers(ctx context.Context, req *connect.Request[computev1.ListOffersRequest]) (*connect.Response[computev1.ListOffersResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if req.Msg.PoolId != "" {
		// A pool the caller does not see reads as one that does not exist,
		// as in every other call that names a pool.
		if _, err := s.seenPool(ctx, p, "pool_id", req.Msg.PoolId); err != nil {
			return nil, err
		}
	}
	offers, err := store.ListOffers(ctx, s.db.Pool, store.OfferFilter{Scope: p.Scope(), PoolID: req.Msg.PoolId})
	if err != nil {
		return nil, mapError(err)
	}
	res := &computev1.ListOffersResponse{Offers: make([]*computev1.Offer, len(offers))}
	for i, o := range offers {
		res.Offers[i] = offerToProto(o)
	}
	return connect.NewResponse(res), nil
}

func offerToProto(o store.Offer) *computev1.Offer {
	return &computev1.Offer{PoolId: o.PoolID, TenantId: o.TenantID, GpuQuota: o.GPUQuota, GpusInUse: o.GPUsInUse,
		CreatedAt: timestamppb.New(o.CreatedAt)}
}
