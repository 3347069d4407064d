package api_test

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/outbox"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/api/apitest"
)

// replica returns f served by another API server over the same database
// with cfg and nc (nil: none), as a second replica would be.
func (f *fixture) replica(t *testing.T, cfg api.Config, nc *nats.Conn) *fixture {
	t.Helper()
	srv, err := api.New(cfg, api.Deps{DB: f.db, Logger: telemetry.Discard(), NC: nc})
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(srv.Close)
	t.Cleanup(ts.Close)
	g := *f
	g.url = ts.URL
	return &g
}

// listPools calls ListPools with token on f's server and returns its error.
func (f *fixture) listPools(ctx context.Context, token string) error {
	_, err := f.as(token).pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
	return err
}

// revokedBehind revokes token id in the database alone: no outbox message,
// no server told, as if its message were lost. Raw SQL: store.RevokeAPIToken
// always writes the message.
func (f *fixture) revokedBehind(t *testing.T, id string) {
	t.Helper()
	_, err := f.db.Pool.Exec(t.Context(), `UPDATE api_tokens SET revoked_at = $2 WHERE id = $1`, id, f.db.Now())
	require.NoError(t, err)
}

// TestRevokedTokenRefusedAtOnce checks that the server that revokes a
// token refuses it from the very next call, however long it caches tokens,
// and without NATS.
func TestRevokedTokenRefusedAtOnce(t *testing.T) {
	t.Parallel()
	f := setup(t).replica(t, api.Config{TokenCacheTTL: time.Hour}, nil)
	ctx := t.Context()
	res, err := f.as(f.tokens["acme-admin"]).apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{
		Name: "ci", Role: "tenant-member"}))
	require.NoError(t, err)
	secret, id := res.Msg.Secret, res.Msg.Token.Id
	require.NoError(t, f.listPools(ctx, secret), "cached from here on")

	// The cache answers: a revocation behind its back is not seen.
	other := apitest.Token(t, f.db, f.acme, iam.RoleViewer)
	require.NoError(t, f.listPools(ctx, other))
	otherID := tokenID(t, f.db, other)
	f.revokedBehind(t, otherID)
	require.NoError(t, f.listPools(ctx, other), "cached for an hour")

	_, err = f.as(f.tokens["acme-admin"]).apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: id}))
	require.NoError(t, err)
	requireCode(t, f.listPools(ctx, secret), connect.CodeUnauthenticated, "api token was revoked")
}

// TestRevokedTokenRefusedByReplicas checks that a token revoked on one API
// server is refused by another once the revocation's message reaches it
// over NATS, long before that server's cache TTL (an hour here): through
// the outbox and its relay, and for a message that names no token.
func TestRevokedTokenRefusedByReplicas(t *testing.T) {
	t.Parallel()
	base := setup(t)
	nc := natsConn(t)
	a := base.replica(t, api.Config{TokenCacheTTL: time.Hour}, nc)
	b := base.replica(t, api.Config{TokenCacheTTL: time.Hour}, nc)
	ctx := t.Context()
	refusedOn := func(f *fixture, token string) func() bool {
		return func() bool { return connect.CodeOf(f.listPools(ctx, token)) == connect.CodeUnauthenticated }
	}

	// A message that names no token drops every cached one.
	lost := apitest.Token(t, base.db, base.acme, iam.RoleViewer)
	require.NoError(t, b.listPools(ctx, lost))
	base.revokedBehind(t, tokenID(t, base.db, lost))
	require.NoError(t, b.listPools(ctx, lost), "cached: b was not told")
	require.NoError(t, nc.Publish(store.SubjectAPITokenRevoked, []byte("{}")))
	require.Eventually(t, refusedOn(b, lost), 10*time.Second, 10*time.Millisecond)

	// A revocation through a reaches b by the outbox relay.
	relayCtx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	r := &outbox.Relay{DB: base.db, NC: nc, Logger: telemetry.Discard(), Clock: clock.New(), Poll: 50 * time.Millisecond}
	go func() { defer close(done); _ = r.Run(relayCtx) }()
	t.Cleanup(func() { cancel(); <-done })

	member := apitest.Token(t, base.db, base.acme, iam.RoleTenantMember)
	keep := apitest.Token(t, base.db, base.acme, iam.RoleViewer)
	require.NoError(t, b.listPools(ctx, member))
	require.NoError(t, b.listPools(ctx, keep))
	_, err := a.as(base.tokens["acme-admin"]).apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{
		TokenId: tokenID(t, base.db, member)}))
	require.NoError(t, err)
	requireCode(t, a.listPools(ctx, member), connect.CodeUnauthenticated, "api token was revoked")
	require.Eventually(t, refusedOn(b, member), 10*time.Second, 10*time.Millisecond)
	require.NoError(t, b.listPools(ctx, keep), "other tokens keep working")
}

// tokenID returns the id of the API token whose secret is secret.
func tokenID(t *testing.T, db *store.DB, secret string) string {
	t.Helper()
	tok, err := store.GetAPITokenByHash(t.Context(), db.Pool, iam.HashSecret(secret))
	require.NoError(t, err)
	return tok.ID
}
