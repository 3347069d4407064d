package iam_test

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/ratelimit"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	os.Exit(code)
}

func TestSecrets(t *testing.T) {
	t.Parallel()
	a, err := iam.NewSecret(iam.JoinTokenPrefix)
	require.NoError(t, err)
	b, err := iam.NewSecret(iam.JoinTokenPrefix)
	require.NoError(t, err)
	require.NotEqual(t, a, b)
	require.True(t, strings.HasPrefix(a, "bcjt_"))
	require.Len(t, a, len("bcjt_")+43) // 32 bytes, unpadded base64url
	require.Len(t, iam.HashSecret(a), 32)
	require.Equal(t, iam.HashSecret(a), iam.HashSecret(a))
}

func TestRoles(t *testing.T) {
	t.Parallel()
	// The whole role → permission table, so that a change to it is a
	// deliberate change here too.
	want := map[iam.Role][]iam.Permission{
		iam.RoleRootAdmin: {iam.PermFleetRead, iam.PermFleetManage, iam.PermSitesManage, iam.PermTenantsRead,
			iam.PermTenantsManage, iam.PermIAMManage, iam.PermAuditRead, iam.PermReservationsRead,
			iam.PermReservationsWrite, iam.PermUsageRead, iam.PermCommandsRun, iam.PermCommandsRead,
			iam.PermEventsRead, iam.PermNodesAccess},
		iam.RoleTenantAdmin: {iam.PermFleetRead, iam.PermFleetManage, iam.PermTenantsRead, iam.PermIAMManage,
			iam.PermAuditRead, iam.PermReservationsRead, iam.PermReservationsWrite, iam.PermUsageRead,
			iam.PermCommandsRun, iam.PermCommandsRead, iam.PermEventsRead, iam.PermNodesAccess},
		iam.RoleTenantMember: {iam.PermFleetRead, iam.PermTenantsRead, iam.PermReservationsRead,
			iam.PermReservationsWrite, iam.PermUsageRead, iam.PermCommandsRead, iam.PermEventsRead},
		iam.RoleViewer: {iam.PermFleetRead, iam.PermTenantsRead, iam.PermReservationsRead, iam.PermUsageRead,
			iam.PermCommandsRead, iam.PermEventsRead},
		iam.Role("nobody"): nil,
	}
	for role, perms := range want {
		for _, p := range iam.Permissions() {
			require.Equal(t, slices.Contains(perms, p), role.Grants(p), "%s %s", role, p)
		}
	}

	// A role may mint and revoke tokens no stronger than its own.
	admin := iam.Principal{TenantID: "ten_a", Role: iam.RoleTenantAdmin}
	require.False(t, admin.MayGrant(iam.RoleRootAdmin))
	for _, r := range []iam.Role{iam.RoleTenantAdmin, iam.RoleTenantMember, iam.RoleViewer} {
		require.True(t, admin.MayGrant(r), r)
	}
	require.True(t, iam.Principal{Role: iam.RoleRootAdmin}.MayGrant(iam.RoleRootAdmin))
	require.False(t, iam.Principal{Role: iam.RoleViewer}.MayGrant(iam.RoleTenantMember))
	require.False(t, iam.Principal{Role: iam.RoleRootAdmin}.MayGrant(iam.Role("god")))
	_, err := iam.ParseRole("admin")
	require.ErrorContains(t, err, "unknown role \"admin\"")
	root := iam.Principal{TenantID: "ten_a", Role: iam.RoleRootAdmin}
	viewer := iam.Principal{TenantID: "ten_a", Role: iam.RoleViewer}
	require.Equal(t, store.AllTenants, root.Scope(), "a root administrator reaches every tenant")
	require.True(t, root.Scope().Includes("ten_b"))
	require.True(t, viewer.Scope().Includes("ten_a"))
	require.False(t, viewer.Scope().Includes("ten_b"))
	require.Equal(t, "ten_a", viewer.Scope().Tenant())
	require.False(t, iam.Principal{Role: iam.RoleViewer}.Scope().Includes(""), "a principal without a tenant reaches none")
}

