package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func TestScope(t *testing.T) {
	t.Parallel()
	a := store.TenantScope("ten_a")
	for _, tc := range []struct {
		name     string
		scope    store.Scope
		includes map[string]bool
		tenant   string
		str      string
	}{
		{"one tenant", a, map[string]bool{"ten_a": true, "ten_b": false, "": false}, "ten_a", "tenant ten_a"},
		{"all tenants", store.AllTenants, map[string]bool{"ten_a": true, "ten_b": true, "": true}, "", "all tenants"},
		{"zero", store.Scope{}, map[string]bool{"ten_a": false, "": false}, "", "no tenant"},
		{"empty tenant id", store.TenantScope(""), map[string]bool{"ten_a": false, "": false}, "", "no tenant"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for id, want := range tc.includes {
				require.Equal(t, want, tc.scope.Includes(id), "Includes(%q)", id)
			}
			require.Equal(t, tc.tenant, tc.scope.Tenant())
			require.Equal(t, tc.str, tc.scope.String())
		})
	}
	narrowed, ok := store.AllTenants.Narrow("ten_b")
	require.True(t, ok)
	require.Equal(t, store.TenantScope("ten_b"), narrowed)
	_, ok = a.Narrow("ten_b")
	require.False(t, ok, "a tenant's scope does not reach another tenant")
	narrowed, ok = a.Narrow("ten_a")
	require.True(t, ok)
	require.Equal(t, a, narrowed)
}

// scopeFixture is two tenants, a and b, each owning a pool (offered to
// itself) with a node, a command, a reservation with a usage window, a join
// token, an API token, an audit row and an event; b's pool is offered to a
// too.
type scopeFixture struct {
	db   *store.DB
	a, b scopeRows
}

// scopeRows are the ids of one tenant's rows.
type scopeRows struct {
	tenant, pool, node, command, reservation, joinToken, apiToken string
	audit, event                                                  int64
}

func newScopeFixture(t *testing.T) scopeFixture {
	t.Helper()
	db := storetest.New(t, nil)
	ctx := t.Context()
	site := storetest.Site(t, db, nil)
	rows := func(name string) scopeRows {
		var r scopeRows
		r.tenant = storetest.Tenant(t, db, &storetest.TenantOpts{Name: name}).ID
		r.pool = storetest.Pool(t, db, &storetest.PoolOpts{SiteID: site.ID, OwnerTenantID: r.tenant}).ID
		storetest.Offer(t, db, &storetest.OfferOpts{PoolID: r.pool, TenantID: r.tenant, GPUQuota: 8})
		r.node = storetest.Node(t, db, &storetest.NodeOpts{PoolID: r.pool, State: store.NodeAdopted, GPUs: 1}).ID
		r.command = storetest.Command(t, db, &storetest.CommandOpts{NodeID: r.node}).ID
		r.reservation = storetest.Reservation(t, db, &storetest.ReservationOpts{TenantID: r.tenant, PoolID: r.pool}).ID
		storetest.UsageWindow(t, db, &storetest.UsageWindowOpts{ReservationID: r.reservation, TenantID: r.tenant,
			PoolID: r.pool, WindowStart: db.Now().Truncate(time.Hour), GPUSeconds: 60})
		r.joinToken = storetest.JoinToken(t, db, &storetest.JoinTokenOpts{PoolID: r.pool}).ID
		r.apiToken = storetest.APIToken(t, db, &storetest.APITokenOpts{TenantID: r.tenant}).ID
		var err error
		r.audit, err = store.InsertAudit(ctx, db.Pool, store.AuditEntry{At: db.Now(), TenantID: r.tenant, Procedure: "/p",
			Outcome: "ok"})
		require.NoError(t, err)
		r.event = storetest.Event(t, db, &storetest.EventOpts{TenantID: r.tenant})
		return r
	}
	f := scopeFixture{db: db, a: rows("a"), b: rows("b")}
	// An event of no tenant: only AllTenants receives it.
	storetest.Event(t, db, &storetest.EventOpts{NoTenant: true})
	storetest.Offer(t, db, &storetest.OfferOpts{PoolID: f.b.pool, TenantID: f.a.tenant, GPUQuota: 8})
	return f
}

