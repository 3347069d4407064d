package store_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// fleetFixture is a tenant, a site and a pool in a fresh database.
type fleetFixture struct {
	db     *store.DB
	tenant store.Tenant
	site   store.Site
	pool   store.Pool
}

func newFleetFixture(t *testing.T) fleetFixture {
	t.Helper()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	now := db.Now()
	f := fleetFixture{db: db}
	f.tenant = store.Tenant{ID: ids.New(ids.Tenant, now), Name: "acme", CreatedAt: now}
	require.NoError(t, store.CreateTenant(ctx, db.Pool, f.tenant))
	f.site = store.Site{ID: ids.New(ids.Site, now), Name: "dev-1", Region: "dev-1", CreatedAt: now}
	require.NoError(t, store.CreateSite(ctx, db.Pool, f.site))
	f.pool = store.Pool{ID: ids.New(ids.Pool, now), SiteID: f.site.ID, OwnerTenantID: f.tenant.ID, Name: "metal",
		Kind: "metal-host", GPUModel: "H100", ExpectGPUCount: 8, CreatedAt: now}
	require.NoError(t, store.CreatePool(ctx, db.Pool, f.pool))
	return f
}

func TestSitesAndPools(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()

	err := store.CreateSite(ctx, f.db.Pool, store.Site{ID: ids.New(ids.Site, now), Name: "dev-1", CreatedAt: now})
	require.ErrorIs(t, err, store.ErrConflict)
	require.True(t, store.IsConstraint(err, store.ConstraintSiteName), "%v", err)

	err = store.CreatePool(ctx, f.db.Pool, store.Pool{ID: ids.New(ids.Pool, now), SiteID: f.site.ID,
		OwnerTenantID: f.tenant.ID, Name: "metal", Kind: "metal-host", CreatedAt: now})
	require.True(t, store.IsConstraint(err, store.ConstraintPoolName), "%v", err)

	err = store.CreatePool(ctx, f.db.Pool, store.Pool{ID: ids.New(ids.Pool, now), SiteID: "site_missing",
		OwnerTenantID: f.tenant.ID, Name: "other", Kind: "metal-host", CreatedAt: now})
	require.ErrorIs(t, err, store.ErrNotFound)

	got, err := store.GetPool(ctx, f.db.Pool, store.AllTenants, f.pool.ID)
	require.NoError(t, err)
	require.Equal(t, "diag.nvml", got.AcceptanceCheck)
	require.Equal(t, "H100", got.GPUModel)
	require.EqualValues(t, 8, got.ExpectGPUCount)
	require.Empty(t, got.NodeCounts)

	for _, id := range []string{ids.New(ids.Node, now), ids.New(ids.Node, now)} {
		require.NoError(t, store.CreateNode(ctx, f.db.Pool, store.NewNode{ID: id, PoolID: f.pool.ID, CreatedAt: now}))
	}
	pools, err := store.ListPools(ctx, f.db.Pool, store.PoolFilter{Scope: store.TenantScope(f.tenant.ID)})
	require.NoError(t, err)
	require.Len(t, pools, 1)
	require.Equal(t, map[string]int32{store.NodeJoining: 2}, pools[0].NodeCounts)

	pools, err = store.ListPools(ctx, f.db.Pool, store.PoolFilter{Scope: store.TenantScope("ten_other")})
	require.NoError(t, err)
	require.Empty(t, pools)

	// VisibleTo: the pools a tenant owns or was offered; OfferTo: each
	// with its offer to that tenant.
	other := store.Tenant{ID: ids.New(ids.Tenant, now), Name: "other", CreatedAt: now}
	require.NoError(t, store.CreateTenant(ctx, f.db.Pool, other))
	pools, err = store.ListPools(ctx, f.db.Pool, store.PoolFilter{Scope: store.TenantScope(other.ID), OfferTo: other.ID})
	require.NoError(t, err)
	require.Empty(t, pools, "neither owned nor offered")
	_, err = store.UpsertOffer(ctx, f.db.Pool, store.AllTenants, store.Offer{PoolID: f.pool.ID, TenantID: other.ID, GPUQuota: 12, UpdatedAt: now})
	require.NoError(t, err)
	pools, err = store.ListPools(ctx, f.db.Pool, store.PoolFilter{Scope: store.TenantScope(other.ID), OfferTo: other.ID})
	require.NoError(t, err)
	require.Len(t, pools, 1)
	require.Equal(t, f.pool.ID, pools[0].ID)
	require.Equal(t, map[string]int32{store.NodeJoining: 2}, pools[0].NodeCounts)
	require.NotNil(t, pools[0].Offer)
	require.Equal(t, store.Offer{PoolID: f.pool.ID, TenantID: other.ID, GPUQuota: 12, CreatedAt: pools[0].Offer.CreatedAt,
		UpdatedAt: pools[0].Offer.UpdatedAt}, *pools[0].Offer)
	pools, err = store.ListPools(ctx, f.db.Pool, store.PoolFilter{Scope: store.TenantScope(f.tenant.ID), OfferTo: f.tenant.ID})
	require.NoError(t, err)
	require.Len(t, pools, 1, "the owner sees its pool")
	require.Nil(t, pools[0].Offer, "not offered to its owner")

	// Ensure* return the existing rows and keep their settings.
	site, err := store.EnsureSite(ctx, f.db.Pool, store.Site{ID: ids.New(ids.Site, now), Name: "dev-1", Region: "x", CreatedAt: now})
	require.NoError(t, err)
	require.Equal(t, f.site.ID, site.ID)
	require.Equal(t, "dev-1", site.Region)
	pool, err := store.EnsurePool(ctx, f.db.Pool, store.Pool{ID: ids.New(ids.Pool, now), SiteID: f.site.ID,
		OwnerTenantID: f.tenant.ID, Name: "metal", Kind: "metal-host", CreatedAt: now})
	require.NoError(t, err)
	require.Equal(t, f.pool.ID, pool.ID)
	require.Equal(t, "H100", pool.GPUModel)
	sites, err := store.ListSites(ctx, f.db.Pool)
	require.NoError(t, err)
	require.Len(t, sites, 1)

	// A revoked node is counted under "revoked", apart from its provision
	// state: it is no placeable capacity.
	revoked := storetest.Node(t, f.db, &storetest.NodeOpts{PoolID: f.pool.ID, State: store.NodeAdopted}).ID
	_, err = store.RevokeNode(ctx, f.db.Pool, store.AllTenants, now, revoked, "stolen")
	require.NoError(t, err)
	got, err = store.GetPool(ctx, f.db.Pool, store.AllTenants, f.pool.ID)
	require.NoError(t, err)
	require.Equal(t, map[string]int32{store.NodeJoining: 2, store.NodeCountRevoked: 1}, got.NodeCounts)
}