// tenantDB is a database on a fake clock (2030-01-02 03:04:05 UTC) holding
// one tenant, "acme".
func tenantDB(t *testing.T) (*clock.Fake, *store.DB, store.Tenant) {
	t.Helper()
	clk := clock.NewFake(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	db := storetest.New(t, clk)
	now := db.Now()
	tenant := store.Tenant{ID: ids.New(ids.Tenant, now), Name: "acme", CreatedAt: now}
	require.NoError(t, store.CreateTenant(t.Context(), db.Pool, tenant))
	return clk, db, tenant
}

func TestAuthenticate(t *testing.T) {
	t.Parallel()
	clk, db, tenant := tenantDB(t)
	ctx := t.Context()
	now := db.Now()
	good, tok, err := iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "ci", iam.RoleViewer, nil)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(good, "bct_"))
	soon := now.Add(time.Hour)
	expiring, _, err := iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "", iam.RoleTenantAdmin, &soon)
	require.NoError(t, err)
	revoked, revokedTok, err := iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "", iam.RoleTenantAdmin, nil)
	require.NoError(t, err)
	require.NoError(t, store.RevokeAPIToken(ctx, db.Pool, store.AllTenants, revokedTok.ID, now))
	_, _, err = iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "", iam.Role("god"), nil)
	require.Error(t, err)

	a := &iam.Authenticator{DB: db}
	p, err := a.Authenticate(ctx, "Bearer "+good)
	require.NoError(t, err)
	require.Equal(t, iam.Principal{TokenID: tok.ID, TenantID: tenant.ID, Role: iam.RoleViewer}, p)
	p, err = a.Authenticate(ctx, "bearer "+expiring)
	require.NoError(t, err)
	require.Equal(t, iam.RoleTenantAdmin, p.Role)

	unknown, err := iam.NewSecret(iam.APITokenPrefix)
	require.NoError(t, err)
	clk.Advance(2 * time.Hour)
	for _, tc := range []struct{ header, msg string }{
		{"", "missing bearer token"},
		{good, "authorization header must be"},
		{"Basic " + good, "authorization header must be"},
		{"Bearer nope", "api token is not valid"},
		{"Bearer bct_unknown", "api token is not valid"},
		{"Bearer " + unknown, "api token is not valid"},
		{"Bearer " + revoked, "api token was revoked"},
		{"Bearer " + expiring, "api token expired at 2030-01-02T04:04:05Z"},
	} {
		_, err := a.Authenticate(ctx, tc.header)
		require.ErrorIs(t, err, iam.ErrUnauthenticated, tc.header)
		require.ErrorContains(t, err, tc.msg)
	}
	got, err := store.GetAPITokenByHash(ctx, db.Pool, iam.HashSecret(good))
	require.NoError(t, err)
	require.NotNil(t, got.LastUsedAt, "use is recorded")
}

