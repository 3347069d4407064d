package api_test

import (
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/store"
)

// TestJoinTokenNeverOutlivesItsMinter: a join token expires no later than
// the API token that mints it: a longer ttl_seconds is refused with the
// limit, a shorter one is minted; a token that never expires mints any
// ttl_seconds the request allows.
func TestJoinTokenNeverOutlivesItsMinter(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	exp := f.db.Now().Add(time.Hour)
	short, _, err := iam.MintAPIToken(ctx, f.db.Pool, f.db.Now(), f.acme, "short", iam.RoleTenantAdmin, &exp)
	require.NoError(t, err)
	c := f.as(short)

	_, err = c.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{PoolId: f.acmePool,
		MaxUses: 1, TtlSeconds: 7200}))
	requireCode(t, err, connect.CodeInvalidArgument, "ttl_seconds: a join token may not outlive the API token that mints it")
	require.Contains(t, err.Error(), exp.UTC().Format(time.RFC3339), "names the minter's expiry")
	require.Contains(t, err.Error(), "at most 3", "names the longest ttl_seconds allowed")
	tokens, err := store.ListJoinTokens(ctx, f.db.Pool, store.JoinTokenFilter{Scope: store.AllTenants, PoolID: f.acmePool})
	require.NoError(t, err)
	require.Empty(t, tokens, "nothing minted")

	res, err := c.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{PoolId: f.acmePool,
		MaxUses: 1, TtlSeconds: 1800}))
	require.NoError(t, err)
	require.False(t, res.Msg.JoinToken.ExpiresAt.AsTime().After(exp))

	res, err = f.as(f.tokens["acme-admin"]).tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
		PoolId: f.acmePool, MaxUses: 1, TtlSeconds: 30 * 24 * 3600}))
	require.NoError(t, err, "a token that never expires")
	require.WithinDuration(t, f.db.Now().Add(30*24*time.Hour), res.Msg.JoinToken.ExpiresAt.AsTime(), time.Minute)
}

// TestLastRootAdminIgnoresExpiringTokens: a root-admin token that expires
// within store.RootAdminExpiryMargin does not count as a remaining root
// administrator, so the last one that lasts longer cannot be revoked; one
// that outlasts the margin makes it revocable.
func TestLastRootAdminIgnoresExpiringTokens(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	root := f.as(f.tokens["root"])
	rootTok, err := store.GetAPITokenByHash(ctx, f.db.Pool, iam.HashSecret(f.tokens["root"]))
	require.NoError(t, err)
	all, err := root.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{}))
	require.NoError(t, err)
	for _, tok := range all.Msg.Tokens {
		if tok.Role == "root-admin" && tok.Id != rootTok.ID && tok.RevokedAt == nil {
			_, err := root.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: tok.Id}))
			require.NoError(t, err)
		}
	}

	soon := int64((store.RootAdminExpiryMargin - time.Minute) / time.Second)
	_, err = root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "root-soon",
		Role: "root-admin", TtlSeconds: soon}))
	require.NoError(t, err)
	_, err = root.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: rootTok.ID}))
	requireCode(t, err, connect.CodeFailedPrecondition, "is the last live root-admin token")
	require.Contains(t, err.Error(), "expiring within "+store.RootAdminExpiryMargin.String())

	later := int64((store.RootAdminExpiryMargin + time.Hour) / time.Second)
	_, err = root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "root-later",
		Role: "root-admin", TtlSeconds: later}))
	require.NoError(t, err)
	_, err = root.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: rootTok.ID}))
	require.NoError(t, err)
}
