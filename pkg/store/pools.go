package store

// Sites and the pools of machines in them, each owned by a tenant with the
// acceptance its machines must pass.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Site is a row of sites: a place (region) where pools of machines live.
type Site struct {
	ID        string
	Name      string
	Region    string
	CreatedAt time.Time
}

// Constraint names of sites and pools, for IsConstraint.
const (
	// ConstraintSiteName makes site names unique.
	ConstraintSiteName = "sites_name_key"
	// ConstraintPoolName makes pool names unique among one tenant's pools of a site.
	ConstraintPoolName = "pools_site_owner_name_key"
)

const siteColumns = `id, name, region, created_at`

func scanSite(row pgx.Row) (Site, error) {
	var s Site
	err := row.Scan(&s.ID, &s.Name, &s.Region, &s.CreatedAt)
	return s, err
}

// CreateSite inserts s. Errors: ErrConflict (ConstraintSiteName) when the
// name is taken.
func CreateSite(ctx context.Context, q DBTX, s Site) error {
	_, err := q.Exec(ctx, `INSERT INTO sites (id, name, region, created_at) VALUES ($1, $2, $3, $4)`,
		s.ID, s.Name, s.Region, s.CreatedAt)
	if err != nil {
		return queryErr(fmt.Sprintf("create site %q", s.Name), err)
	}
	return nil
}

// EnsureSite returns the site named s.Name, inserting s first when there is
// none. An existing site keeps its region.
func EnsureSite(ctx context.Context, q DBTX, s Site) (Site, error) {
	_, err := q.Exec(ctx, `INSERT INTO sites (id, name, region, created_at) VALUES ($1, $2, $3, $4)
		ON CONFLICT (name) DO NOTHING`, s.ID, s.Name, s.Region, s.CreatedAt)
	if err != nil {
		return Site{}, queryErr(fmt.Sprintf("ensure site %q", s.Name), err)
	}
	return GetSiteByName(ctx, q, s.Name)
}

// GetSite returns the site with id. Errors: ErrNotFound.
func GetSite(ctx context.Context, q DBTX, id string) (Site, error) {
	s, err := scanSite(q.QueryRow(ctx, `SELECT `+siteColumns+` FROM sites WHERE id = $1`, id))
	if err != nil {
		return Site{}, queryErr(fmt.Sprintf("site %s", id), err)
	}
	return s, nil
}

// GetSiteByName returns the site named name. Errors: ErrNotFound.
func GetSiteByName(ctx context.Context, q DBTX, name string) (Site, error) {
	s, err := scanSite(q.QueryRow(ctx, `SELECT `+siteColumns+` FROM sites WHERE name = $1`, name))
	if err != nil {
		return Site{}, queryErr(fmt.Sprintf("site %q", name), err)
	}
	return s, nil
}

// ListSites returns every site ordered by name.
func ListSites(ctx context.Context, q DBTX) ([]Site, error) {
	rows, err := q.Query(ctx, `SELECT `+siteColumns+` FROM sites ORDER BY name`)
	if err != nil {
		return nil, queryErr("list sites", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Site, error) { return scanSite(r) })
	if err != nil {
		return nil, queryErr("list sites", err)
	}
	return out, nil
}

// Pool is a row of pools: machines of one kind in one site, owned by a
// tenant, with the acceptance a machine must pass to be adopted.
type Pool struct {
	ID            string
	SiteID        string
	OwnerTenantID string
	Name          string
	// Kind is "metal-host".
	Kind string
	// AcceptanceCheck is the acceptance command kind, "diag.nvml".
	AcceptanceCheck string
	// GPUModel, when non-empty, must be a case-insensitive substring of
	// every GPU's model.
	GPUModel string
	// ExpectGPUCount, when positive, is the exact number of GPUs required.
	ExpectGPUCount int32
	CreatedAt      time.Time
	// NodeCounts is the number of nodes per provision state, except that
	// revoked nodes are counted under NodeCountRevoked whatever their
	// provision state (they are no placeable capacity); filled by ListPools
	// and GetPool only.
	NodeCounts map[string]int32
	// Offer is the pool's offer to PoolFilter.OfferTo, nil when there is
	// none; filled by ListPools only.
	Offer *Offer
}

// NodeCountRevoked is the key of Pool.NodeCounts under which revoked nodes
// are counted, apart from the provision states.
const NodeCountRevoked = "revoked"

const poolColumns = `p.id, p.site_id, p.owner_tenant_id, p.name, p.kind, p.acceptance_check, p.gpu_model,
	p.expect_gpu_count, p.created_at,
	(SELECT COALESCE(jsonb_object_agg(s.provision_state, s.n), '{}'::jsonb) FROM
		(SELECT CASE WHEN revoked_at IS NOT NULL THEN '` + NodeCountRevoked + `' ELSE provision_state END AS provision_state,
			count(*)::int AS n FROM nodes WHERE pool_id = p.id GROUP BY 1) s)`

func scanPool(row pgx.Row) (Pool, error) {
	var p Pool
	err := row.Scan(poolFields(&p)...)
	return p, err
}

// poolFields are the scan destinations of poolColumns in p.
func poolFields(p *Pool) []any {
	return []any{&p.ID, &p.SiteID, &p.OwnerTenantID, &p.Name, &p.Kind, &p.AcceptanceCheck, &p.GPUModel,
		&p.ExpectGPUCount, &p.CreatedAt, &p.NodeCounts}
}