// TestScopedReads checks every store read of tenant-owned rows against the
// four kinds of scope: a tenant's own rows are in its scope, another's are
// ErrNotFound (gets) or absent (lists), the zero Scope reaches nothing, and
// AllTenants everything.
func TestScopedReads(t *testing.T) {
	t.Parallel()
	f := newScopeFixture(t)
	ctx := t.Context()
	q := f.db.Pool
	// get reads the row of rs in scope, returning its id.
	gets := []struct {
		name string
		get  func(scope store.Scope, rs scopeRows) (string, error)
	}{
		{"GetNode", func(s store.Scope, rs scopeRows) (string, error) {
			n, err := store.GetNode(ctx, q, s, rs.node)
			return n.ID, err
		}},
		{"GetCommand", func(s store.Scope, rs scopeRows) (string, error) {
			c, err := store.GetCommand(ctx, q, s, rs.command)
			return c.ID, err
		}},
		{"GetReservation", func(s store.Scope, rs scopeRows) (string, error) {
			r, err := store.GetReservation(ctx, q, s, rs.reservation)
			return r.ID, err
		}},
		{"GetPool", func(s store.Scope, rs scopeRows) (string, error) {
			p, err := store.GetPool(ctx, q, s, rs.pool)
			return p.ID, err
		}},
		{"GetJoinToken", func(s store.Scope, rs scopeRows) (string, error) {
			j, err := store.GetJoinToken(ctx, q, s, rs.joinToken)
			return j.ID, err
		}},
		{"GetAPIToken", func(s store.Scope, rs scopeRows) (string, error) {
			a, err := store.GetAPIToken(ctx, q, s, rs.apiToken)
			return a.ID, err
		}},
	}
	for _, g := range gets {
		t.Run(g.name, func(t *testing.T) {
			id, err := g.get(store.TenantScope(f.a.tenant), f.a)
			require.NoError(t, err)
			require.NotEmpty(t, id)
			_, err = g.get(store.TenantScope(f.a.tenant), f.b)
			if g.name == "GetPool" {
				// b's pool is offered to a: a sees it.
				require.NoError(t, err, "a pool offered to the scope's tenant is seen")
				_, err = g.get(store.TenantScope(f.b.tenant), f.a)
			}
			require.ErrorIs(t, err, store.ErrNotFound, "another tenant's row")
			_, err = g.get(store.Scope{}, f.a)
			require.ErrorIs(t, err, store.ErrNotFound, "the zero Scope")
			_, err = g.get(store.AllTenants, f.b)
			require.NoError(t, err, "AllTenants")
		})
	}

	// list lists in scope, returning the ids (or numbers) it found.
	lists := []struct {
		name string
		list func(scope store.Scope) ([]any, error)
		// of is the value list finds for rs.
		of func(rs scopeRows) any
		// alsoOffered: the scope of a also lists b's row (offers, pools).
		alsoOffered bool
	}{
		{name: "ListNodes", of: func(rs scopeRows) any { return rs.node }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListNodes(ctx, q, store.NodeFilter{Scope: s}))(func(n store.Node) any { return n.ID })
		}},
		{name: "ListCommands", of: func(rs scopeRows) any { return rs.command }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListCommands(ctx, q, store.CommandFilter{Scope: s, Limit: 10}))(
				func(c store.Command) any { return c.ID })
		}},
		{name: "ListReservations", of: func(rs scopeRows) any { return rs.reservation }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListReservations(ctx, q, store.ReservationFilter{Scope: s}))(
				func(r store.Reservation) any { return r.ID })
		}},
		{name: "ListPools", of: func(rs scopeRows) any { return rs.pool }, alsoOffered: true, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListPools(ctx, q, store.PoolFilter{Scope: s}))(func(p store.Pool) any { return p.ID })
		}},
		{name: "ListOffers", of: func(rs scopeRows) any { return rs.pool }, alsoOffered: true, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListOffers(ctx, q, store.OfferFilter{Scope: s}))(func(o store.Offer) any { return o.PoolID })
		}},
		{name: "ListJoinTokens", of: func(rs scopeRows) any { return rs.joinToken }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListJoinTokens(ctx, q, store.JoinTokenFilter{Scope: s}))(
				func(j store.JoinToken) any { return j.ID })
		}},
		{name: "ListAPITokens", of: func(rs scopeRows) any { return rs.apiToken }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListAPITokens(ctx, q, s))(func(a store.APIToken) any { return a.ID })
		}},
		{name: "ListTenants", of: func(rs scopeRows) any { return rs.tenant }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListTenants(ctx, q, store.TenantFilter{Scope: s}))(func(x store.Tenant) any { return x.ID })
		}},
		{name: "ListAudit", of: func(rs scopeRows) any { return rs.audit }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListAudit(ctx, q, store.AuditFilter{Scope: s, Limit: 10}))(
				func(e store.AuditEntry) any { return e.ID })
		}},
		{name: "ListUsage", of: func(rs scopeRows) any { return rs.reservation }, list: func(s store.Scope) ([]any, error) {
			return collect(store.ListUsage(ctx, q, store.UsageFilter{Scope: s}))(
				func(w store.UsageWindow) any { return w.ReservationID })
		}},
		{name: "ScanEvents", of: func(rs scopeRows) any { return rs.event }, list: func(s store.Scope) ([]any, error) {
			scan, err := store.ScanEvents(ctx, q, 0, store.EventFilter{Scope: s}, 10)
			var out []any
			for _, e := range scan.Events {
				out = append(out, e.ID)
			}
			return out, err
		}},
	}
	for _, l := range lists {
		t.Run(l.name, func(t *testing.T) {
			got, err := l.list(store.TenantScope(f.a.tenant))
			require.NoError(t, err)
			require.Contains(t, got, l.of(f.a))
			if l.alsoOffered {
				require.Contains(t, got, l.of(f.b), "what is offered to the scope's tenant")
				got, err = l.list(store.TenantScope(f.b.tenant))
				require.NoError(t, err)
				require.NotContains(t, got, l.of(f.a), "b was offered nothing of a's")
			} else {
				require.NotContains(t, got, l.of(f.b), "another tenant's row")
			}
			got, err = l.list(store.Scope{})
			require.NoError(t, err)
			require.Empty(t, got, "the zero Scope lists nothing")
			got, err = l.list(store.AllTenants)
			require.NoError(t, err)
			require.Contains(t, got, l.of(f.a))
			require.Contains(t, got, l.of(f.b))
		})
	}
}

