package store_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
)

func TestUseJoinToken(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	mk := func(hash string, maxUses int32, expires time.Time) store.JoinToken {
		jt := store.JoinToken{ID: ids.New(ids.JoinToken, now), PoolID: f.pool.ID, Hash: []byte(hash),
			MaxUses: maxUses, ExpiresAt: expires, CreatedAt: now}
		require.NoError(t, store.CreateJoinToken(ctx, f.db.Pool, store.AllTenants, jt))
		return jt
	}
	ok := mk("ok", 2, now.Add(time.Hour))
	expired := mk("expired", 2, now.Add(-time.Second))
	revoked := mk("revoked", 2, now.Add(time.Hour))
	_, err := store.RevokeJoinToken(ctx, f.db.Pool, store.AllTenants, revoked.ID, now)
	require.NoError(t, err)

	got, err := store.UseJoinToken(ctx, f.db.Pool, []byte("ok"), now)
	require.NoError(t, err)
	require.Equal(t, ok.ID, got.ID)
	require.EqualValues(t, 1, got.Uses)
	got, err = store.UseJoinToken(ctx, f.db.Pool, []byte("ok"), now)
	require.NoError(t, err)
	require.EqualValues(t, 2, got.Uses)

	for _, tc := range []struct {
		hash   string
		reason error
		msg    string
	}{
		{"ok", store.ErrJoinTokenUsedUp, "join token is used up (2 of 2 uses)"},
		{"nope", store.ErrJoinTokenUnknown, "join token is not valid"},
		{"expired", store.ErrJoinTokenExpired, "join token expired at " + expired.ExpiresAt.UTC().Format(time.RFC3339)},
		{"revoked", store.ErrJoinTokenRevoked, "join token was revoked"},
	} {
		_, err := store.UseJoinToken(ctx, f.db.Pool, []byte(tc.hash), now)
		require.ErrorIs(t, err, tc.reason, tc.hash)
		require.EqualError(t, err, tc.msg)
	}
	for _, id := range []string{ok.ID, expired.ID, revoked.ID} {
		jt, err := store.GetJoinToken(ctx, f.db.Pool, store.AllTenants, id)
		require.NoError(t, err)
		if id == ok.ID {
			require.EqualValues(t, 2, jt.Uses)
		} else {
			require.Zero(t, jt.Uses, "a refusal counts nothing")
		}
	}

	// Revoking twice keeps the first time.
	later := now.Add(time.Minute)
	jt, err := store.RevokeJoinToken(ctx, f.db.Pool, store.AllTenants, revoked.ID, later)
	require.NoError(t, err)
	require.True(t, jt.RevokedAt.Equal(now), "%v", jt.RevokedAt)
	_, err = store.RevokeJoinToken(ctx, f.db.Pool, store.AllTenants, "jt_missing", now)
	require.ErrorIs(t, err, store.ErrNotFound)

	all, err := store.ListJoinTokens(ctx, f.db.Pool, store.JoinTokenFilter{Scope: store.TenantScope(f.tenant.ID)})
	require.NoError(t, err)
	require.Len(t, all, 3)
	none, err := store.ListJoinTokens(ctx, f.db.Pool, store.JoinTokenFilter{Scope: store.TenantScope("ten_other")})
	require.NoError(t, err)
	require.Empty(t, none)
	require.ErrorIs(t, store.CreateJoinToken(ctx, f.db.Pool, store.AllTenants, store.JoinToken{ID: ids.New(ids.JoinToken, now),
		PoolID: "pool_missing", Hash: []byte("x"), MaxUses: 1, ExpiresAt: later, CreatedAt: now}), store.ErrNotFound)
}

// TestUseJoinTokenRace has 20 transactions race for a token of 10 uses.
func TestUseJoinTokenRace(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	require.NoError(t, store.CreateJoinToken(ctx, f.db.Pool, store.AllTenants, store.JoinToken{ID: ids.New(ids.JoinToken, now),
		PoolID: f.pool.ID, Hash: []byte("race"), MaxUses: 10, ExpiresAt: now.Add(time.Hour), CreatedAt: now}))

	var wg sync.WaitGroup
	errs := make([]error, 20)
	for i := range errs {
		wg.Go(func() {
			errs[i] = f.db.InTx(ctx, func(tx pgx.Tx) error {
				jt, err := store.UseJoinToken(ctx, tx, []byte("race"), now)
				if err != nil {
					return err
				}
				return store.CreateNode(ctx, tx, store.NewNode{ID: ids.New(ids.Node, now), PoolID: jt.PoolID,
					JoinTokenID: jt.ID, CreatedAt: now})
			})
		})
	}
	wg.Wait()
	var okCount, usedUp int
	for _, err := range errs {
		switch {
		case err == nil:
			okCount++
		case errors.Is(err, store.ErrJoinTokenUsedUp):
			usedUp++
		default:
			t.Fatalf("unexpected error: %v", err)
		}
	}
	require.Equal(t, 10, okCount)
	require.Equal(t, 10, usedUp)
	jt, err := store.GetJoinTokenByHash(ctx, f.db.Pool, []byte("race"))
	require.NoError(t, err)
	require.EqualValues(t, 10, jt.Uses)
	nodes, err := store.ListNodes(ctx, f.db.Pool, store.NodeFilter{Scope: store.AllTenants, PoolID: f.pool.ID})
	require.NoError(t, err)
	require.Len(t, nodes, 10)
}
