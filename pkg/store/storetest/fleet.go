package storetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
	return NewFleetWith(t, db, FleetOpts{Name: name, GPUs: gpus})
}

// FleetOpts are the options of NewFleetWith.
type FleetOpts struct {
	// Name suffixes the names of the fleet's rows.
	Name string
	// GPUs are the nodes' numbers of GPUs, one node each.
	GPUs []int
	// Node, when set, changes the options of node i (NewFleet's) before
	// it is made: its state, session, cordon, ….
	Node func(i int, o *NodeOpts)
}

// NewFleetWith is NewFleet with the nodes that opts describe.
func NewFleetWith(t testing.TB, db *store.DB, opts FleetOpts) *Fleet {
	t.Helper()
	now := db.Now()
	f := &Fleet{DB: db, OwnerID: Tenant(t, db, &TenantOpts{Name: "owner-" + opts.Name}).ID,
		SiteID: Site(t, db, &SiteOpts{Name: "site-" + opts.Name}).ID}
	f.PoolID = Pool(t, db, &PoolOpts{SiteID: f.SiteID, OwnerTenantID: f.OwnerID, Name: "pool-" + opts.Name}).ID
	for i, n := range opts.GPUs {
		o := NodeOpts{ID: fmt.Sprintf("node_%s%04d", opts.Name, i), PoolID: f.PoolID, State: store.NodeAdopted,
			Reachable: true, SessionID: "ses_fleet", SpecGeneration: 1,
			Spec: `{"labels":{"better-compute.io/pool":"` + f.PoolID + `"}}`, GPUs: n, AdoptedAt: now, CreatedAt: now}
		if opts.Node != nil {
			opts.Node(i, &o)
		}
		f.Nodes = append(f.Nodes, Node(t, db, &o).ID)
	}
	return f
}

// Tenant creates a tenant and offers it the pool with quota GPUs; it returns
// the tenant id.
func (f *Fleet) Tenant(t testing.TB, name string, quota int32) string {
	t.Helper()
	id := Tenant(t, f.DB, &TenantOpts{Name: name}).ID
	Offer(t, f.DB, &OfferOpts{PoolID: f.PoolID, TenantID: id, GPUQuota: quota})
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