// collect turns a list's result into its values, for TestScopedReads.
func collect[T any](rows []T, err error) func(func(T) any) ([]any, error) {
	return func(value func(T) any) ([]any, error) {
		out := make([]any, len(rows))
		for i, r := range rows {
			out[i] = value(r)
		}
		return out, err
	}
}

// TestScopedWrites checks that every store change of a tenant-owned row
// refuses a row outside its scope with ErrNotFound and changes nothing,
// and changes a row inside it.
func TestScopedWrites(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// change changes rs's row in scope.
		change func(ctx context.Context, tx pgx.Tx, scope store.Scope, now time.Time, rs scopeRows) error
	}{
		{"CordonNode", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			_, err := store.CordonNode(ctx, tx, s, now, rs.node, "maintenance")
			return err
		}},
		{"UncordonNode", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			_, err := store.UncordonNode(ctx, tx, s, now, rs.node)
			return err
		}},
		{"RevokeNode", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			_, err := store.RevokeNode(ctx, tx, s, now, rs.node, "stolen")
			return err
		}},
		{"EndReservation", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			_, err := store.EndReservation(ctx, tx, nil, s, now, rs.reservation, store.ReservationReleased)
			return err
		}},
		{"RevokeJoinToken", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			_, err := store.RevokeJoinToken(ctx, tx, s, rs.joinToken, now)
			return err
		}},
		{"RevokeAPIToken", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			return store.RevokeAPIToken(ctx, tx, s, rs.apiToken, now)
		}},
		{"CreateJoinToken", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			id := "jt_" + rs.tenant + "_" + s.String()
			return store.CreateJoinToken(ctx, tx, s, store.JoinToken{ID: id, PoolID: rs.pool, Hash: []byte(id), MaxUses: 1,
				ExpiresAt: now.Add(time.Hour), CreatedAt: now})
		}},
		{"UpsertOffer", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			_, err := store.UpsertOffer(ctx, tx, s, store.Offer{PoolID: rs.pool, TenantID: rs.tenant, GPUQuota: 1, UpdatedAt: now})
			return err
		}},
		{"QueueCommands", func(ctx context.Context, tx pgx.Tx, s store.Scope, now time.Time, rs scopeRows) error {
			res, err := store.QueueCommands(ctx, tx, nil, now, []store.NewCommand{{Scope: s, ID: "cmd_" + s.String(),
				NodeID: rs.node, Kind: store.CommandDiagNVML, Deadline: now.Add(time.Minute)}})
			if err != nil {
				return err
			}
			return res[0].Err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newScopeFixture(t)
			ctx := t.Context()
			now := f.db.Now()
			// try runs change in a transaction that it rolls back, and
			// returns change's error.
			try := func(scope store.Scope, rs scopeRows) error {
				var changed error
				err := f.db.InTx(ctx, func(tx pgx.Tx) error {
					changed = tc.change(ctx, tx, scope, now, rs)
					return errRollback
				})
				require.ErrorIs(t, err, errRollback)
				return changed
			}
			require.ErrorIs(t, try(store.TenantScope(f.a.tenant), f.b), store.ErrNotFound, "another tenant's row")
			require.ErrorIs(t, try(store.Scope{}, f.a), store.ErrNotFound, "the zero Scope")
			require.NoError(t, try(store.TenantScope(f.a.tenant), f.a), "the scope's own row")
			require.NoError(t, try(store.AllTenants, f.b), "AllTenants")
		})
	}
}