func TestTenantsAndAPITokens(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()

	again, err := store.EnsureTenant(ctx, f.db.Pool, store.Tenant{ID: ids.New(ids.Tenant, now), Name: "acme", CreatedAt: now})
	require.NoError(t, err)
	require.Equal(t, f.tenant.ID, again.ID)
	_, err = store.GetTenant(ctx, f.db.Pool, "ten_missing")
	require.ErrorIs(t, err, store.ErrNotFound)

	tok := store.APIToken{ID: ids.New(ids.APIToken, now), TenantID: f.tenant.ID, Hash: []byte("h1"), Role: "viewer", CreatedAt: now}
	require.NoError(t, store.CreateAPIToken(ctx, f.db.Pool, tok))
	require.ErrorIs(t, store.CreateAPIToken(ctx, f.db.Pool, store.APIToken{ID: ids.New(ids.APIToken, now),
		TenantID: f.tenant.ID, Hash: []byte("h1"), Role: "viewer", CreatedAt: now}), store.ErrConflict)
	require.Error(t, store.CreateAPIToken(ctx, f.db.Pool, store.APIToken{ID: ids.New(ids.APIToken, now),
		TenantID: f.tenant.ID, Hash: []byte("h2"), Role: "god", CreatedAt: now}), "the role is checked")

	got, err := store.GetAPITokenByHash(ctx, f.db.Pool, []byte("h1"))
	require.NoError(t, err)
	require.Equal(t, tok.ID, got.ID)
	require.Nil(t, got.LastUsedAt)
	require.NoError(t, store.TouchAPIToken(ctx, f.db.Pool, tok.ID, now))
	require.NoError(t, store.RevokeAPIToken(ctx, f.db.Pool, store.AllTenants, tok.ID, now))
	got, err = store.GetAPITokenByHash(ctx, f.db.Pool, []byte("h1"))
	require.NoError(t, err)
	require.NotNil(t, got.LastUsedAt)
	require.NotNil(t, got.RevokedAt)
	_, err = store.GetAPITokenByHash(ctx, f.db.Pool, []byte("nope"))
	require.ErrorIs(t, err, store.ErrNotFound)
	require.ErrorIs(t, store.RevokeAPIToken(ctx, f.db.Pool, store.AllTenants, "tok_missing", now), store.ErrNotFound)
}