// TestAuthenticateCache checks the token cache: a valid token's row
// answers within CacheTTL without the database (a revocation behind the
// cache's back is not seen until the TTL passes or Invalidate), expiry is
// checked on every call, and unknown tokens are not cached.
func TestAuthenticateCache(t *testing.T) {
	t.Parallel()
	clk, db, tenant := tenantDB(t)
	ctx := t.Context()
	mint := func(expires *time.Time) (string, string) {
		t.Helper()
		secret, tok, err := iam.MintAPIToken(ctx, db.Pool, db.Now(), tenant.ID, "", iam.RoleViewer, expires)
		require.NoError(t, err)
		return "Bearer " + secret, tok.ID
	}
	// revokeBehind revokes id in the database only, as if on another server
	// whose message never arrives. Raw SQL: store.RevokeAPIToken always
	// writes the message.
	revokeBehind := func(id string) {
		t.Helper()
		_, err := db.Pool.Exec(ctx, `UPDATE api_tokens SET revoked_at = $2 WHERE id = $1`, id, db.Now())
		require.NoError(t, err)
	}
	ok := func(a *iam.Authenticator, header string) {
		t.Helper()
		_, err := a.Authenticate(ctx, header)
		require.NoError(t, err)
	}
	refused := func(a *iam.Authenticator, header, msg string) {
		t.Helper()
		_, err := a.Authenticate(ctx, header)
		require.ErrorIs(t, err, iam.ErrUnauthenticated)
		require.ErrorContains(t, err, msg)
	}

	a := iam.NewAuthenticator(db)
	require.Equal(t, iam.DefaultTokenCacheTTL, a.CacheTTL)
	good, goodID := mint(nil)
	ok(a, good)
	require.Equal(t, 1, iam.CachedTokens(a))
	revokeBehind(goodID)
	clk.Advance(a.CacheTTL - time.Microsecond)
	ok(a, good) // the cached row: no query within the TTL
	clk.Advance(time.Microsecond)
	refused(a, good, "api token was revoked")
	require.Zero(t, iam.CachedTokens(a), "revoked tokens are not cached")

	// Invalidate drops one token, or all.
	one, oneID := mint(nil)
	two, twoID := mint(nil)
	ok(a, one)
	ok(a, two)
	revokeBehind(oneID)
	revokeBehind(twoID)
	a.Invalidate(oneID)
	refused(a, one, "api token was revoked")
	ok(a, two)
	a.Invalidate("")
	require.Zero(t, iam.CachedTokens(a))
	refused(a, two, "api token was revoked")

	// Expiry is checked against the clock whatever the cache holds.
	long := iam.NewAuthenticator(db)
	long.CacheTTL = time.Hour
	exp := db.Now().Add(time.Minute)
	expiring, expiringID := mint(&exp)
	ok(long, expiring)
	revokeBehind(expiringID)
	clk.Advance(time.Minute - time.Microsecond)
	ok(long, expiring) // cached: the revocation is not seen
	clk.Advance(time.Microsecond)
	refused(long, expiring, "api token expired at 2030-01-02T03:05:06Z")

	// An unknown token's refusal is cached for RefusalCacheTTL, not its
	// row: one created behind the cache's back (with a secret chosen
	// outside MintAPIToken, which nobody could have presented before) is
	// refused until then, and works at once after Minted.
	create := func(secret string) {
		t.Helper()
		require.NoError(t, store.CreateAPIToken(ctx, db.Pool, store.APIToken{ID: ids.New(ids.APIToken, db.Now()),
			TenantID: tenant.ID, Hash: iam.HashSecret(secret), Role: string(iam.RoleViewer), CreatedAt: db.Now()}))
	}
	require.Equal(t, iam.DefaultRefusalCacheTTL, long.RefusalCacheTTL)
	secret, err := iam.NewSecret(iam.APITokenPrefix)
	require.NoError(t, err)
	before := iam.CachedTokens(long)
	refused(long, "Bearer "+secret, "api token is not valid")
	require.Equal(t, before, iam.CachedTokens(long))
	require.Equal(t, 1, iam.CachedRefusals(long))
	create(secret)
	refused(long, "Bearer "+secret, "api token is not valid") // the cached refusal: no query
	long.Minted(iam.HashSecret(secret))
	ok(long, "Bearer "+secret)
	// Without Minted, until the refusal's TTL passes.
	later, err := iam.NewSecret(iam.APITokenPrefix)
	require.NoError(t, err)
	refused(long, "Bearer "+later, "api token is not valid")
	create(later)
	clk.Advance(long.RefusalCacheTTL - time.Microsecond)
	refused(long, "Bearer "+later, "api token is not valid")
	clk.Advance(time.Microsecond)
	ok(long, "Bearer "+later)
	// A revoked token's refusal is cached too.
	gone, goneID := mint(nil)
	revokeBehind(goneID)
	refused(long, gone, "api token was revoked")
	refusedBefore := iam.CachedRefusals(long)
	refused(long, gone, "api token was revoked")
	require.Equal(t, refusedBefore, iam.CachedRefusals(long))

	// A zero TTL caches nothing.
	off := &iam.Authenticator{DB: db}
	fresh, freshID := mint(nil)
	ok(off, fresh)
	require.Zero(t, iam.CachedTokens(off))
	revokeBehind(freshID)
	refused(off, fresh, "api token was revoked")
}

