package storetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

// Fleet is a pool of adopted nodes written straight into a test database,
// for tests of placement, binding, expiry and usage that need no daemons.
type Fleet struct {
	DB      *store.DB
	OwnerID string
	SiteID  string
	PoolID  string
	// Nodes are the node ids, ascending.
	Nodes []string
}

// NewFleet creates a tenant owning a site and a pool with len(gpus) adopted,
// reachable (with a session), uncordoned nodes; node i has gpus[i] healthy GPUs (indexes 0…)
// and spec generation 1 with no allocations. Names are suffixed with name so
// several fleets can share a database.
func NewFleet(t testing.TB, db *store.DB, name string, gpus ...int) *Fleet {
	t.Helper()
	ctx := context.Background()
	now := db.Now()
	f := &Fleet{DB: db, OwnerID: ids.New(ids.Tenant, now), SiteID: ids.New(ids.Site, now), PoolID: ids.New(ids.Pool, now)}
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := db.Pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	exec(`INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3)`, f.OwnerID, "owner-"+name, now)
	exec(`INSERT INTO sites (id, name, created_at) VALUES ($1, $2, $3)`, f.SiteID, "site-"+name, now)
	exec(`INSERT INTO pools (id, site_id, owner_tenant_id, name, kind, created_at) VALUES ($1, $2, $3, $4, 'metal-host', $5)`,
		f.PoolID, f.SiteID, f.OwnerID, "pool-"+name, now)
	for i, n := range gpus {
		id := fmt.Sprintf("node_%s%04d", name, i)
		exec(`INSERT INTO nodes (id, pool_id, provision_state, reachable, session_id, spec_generation, spec, created_at, updated_at, adopted_at)
			VALUES ($1, $2, 'adopted', true, 'ses_fleet', 1, '{"labels":{"better-compute.io/pool":"`+f.PoolID+`"}}', $3, $3, $3)`, id, f.PoolID, now)
		for d := range n {
			exec(`INSERT INTO node_devices (node_id, device_index, uuid, model) VALUES ($1, $2, $3, 'NVIDIA H100 80GB HBM3')`,
				id, d, fmt.Sprintf("GPU-%s-%d", id, d))
		}
		f.Nodes = append(f.Nodes, id)
	}
	return f
}

// Tenant creates a tenant and offers it the pool with quota GPUs; it returns
// the tenant id.
func (f *Fleet) Tenant(t testing.TB, name string, quota int32) string {
	t.Helper()
	ctx := context.Background()
	now := f.DB.Now()
	id := ids.New(ids.Tenant, now)
	_, err := f.DB.Pool.Exec(ctx, `INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3)`, id, name, now)
	require.NoError(t, err)
	_, err = store.UpsertOffer(ctx, f.DB.Pool, store.Offer{PoolID: f.PoolID, TenantID: id, GPUQuota: quota, CreatedAt: now, UpdatedAt: now})
	require.NoError(t, err)
	return id
}

// Reserve creates a reservation of tenant for gpus GPUs over [now, now+d)
// through store.CreateReservation (quota, events, a scheduler poke) and
// returns it. Errors: those of CreateReservation (ErrQuotaExceeded, …).
func (f *Fleet) Reserve(ctx context.Context, tenant string, gpus int32, d time.Duration) (store.Reservation, error) {
	var out store.CreatedReservation
	err := f.DB.InTx(ctx, func(tx pgx.Tx) error {
		now := f.DB.Now()
		var err error
		out, err = store.CreateReservation(ctx, tx, now, store.NewReservation{
			ID: ids.New(ids.Reservation, now), TenantID: tenant, PoolID: f.PoolID, GPUs: gpus,
			StartAt: now, EndAt: now.Add(d),
		})
		return err
	})
	return out.Reservation, err
}
