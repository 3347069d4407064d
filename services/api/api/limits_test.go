package api_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
)

// serve returns f served by a new API server with cfg (and f's PKI
// directory) on clk, whose limits then never refill.
func (f *fixture) serve(t *testing.T, cfg api.Config, clk clock.Clock) *fixture {
	t.Helper()
	cfg.PKI = service.PKI{PKIDir: f.pkiDir}
	srv, err := api.New(cfg, api.Deps{DB: f.db, Logger: telemetry.Discard(), Clock: clk})
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(srv.Close)
	t.Cleanup(ts.Close)
	t.Cleanup(srv.StopWatches)
	g := *f
	g.url = ts.URL
	return &g
}

// auditRows returns how many audit rows f's database holds.
func (f *fixture) auditRows(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM audit`).Scan(&n))
	return n
}

// TestAnonymousCallsThrottled checks that 10,000 tokenless RevokeNode
// calls from one address write no audit row, that the first 50 (the
// default burst) are Unauthenticated and the rest ResourceExhausted with a
// retry hint, that the address is then throttled on the HTTP watch too,
// and that a valid token this server has cached still works from there.
func TestAnonymousCallsThrottled(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f = f.serve(t, api.Config{TokenCacheTTL: time.Hour}, clock.NewFake(f.db.Now()))
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	_, err := admin.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
	require.NoError(t, err, "cached from here on")
	before := f.auditRows(t)
	anon := f.as("")

	const calls, workers = 10000, 8
	var (
		mu    sync.Mutex
		codes = map[connect.Code]int{}
		hints = map[string]int{}
		wg    sync.WaitGroup
	)
	for w := range workers {
		wg.Go(func() {
			for range calls / workers {
				_, err := anon.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: "node_x" + string(rune('a'+w))}))
				var cerr *connect.Error
				if !errors.As(err, &cerr) {
					t.Errorf("RevokeNode: %v", err)
					return
				}
				mu.Lock()
				codes[cerr.Code()]++
				if cerr.Code() == connect.CodeResourceExhausted {
					hints[cerr.Meta().Get("Retry-After")+" "+cerr.Message()]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Equal(t, map[connect.Code]int{connect.CodeUnauthenticated: 50, connect.CodeResourceExhausted: calls - 50}, codes)
	require.Equal(t, map[string]int{"1 failed authentications from this address: too many; retry in 1 s": calls - 50}, hints)
	require.Equal(t, before, f.auditRows(t), "no audit row for a call that did not authenticate")

	res := f.getWatch(ctx, t, "", nil)
	defer res.Body.Close()
	require.Equal(t, http.StatusTooManyRequests, res.StatusCode)
	require.Equal(t, "1", res.Header.Get("Retry-After"))
	_, err = admin.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
	require.NoError(t, err, "a cached valid token is not throttled")
	_, err = f.as(f.tokens["acme-viewer"]).nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
	requireCode(t, err, connect.CodeResourceExhausted, "retry in 1 s")
}

// TestBadTokenFloodSparesValidTokens checks that 10,000 RevokeNode calls
// with bad tokens from one address write no audit row and are throttled,
// and that a valid token used from that address before still works there
// when no row is cached (every call reads the database): the limit
// throttles failures, not the address.
func TestBadTokenFloodSparesValidTokens(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f = f.serve(t, api.Config{TokenCacheTTL: -1}, clock.NewFake(f.db.Now()))
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	_, err := admin.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
	require.NoError(t, err)
	before := f.auditRows(t)

	const calls, workers = 10000, 8
	var (
		mu    sync.Mutex
		codes = map[connect.Code]int{}
		wg    sync.WaitGroup
	)
	for range workers {
		wg.Go(func() {
			for range calls / workers {
				secret, err := iam.NewSecret(iam.APITokenPrefix)
				if err != nil {
					t.Errorf("NewSecret: %v", err)
					return
				}
				_, err = f.as(secret).nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: "node_x"}))
				mu.Lock()
				codes[connect.CodeOf(err)]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Equal(t, map[connect.Code]int{connect.CodeUnauthenticated: 50, connect.CodeResourceExhausted: calls - 50}, codes)
	require.Equal(t, before, f.auditRows(t), "no audit row for a call that did not authenticate")

	for range 3 {
		_, err = admin.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
		require.NoError(t, err, "a valid token read before passes from the throttled address")
	}
	_, err = admin.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: "node_x"}))
	requireCode(t, err, connect.CodeNotFound, "node_x")
	require.Equal(t, before+1, f.auditRows(t), "the valid token's mutating call is audited")
	_, err = f.as("").nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: "node_x"}))
	requireCode(t, err, connect.CodeResourceExhausted, "retry in 1 s")
}

// TestTicketIssuanceThrottled checks that CreateTicket and
// IssueSshCertificate share a limit per source address, refused with
// ResourceExhausted and a retry hint, and audited with their caller.
func TestTicketIssuanceThrottled(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f = f.serve(t, api.Config{TicketBurst: 3, TicketRate: 1}, clock.NewFake(f.db.Now()))
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	node := ids.New(ids.Node, f.db.Now())
	ticket := func() error {
		_, err := admin.tunnels.CreateTicket(ctx, connect.NewRequest(&computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"}))
		return err
	}
	for range 2 {
		requireCode(t, ticket(), connect.CodeNotFound, node)
	}
	_, err := admin.tunnels.IssueSshCertificate(ctx, connect.NewRequest(&computev1.IssueSshCertificateRequest{NodeId: node,
		PublicKey: "not a key"}))
	requireCode(t, err, connect.CodeInvalidArgument, "public_key")
	err = ticket()
	requireCode(t, err, connect.CodeResourceExhausted, "tunnel tickets and SSH certificates from this address: too many; retry in 1 s")
	var cerr *connect.Error
	require.ErrorAs(t, err, &cerr)
	require.Equal(t, "1", cerr.Meta().Get("Retry-After"))
	entries, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 1})
	require.NoError(t, err)
	require.Equal(t, computev1connect.TunnelServiceCreateTicketProcedure, entries[0].Procedure)
	require.Equal(t, "resource_exhausted", entries[0].Outcome)
	require.Equal(t, f.acme, entries[0].TenantID, "the refusal names its caller")
	// Other RPCs are not limited by it.
	_, err = admin.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
	require.NoError(t, err)
}

// TestForwardedForTrustedOnlyWhenSet checks that the source address of the
// limits is the TCP peer, X-Forwarded-For ignored, unless
// TrustForwardedFor says that a proxy in front writes it: then each
// forwarded address has its own budget.
func TestForwardedForTrustedOnlyWhenSet(t *testing.T) {
	t.Parallel()
	base := setup(t)
	ctx := t.Context()
	revoke := func(f *fixture, forwarded string) connect.Code {
		t.Helper()
		req := connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: "node_x"})
		req.Header().Set("X-Forwarded-For", forwarded)
		_, err := f.as("").nodes.RevokeNode(ctx, req)
		return connect.CodeOf(err)
	}
	for _, c := range []struct {
		name  string
		trust bool
		// second is the code of a call forwarded for another address
		// once the first address spent its burst.
		second connect.Code
	}{
		{"ignored", false, connect.CodeResourceExhausted},
		{"trusted", true, connect.CodeUnauthenticated},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := api.Config{AuthFailureBurst: 2, AuthFailureRate: 1}
			cfg.TrustForwardedFor = c.trust
			f := base.serve(t, cfg, clock.NewFake(base.db.Now()))
			require.Equal(t, connect.CodeUnauthenticated, revoke(f, "203.0.113.1"))
			require.Equal(t, connect.CodeUnauthenticated, revoke(f, "203.0.113.1"))
			require.Equal(t, connect.CodeResourceExhausted, revoke(f, "203.0.113.1"))
			require.Equal(t, c.second, revoke(f, "203.0.113.2"))
		})
	}
}