// TestAuthenticateCacheTouch checks that last_used_at is still written
// about once per store.APITokenTouchInterval when the row comes from the
// cache, and not on every call.
func TestAuthenticateCacheTouch(t *testing.T) {
	t.Parallel()
	clk, db, tenant := tenantDB(t)
	ctx := t.Context()
	now := db.Now()
	secret, tok, err := iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "", iam.RoleViewer, nil)
	require.NoError(t, err)
	lastUsed := func() *time.Time {
		t.Helper()
		got, err := store.GetAPIToken(ctx, db.Pool, store.AllTenants, tok.ID)
		require.NoError(t, err)
		return got.LastUsedAt
	}
	a := iam.NewAuthenticator(db)
	a.CacheTTL = time.Hour

	_, err = a.Authenticate(ctx, "Bearer "+secret)
	require.NoError(t, err)
	require.NotNil(t, lastUsed())
	require.True(t, lastUsed().Equal(now), "the first use is written")

	// Clear it behind the cache's back (raw SQL: nothing in the store clears
	// it): a call within the interval must not write it again (a write per
	// call would).
	_, err = db.Pool.Exec(ctx, `UPDATE api_tokens SET last_used_at = NULL WHERE id = $1`, tok.ID)
	require.NoError(t, err)
	for range 3 {
		clk.Advance(store.APITokenTouchInterval / 4)
		_, err = a.Authenticate(ctx, "Bearer "+secret)
		require.NoError(t, err)
	}
	require.Nil(t, lastUsed(), "no write within the interval")

	clk.Advance(store.APITokenTouchInterval/4 + time.Microsecond)
	_, err = a.Authenticate(ctx, "Bearer "+secret)
	require.NoError(t, err)
	require.NotNil(t, lastUsed(), "written again once the interval passed, from the cache")
	require.True(t, lastUsed().Equal(db.Now()))
}

// TestAuthenticateThrottle checks that failed authentications are limited
// per source: a burst, then ThrottledError before any lookup, except for a
// token the cache holds as valid; other sources and the unlimited
// Authenticate are not affected, and the source recovers at the rate.
func TestAuthenticateThrottle(t *testing.T) {
	t.Parallel()
	clk, db, tenant := tenantDB(t)
	ctx := t.Context()
	a := iam.NewAuthenticator(db)
	a.CacheTTL = time.Hour
	a.Failures = ratelimit.New(10, 5, 0, clk)
	good, _, err := iam.MintAPIToken(ctx, db.Pool, db.Now(), tenant.ID, "", iam.RoleViewer, nil)
	require.NoError(t, err)
	other, _, err := iam.MintAPIToken(ctx, db.Pool, db.Now(), tenant.ID, "", iam.RoleViewer, nil)
	require.NoError(t, err)
	_, err = a.AuthenticateFrom(ctx, "Bearer "+good, "192.0.2.1")
	require.NoError(t, err, "cached from here on")

	for i := range 5 {
		_, err := a.AuthenticateFrom(ctx, "", "192.0.2.1")
		require.ErrorIs(t, err, iam.ErrUnauthenticated, "failure %d of the burst", i)
	}
	var terr *iam.ThrottledError
	_, err = a.AuthenticateFrom(ctx, "", "192.0.2.1")
	require.ErrorAs(t, err, &terr)
	require.Equal(t, 100*time.Millisecond, terr.RetryAfter)
	require.EqualError(t, err, "failed authentications from this address: too many; retry in 1 s")
	require.NotErrorIs(t, err, iam.ErrUnauthenticated)

	_, err = a.AuthenticateFrom(ctx, "Bearer "+good, "192.0.2.1")
	require.NoError(t, err, "a token the cache holds as valid still passes")
	_, err = a.AuthenticateFrom(ctx, "Bearer "+other, "192.0.2.1")
	require.ErrorAs(t, err, &terr, "a token not cached is not looked up for a blocked source")
	_, err = a.AuthenticateFrom(ctx, "Bearer "+other, "192.0.2.2")
	require.NoError(t, err, "another source is not blocked")
	_, err = a.Authenticate(ctx, "")
	require.ErrorIs(t, err, iam.ErrUnauthenticated, "no source: no limit")

	clk.Advance(100 * time.Millisecond)
	_, err = a.AuthenticateFrom(ctx, "", "192.0.2.1")
	require.ErrorIs(t, err, iam.ErrUnauthenticated, "one more failure after a tenth of a second")
	_, err = a.AuthenticateFrom(ctx, "", "192.0.2.1")
	require.ErrorAs(t, err, &terr)
}

