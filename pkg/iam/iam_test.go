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
			iam.PermEventsRead},
		iam.RoleTenantAdmin: {iam.PermFleetRead, iam.PermFleetManage, iam.PermTenantsRead, iam.PermIAMManage,
			iam.PermAuditRead, iam.PermReservationsRead, iam.PermReservationsWrite, iam.PermUsageRead,
			iam.PermCommandsRun, iam.PermCommandsRead, iam.PermEventsRead},
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
	require.True(t, root.InTenant("ten_b"))
	require.Empty(t, root.TenantScope())
	require.True(t, viewer.InTenant("ten_a"))
	require.False(t, viewer.InTenant("ten_b"))
	require.Equal(t, "ten_a", viewer.TenantScope())
}

func TestAuthenticate(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	db := storetest.New(t, clk)
	ctx := t.Context()
	now := db.Now()
	tenant := store.Tenant{ID: ids.New(ids.Tenant, now), Name: "acme", CreatedAt: now}
	require.NoError(t, store.CreateTenant(ctx, db.Pool, tenant))
	good, tok, err := iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "ci", iam.RoleViewer, nil)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(good, "bct_"))
	soon := now.Add(time.Hour)
	expiring, _, err := iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "", iam.RoleTenantAdmin, &soon)
	require.NoError(t, err)
	revoked, revokedTok, err := iam.MintAPIToken(ctx, db.Pool, now, tenant.ID, "", iam.RoleTenantAdmin, nil)
	require.NoError(t, err)
	require.NoError(t, store.RevokeAPIToken(ctx, db.Pool, revokedTok.ID, now))
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
