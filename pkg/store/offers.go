package store

// Offers of pools to tenants (pool_offers), each with a GPU quota that
// CreateReservation checks.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Offer is a row of pool_offers: a pool offered to a tenant with a quota.
type Offer struct {
	PoolID   string
	TenantID string
	// GPUQuota is how many GPUs the tenant may hold at once in the pool.
	GPUQuota int32
	// GPUsInUse is the sum of the GPUs of the tenant's pending, binding and
	// active reservations of the pool (filled by reads, ignored by writes).
	GPUsInUse int32
	CreatedAt time.Time
	UpdatedAt time.Time
}

// gpusInUseSQL is the GPUs of the reservations of tenant $t in pool $p that
// count against the quota: pending, binding and active ones.
const gpusInUseSQL = `(SELECT COALESCE(sum(r.gpus), 0)::int FROM reservations r
	WHERE r.tenant_id = o.tenant_id AND r.pool_id = o.pool_id AND r.state IN ('pending', 'binding', 'active'))`

const offerColumns = `o.pool_id, o.tenant_id, o.gpu_quota, ` + gpusInUseSQL + `, o.created_at, o.updated_at`

// offerColumnsNullable are offerColumns of an offer LEFT JOINed as o to
// pools p: without an offer they read as empty ids, a zero quota and the
// pool's creation time (tell the two apart with o.pool_id IS NOT NULL).
const offerColumnsNullable = `COALESCE(o.pool_id, ''), COALESCE(o.tenant_id, ''), COALESCE(o.gpu_quota, 0), ` +
	gpusInUseSQL + `, COALESCE(o.created_at, p.created_at), COALESCE(o.updated_at, p.created_at)`

func scanOffer(row pgx.Row) (Offer, error) {
	var o Offer
	err := row.Scan(offerFields(&o)...)
	return o, err
}

// offerFields are the scan destinations of offerColumns (and
// offerColumnsNullable) in o.
func offerFields(o *Offer) []any {
	return []any{&o.PoolID, &o.TenantID, &o.GPUQuota, &o.GPUsInUse, &o.CreatedAt, &o.UpdatedAt}
}

// UpsertOffer offers pool o.PoolID to tenant o.TenantID with o.GPUQuota at
// o.UpdatedAt, or changes the quota of the existing offer (which keeps its
// CreatedAt), and returns the row. Lowering a quota below the GPUs in use
// ends nothing: it only refuses new reservations. Only the pool's owner
// offers it. Errors: ErrNotFound (the pool: missing or owned outside scope;
// the tenant).
func UpsertOffer(ctx context.Context, q DBTX, scope Scope, o Offer) (Offer, error) {
	if err := checkPoolOwned(ctx, q, scope, o.PoolID); err != nil {
		return Offer{}, err
	}
	if _, err := GetTenant(ctx, q, o.TenantID); err != nil {
		return Offer{}, err
	}
	_, err := q.Exec(ctx, `INSERT INTO pool_offers (pool_id, tenant_id, gpu_quota, created_at, updated_at)
		VALUES ($1, $2, $3, $4, $4)
		ON CONFLICT (pool_id, tenant_id) DO UPDATE SET gpu_quota = EXCLUDED.gpu_quota, updated_at = EXCLUDED.updated_at`,
		o.PoolID, o.TenantID, o.GPUQuota, o.UpdatedAt)
	if err != nil {
		return Offer{}, queryErr(fmt.Sprintf("offer pool %s to %s", o.PoolID, o.TenantID), err)
	}
	return GetOffer(ctx, q, o.PoolID, o.TenantID)
}

// GetOffer returns the offer of pool to tenant. Errors: ErrNotFound.
func GetOffer(ctx context.Context, q DBTX, poolID, tenantID string) (Offer, error) {
	o, err := scanOffer(q.QueryRow(ctx, `SELECT `+offerColumns+` FROM pool_offers o
		WHERE o.pool_id = $1 AND o.tenant_id = $2`, poolID, tenantID))
	if err != nil {
		return Offer{}, queryErr(fmt.Sprintf("offer of pool %s to tenant %s", poolID, tenantID), err)
	}
	return o, nil
}

// OfferFilter narrows ListOffers; zero fields other than Scope match
// everything.
type OfferFilter struct {
	// Scope keeps the offers made to its tenants and the offers of the
	// pools they own (the zero Scope: none).
	Scope  Scope
	PoolID string
}

// ListOffers returns the offers matching f, by pool id then tenant id, with
// the GPUs in use.
func ListOffers(ctx context.Context, q DBTX, f OfferFilter) ([]Offer, error) {
	rows, err := q.Query(ctx, `SELECT `+offerColumns+` FROM pool_offers o JOIN pools p ON p.id = o.pool_id
		WHERE ($1 = '' OR o.pool_id = $1) AND ($2::text IS NULL OR o.tenant_id = $2 OR p.owner_tenant_id = $2)
		ORDER BY o.pool_id, o.tenant_id`, f.PoolID, f.Scope.arg())
	if err != nil {
		return nil, queryErr("list offers", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Offer, error) { return scanOffer(r) })
	if err != nil {
		return nil, queryErr("list offers", err)
	}
	return out, nil
}