// CreatePool inserts p (AcceptanceCheck defaults to "diag.nvml"). Errors:
// ErrNotFound when the site or owner tenant does not exist, ErrConflict
// (ConstraintPoolName) when the owner tenant already has the name in the site.
func CreatePool(ctx context.Context, q DBTX, p Pool) error {
	if p.AcceptanceCheck == "" {
		p.AcceptanceCheck = "diag.nvml"
	}
	if _, err := GetSite(ctx, q, p.SiteID); err != nil {
		return err
	}
	if _, err := GetTenant(ctx, q, p.OwnerTenantID); err != nil {
		return err
	}
	_, err := q.Exec(ctx, `INSERT INTO pools (id, site_id, owner_tenant_id, name, kind, acceptance_check, gpu_model,
		expect_gpu_count, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		p.ID, p.SiteID, p.OwnerTenantID, p.Name, p.Kind, p.AcceptanceCheck, p.GPUModel, p.ExpectGPUCount, p.CreatedAt)
	if err != nil {
		return queryErr(fmt.Sprintf("create pool %q", p.Name), err)
	}
	return nil
}

// EnsurePool returns the pool of tenant p.OwnerTenantID named p.Name in site
// p.SiteID, inserting p first when there is none. An existing pool keeps its settings.
func EnsurePool(ctx context.Context, q DBTX, p Pool) (Pool, error) {
	if p.AcceptanceCheck == "" {
		p.AcceptanceCheck = "diag.nvml"
	}
	_, err := q.Exec(ctx, `INSERT INTO pools (id, site_id, owner_tenant_id, name, kind, acceptance_check, gpu_model,
		expect_gpu_count, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
		ON CONFLICT (site_id, owner_tenant_id, name) DO NOTHING`,
		p.ID, p.SiteID, p.OwnerTenantID, p.Name, p.Kind, p.AcceptanceCheck, p.GPUModel, p.ExpectGPUCount, p.CreatedAt)
	if err != nil {
		return Pool{}, queryErr(fmt.Sprintf("ensure pool %q", p.Name), err)
	}
	out, err := scanPool(q.QueryRow(ctx, `SELECT `+poolColumns+` FROM pools p
		WHERE p.site_id = $1 AND p.owner_tenant_id = $2 AND p.name = $3`, p.SiteID, p.OwnerTenantID, p.Name))
	if err != nil {
		return Pool{}, queryErr(fmt.Sprintf("pool %q", p.Name), err)
	}
	return out, nil
}

// GetPool returns the pool with id when scope sees it: when scope includes
// its owner or the pool is offered to scope's tenant (AllTenants sees every
// pool). Whether scope owns it is scope.Includes(pool.OwnerTenantID).
// Errors: ErrNotFound (missing, or not seen by scope).
func GetPool(ctx context.Context, q DBTX, scope Scope, id string) (Pool, error) {
	p, err := scanPool(q.QueryRow(ctx, `SELECT `+poolColumns+` FROM pools p WHERE p.id = $1 AND `+poolSeenSQL("$2"),
		id, scope.arg()))
	if err != nil {
		return Pool{}, queryErr(fmt.Sprintf("pool %s", id), err)
	}
	return p, nil
}

// poolSeenSQL is the condition that scope parameter arg (Scope.arg) sees
// pool p: it includes the pool's owner, or the pool is offered to its
// tenant.
func poolSeenSQL(arg string) string {
	return `(` + arg + `::text IS NULL OR p.owner_tenant_id = ` + arg + `
		OR EXISTS (SELECT 1 FROM pool_offers v WHERE v.pool_id = p.id AND v.tenant_id = ` + arg + `))`
}

// checkPoolOwned returns nil when pool id exists and scope includes its
// owner, for what only a pool's owner does (offer it, mint its join tokens).
// Errors: ErrNotFound (missing, or owned outside scope).
func checkPoolOwned(ctx context.Context, q DBTX, scope Scope, id string) error {
	var owner string
	if err := q.QueryRow(ctx, `SELECT owner_tenant_id FROM pools WHERE id = $1`, id).Scan(&owner); err != nil {
		return queryErr(fmt.Sprintf("pool %s", id), err)
	}
	if !scope.Includes(owner) {
		return fmt.Errorf("pool %s: %w", id, ErrNotFound)
	}
	return nil
}

// PoolFilter narrows ListPools; zero fields other than Scope match
// everything.
type PoolFilter struct {
	// Scope keeps the pools it sees (GetPool says which; the zero Scope:
	// none).
	Scope  Scope
	SiteID string
	// OfferTo fills each pool's Offer with its offer to this tenant ("":
	// none is filled).
	OfferTo string
}

// ListPools returns the pools matching f ordered by id, with node counts and
// their offers to f.OfferTo.
func ListPools(ctx context.Context, q DBTX, f PoolFilter) ([]Pool, error) {
	rows, err := q.Query(ctx, `SELECT `+poolColumns+`, o.pool_id IS NOT NULL, `+offerColumnsNullable+`
		FROM pools p LEFT JOIN pool_offers o ON o.pool_id = p.id AND o.tenant_id = $3
		WHERE ($1 = '' OR p.site_id = $1) AND `+poolSeenSQL("$2")+`
		ORDER BY p.id`,
		f.SiteID, f.Scope.arg(), f.OfferTo)
	if err != nil {
		return nil, queryErr("list pools", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Pool, error) {
		var (
			p       Pool
			o       Offer
			offered bool
		)
		dest := append(append(poolFields(&p), &offered), offerFields(&o)...)
		if err := r.Scan(dest...); err != nil {
			return Pool{}, err
		}
		if offered {
			p.Offer = &o
		}
		return p, nil
	})
	if err != nil {
		return nil, queryErr("list pools", err)
	}
	return out, nil
}