// TestAuthenticateThrottleSparesKnownTokens checks that a flood of bad
// tokens from one source does not lock out a valid token from there once
// its cached row has gone stale: a token last read valid is still looked
// up for a blocked source, and passes, while unknown tokens from it are
// refused before any lookup, and a revoked one stops being spared.
func TestAuthenticateThrottleSparesKnownTokens(t *testing.T) {
	t.Parallel()
	clk, db, tenant := tenantDB(t)
	ctx := t.Context()
	a := iam.NewAuthenticator(db)
	a.CacheTTL = time.Second
	a.Failures = ratelimit.New(1, 5, 0, clock.NewFake(db.Now())) // never refills
	good, tok, err := iam.MintAPIToken(ctx, db.Pool, db.Now(), tenant.ID, "", iam.RoleViewer, nil)
	require.NoError(t, err)
	never, _, err := iam.MintAPIToken(ctx, db.Pool, db.Now(), tenant.ID, "", iam.RoleViewer, nil)
	require.NoError(t, err)
	_, err = a.AuthenticateFrom(ctx, "Bearer "+good, "192.0.2.1")
	require.NoError(t, err)

	bad := func() string {
		s, err := iam.NewSecret(iam.APITokenPrefix)
		require.NoError(t, err)
		return "Bearer " + s
	}
	for i := range 5 {
		_, err := a.AuthenticateFrom(ctx, bad(), "192.0.2.1")
		require.ErrorIs(t, err, iam.ErrUnauthenticated, "failure %d of the burst", i)
	}
	var terr *iam.ThrottledError
	_, err = a.AuthenticateFrom(ctx, bad(), "192.0.2.1")
	require.ErrorAs(t, err, &terr, "an unknown token from a blocked source is not looked up")

	clk.Advance(2 * time.Second) // the cached row of good is stale: it is read again
	for range 3 {
		p, err := a.AuthenticateFrom(ctx, "Bearer "+good, "192.0.2.1")
		require.NoError(t, err, "a token last read valid passes from a blocked source")
		require.Equal(t, tok.ID, p.TokenID)
		clk.Advance(2 * time.Second)
	}
	_, err = a.AuthenticateFrom(ctx, "Bearer "+never, "192.0.2.1")
	require.ErrorAs(t, err, &terr, "a valid token never read here is throttled with the rest")
	_, err = a.AuthenticateFrom(ctx, bad(), "192.0.2.1")
	require.ErrorAs(t, err, &terr, "still throttled after the valid calls: they spent nothing and refilled nothing")

	require.NoError(t, store.RevokeAPIToken(ctx, db.Pool, store.AllTenants, tok.ID, db.Now()))
	a.Invalidate(tok.ID)
	_, err = a.AuthenticateFrom(ctx, "Bearer "+good, "192.0.2.1")
	require.ErrorAs(t, err, &terr, "a revoked token is looked up once, refused, and throttled as a failure")
	clk.Advance(time.Minute) // past the cached refusal
	_, err = a.AuthenticateFrom(ctx, "Bearer "+good, "192.0.2.1")
	require.ErrorAs(t, err, &terr, "once refused, it is no longer spared a throttle")
	_, err = a.AuthenticateFrom(ctx, "Bearer "+good, "192.0.2.2")
	require.ErrorIs(t, err, iam.ErrUnauthenticated)
	require.ErrorContains(t, err, "revoked")
}
