package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// utc puts the times of rows read back (in the local zone) in UTC, so that
// they compare equal to the rows written.
func utcTenants(ts []store.Tenant) []store.Tenant {
	for i := range ts {
		ts[i].CreatedAt = ts[i].CreatedAt.UTC()
	}
	return ts
}

func utcAudit(es []store.AuditEntry) []store.AuditEntry {
	for i := range es {
		es[i].At = es[i].At.UTC()
	}
	return es
}

func TestTenantsAndTokens(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	now := db.Now()
	root := store.Tenant{ID: ids.New(ids.Tenant, now), Name: "root", CreatedAt: now}
	require.NoError(t, store.CreateTenant(ctx, db.Pool, root))
	// Ids made at the same millisecond sort in creation order only while no
	// other test makes ids in between: give each its own millisecond.
	acme := store.Tenant{ID: ids.New(ids.Tenant, now.Add(time.Millisecond)), Name: "acme", ParentID: root.ID, CreatedAt: now}
	require.NoError(t, store.CreateTenant(ctx, db.Pool, acme))
	other := store.Tenant{ID: ids.New(ids.Tenant, now.Add(2*time.Millisecond)), Name: "other", ParentID: root.ID, CreatedAt: now}
	require.NoError(t, store.CreateTenant(ctx, db.Pool, other))

	err := store.CreateTenant(ctx, db.Pool, store.Tenant{ID: ids.New(ids.Tenant, now), Name: "acme", CreatedAt: now})
	require.True(t, store.IsConstraint(err, store.ConstraintTenantName), "%v", err)

	listTenants := func(ctx context.Context, q store.DBTX, f store.TenantFilter) ([]store.Tenant, error) {
		ts, err := store.ListTenants(ctx, q, f)
		return utcTenants(ts), err
	}
	all, err := listTenants(ctx, db.Pool, store.TenantFilter{Scope: store.AllTenants})
	require.NoError(t, err)
	require.Equal(t, []store.Tenant{root, acme, other}, all, "ordered by id, parents kept")
	one, err := listTenants(ctx, db.Pool, store.TenantFilter{Scope: store.TenantScope(acme.ID)})
	require.NoError(t, err)
	require.Equal(t, []store.Tenant{acme}, one)
	children, err := listTenants(ctx, db.Pool, store.TenantFilter{Scope: store.AllTenants, ParentID: root.ID})
	require.NoError(t, err)
	require.Equal(t, []store.Tenant{acme, other}, children)
	none, err := store.ListTenants(ctx, db.Pool, store.TenantFilter{Scope: store.TenantScope("ten_missing")})
	require.NoError(t, err)
	require.Empty(t, none)

	mk := func(tenant, name string, at time.Time) store.APIToken {
		tok := store.APIToken{ID: ids.New(ids.APIToken, at), TenantID: tenant, Name: name, Hash: []byte(name),
			Role: "viewer", CreatedAt: at}
		require.NoError(t, store.CreateAPIToken(ctx, db.Pool, tok))
		return tok
	}
	a1 := mk(acme.ID, "a1", now)
	a2 := mk(acme.ID, "a2", now.Add(time.Second))
	o1 := mk(other.ID, "o1", now)

	tokenIDs := func(toks []store.APIToken) []string {
		var out []string
		for _, t := range toks {
			out = append(out, t.ID)
		}
		return out
	}
	got, err := store.ListAPITokens(ctx, db.Pool, store.TenantScope(acme.ID))
	require.NoError(t, err)
	require.Equal(t, []string{a1.ID, a2.ID}, tokenIDs(got), "one tenant's, oldest first")
	got, err = store.ListAPITokens(ctx, db.Pool, store.AllTenants)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{a1.ID, a2.ID, o1.ID}, tokenIDs(got))

	require.NoError(t, store.RevokeAPIToken(ctx, db.Pool, store.AllTenants, a1.ID, now.Add(time.Minute)))
	require.NoError(t, store.RevokeAPIToken(ctx, db.Pool, store.AllTenants, a1.ID, now.Add(time.Hour)))
	tok, err := store.GetAPIToken(ctx, db.Pool, store.AllTenants, a1.ID)
	require.NoError(t, err)
	require.True(t, tok.RevokedAt.Equal(now.Add(time.Minute)), "the first revocation time is kept")
	require.Equal(t, []byte("a1"), tok.Hash)
	rows, err := db.Pool.Query(ctx, `SELECT payload FROM outbox WHERE subject = $1 ORDER BY id`, store.SubjectAPITokenRevoked)
	require.NoError(t, err)
	payloads, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	require.NoError(t, err)
	want := []byte(`{"tokenId":"` + a1.ID + `"}`)
	require.Equal(t, [][]byte{want, want}, payloads, "each revocation tells the API servers, in its statement")
	require.ErrorIs(t, store.RevokeAPIToken(ctx, db.Pool, store.AllTenants, "tok_missing", now), store.ErrNotFound)
	_, err = store.GetAPIToken(ctx, db.Pool, store.AllTenants, "tok_missing")
	require.ErrorIs(t, err, store.ErrNotFound)
}

func TestAudit(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	now := db.Now()

	var want []store.AuditEntry
	for i, tenant := range []string{"ten_a", "ten_b", "", "ten_a", "ten_a"} {
		e := store.AuditEntry{At: now.Add(time.Duration(i) * time.Second), TenantID: tenant, Procedure: "/p/Q",
			Target: "x", Outcome: "ok", Detail: "d"}
		if tenant != "" {
			e.TokenID, e.Role = "tok_"+tenant, "viewer"
		} else {
			e.Outcome = "unauthenticated"
		}
		id, err := store.InsertAudit(ctx, db.Pool, e)
		require.NoError(t, err)
		e.ID = id
		want = append(want, e)
	}
	require.Less(t, want[0].ID, want[1].ID)

	all, err := store.ListAudit(ctx, db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 10})
	require.NoError(t, err)
	require.Len(t, all, 5)
	utcAudit(all)
	require.Equal(t, want[4], all[0], "newest first, every column round-trips")
	require.Equal(t, want[2], all[2], "an unauthenticated row has no tenant or token")

	// ten_a's rows, two per page.
	page, err := store.ListAudit(ctx, db.Pool, store.AuditFilter{Scope: store.TenantScope("ten_a"), Limit: 2})
	require.NoError(t, err)
	require.Equal(t, []store.AuditEntry{want[4], want[3]}, utcAudit(page))
	page, err = store.ListAudit(ctx, db.Pool, store.AuditFilter{Scope: store.TenantScope("ten_a"), Before: page[1].ID, Limit: 2})
	require.NoError(t, err)
	require.Equal(t, []store.AuditEntry{want[0]}, utcAudit(page))

	// A row written in a transaction that rolls back is gone with it.
	err = db.InTx(ctx, func(tx pgx.Tx) error {
		if _, err := store.InsertAudit(ctx, tx, store.AuditEntry{At: now, Procedure: "/p/Q", Outcome: "ok"}); err != nil {
			return err
		}
		return store.ErrStale
	})
	require.ErrorIs(t, err, store.ErrStale)
	all, err = store.ListAudit(ctx, db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 10})
	require.NoError(t, err)
	require.Len(t, all, 5)

	_, err = store.InsertAudit(ctx, db.Pool, store.AuditEntry{At: now, Procedure: "/p/Q"})
	require.Error(t, err, "an outcome is required")
}
