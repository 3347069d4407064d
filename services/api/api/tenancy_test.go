package api_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// answer is what a caller learns from a call: its code and message, with
// the pool id it named replaced by POOL.
type answer struct {
	Code    connect.Code
	Message string
}

func answerOf(err error, pool string) answer {
	if err == nil {
		return answer{}
	}
	msg := err.Error()
	if cerr := new(connect.Error); errors.As(err, &cerr) {
		msg = cerr.Message()
	}
	return answer{Code: connect.CodeOf(err), Message: strings.ReplaceAll(msg, pool, "POOL")}
}

// TestForeignPoolReadsAsMissing: a pool neither owned by nor offered to the
// caller's tenant answers every tenant-facing RPC that names it exactly as
// a pool that does not exist does (same code, same message but for the
// id); root-admin and the pool's owner still see it; once it is offered,
// the offered tenant sees it and may reserve in it, while what is its
// owner's (offering it, its join tokens, its nodes) stays refused or empty.
func TestForeignPoolReadsAsMissing(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	f.node(t, f.otherPool, 8, "H100", adopted)
	member, admin, viewer := f.as(f.tokens["acme-member"]), f.as(f.tokens["acme-admin"]), f.as(f.tokens["acme-viewer"])
	const missing = "pool_0000000000000000000000missing"

	calls := map[string]func(pool string) error{
		"reserve": func(pool string) error {
			_, err := member.res.Reserve(ctx, reserveReq(pool, 1, time.Hour))
			return err
		},
		"offer": func(pool string) error {
			_, err := admin.pools.OfferPool(ctx, connect.NewRequest(&computev1.OfferPoolRequest{PoolId: pool, TenantId: f.acme, GpuQuota: 8}))
			return err
		},
		"create join token": func(pool string) error {
			_, err := admin.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{PoolId: pool,
				MaxUses: 1, TtlSeconds: 60}))
			return err
		},
		"list join tokens": func(pool string) error {
			_, err := admin.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{PoolId: pool}))
			return err
		},
		"list nodes": func(pool string) error {
			_, err := viewer.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: pool}))
			return err
		},
		"list offers": func(pool string) error {
			_, err := viewer.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: pool}))
			return err
		},
		"list reservations": func(pool string) error {
			_, err := viewer.res.ListReservations(ctx, connect.NewRequest(&computev1.ListReservationsRequest{PoolId: pool}))
			return err
		},
	}
	for name, call := range calls {
		foreign, gone := answerOf(call(f.otherPool), f.otherPool), answerOf(call(missing), missing)
		require.Equal(t, connect.CodeNotFound, gone.Code, "%s: a missing pool", name)
		require.Equal(t, gone, foreign, "%s: another tenant's pool must read as a missing one", name)
		require.Equal(t, "pool_id: pool POOL not found", foreign.Message, name)
	}
	_, err := viewer.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: "garbage"}))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool garbage not found")
	_, err = f.as(f.tokens["root"]).pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: f.otherPool}))
	require.NoError(t, err, "root sees every pool")
	require.NotContains(t, poolIDs(t, viewer), f.otherPool)

	// The owner sees its pool: reserving in it before offering it to
	// itself says so. Root-admin sees every pool.
	_, err = f.as(f.tokens["other-member"]).res.Reserve(ctx, reserveReq(f.otherPool, 1, time.Hour))
	requireCode(t, err, connect.CodePermissionDenied, "pool_id: pool "+f.otherPool+" is not offered to tenant "+f.other)
	_, err = f.as(f.tokens["root"]).res.Reserve(ctx, reserveReq(f.otherPool, 1, time.Hour))
	requireCode(t, err, connect.CodePermissionDenied, "pool_id: pool "+f.otherPool+" is not offered to tenant "+f.rootTen)
	require.Contains(t, poolIDs(t, f.as(f.tokens["root"])), f.otherPool)
	require.Zero(t, f.count(t, `SELECT count(*) FROM reservations`), "no refusal wrote a reservation")

	// Offered to acme: acme sees it and reserves in it; the pool's own
	// business stays its owner's.
	f.offer(t, f.otherPool, f.acme, 8)
	require.Contains(t, poolIDs(t, viewer), f.otherPool)
	_, err = member.res.Reserve(ctx, reserveReq(f.otherPool, 1, time.Hour))
	require.NoError(t, err)
	requireCode(t, calls["offer"](f.otherPool), connect.CodePermissionDenied,
		"pool_id: pool "+f.otherPool+" is offered to your tenant but owned by another: only its owner may offer it")
	requireCode(t, calls["create join token"](f.otherPool), connect.CodePermissionDenied, "only its owner may mint its join tokens")
	requireCode(t, calls["list join tokens"](f.otherPool), connect.CodePermissionDenied, "only its owner may list its join tokens")
	nodes, err := viewer.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: f.otherPool}))
	require.NoError(t, err)
	require.Empty(t, nodes.Msg.Nodes, "the nodes of an offered pool are its owner's")
}

// poolIDs returns the ids ListPools answers c.
func poolIDs(t *testing.T, c clients) []string {
	t.Helper()
	res, err := c.pools.ListPools(t.Context(), connect.NewRequest(&computev1.ListPoolsRequest{}))
	require.NoError(t, err)
	var out []string
	for _, p := range res.Msg.Pools {
		out = append(out, p.Id)
	}
	return out
}

// TestListPoolsShowsOfferedPools: a tenant lists the pools it owns and those
// offered to it, each offered one with its quota and the GPUs in use; the
// owner lists its pool without an offer of its own; root lists every pool
// with root's own offers.
func TestListPoolsShowsOfferedPools(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	f.node(t, f.otherPool, 8, "H100", adopted)
	f.offer(t, f.otherPool, f.acme, 16)
	f.offer(t, f.acmePool, f.rootTen, 4)
	f.reservation(t, f.acme, f.otherPool, 3, "")

	list := func(who, site string) map[string]*computev1.Pool {
		res, err := f.as(f.tokens[who]).pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{SiteId: site}))
		require.NoError(t, err)
		out := map[string]*computev1.Pool{}
		for _, p := range res.Msg.Pools {
			out[p.Id] = p
		}
		return out
	}

	acme := list("acme-viewer", "")
	require.Len(t, acme, 2)
	require.Nil(t, acme[f.acmePool].GetOffer(), "acme did not offer its pool to itself")
	offered := acme[f.otherPool]
	require.NotNil(t, offered, "the pool offered to acme is listed")
	require.Equal(t, f.other, offered.OwnerTenantId)
	require.Equal(t, "other-metal", offered.Name)
	require.Equal(t, map[string]int32{"adopted": 1}, offered.NodeCounts)
	require.Equal(t, f.acme, offered.GetOffer().GetTenantId())
	require.EqualValues(t, 16, offered.GetOffer().GetGpuQuota())
	require.EqualValues(t, 3, offered.GetOffer().GetGpusInUse())
	require.Len(t, list("acme-viewer", f.site.ID), 2, "the site filter keeps offered pools")
	require.Empty(t, list("acme-viewer", "site_other"))

	other := list("other-viewer", "")
	require.Len(t, other, 1, "acme's pool is not offered to other")
	require.Nil(t, other[f.otherPool].GetOffer())

	root := list("root", "")
	require.Len(t, root, 2)
	require.Nil(t, root[f.otherPool].GetOffer())
	require.EqualValues(t, 4, root[f.acmePool].GetOffer().GetGpuQuota())
}

// TestCreateSiteNeedsRegion: a site is a place in a region, so CreateSite
// refuses a missing or blank region, naming the field.
func TestCreateSiteNeedsRegion(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	root := f.as(f.tokens["root"])
	for _, region := range []string{"", "   "} {
		_, err := root.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "s2", Region: region}))
		requireCode(t, err, connect.CodeInvalidArgument, "region: is required")
	}
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM sites`), "nothing created")
	res, err := root.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "s2", Region: "eu-west"}))
	require.NoError(t, err)
	require.Equal(t, "eu-west", res.Msg.Site.Region)
}

// TestRevokeReasonShownAndKept: a revoked node shows when and why it was
// revoked, alike in GetNode and ListNodes; revoking it again answers
// already_revoked, keeps the first time and reason, and its audit row says
// the new reason was not recorded.
func TestRevokeReasonShownAndKept(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	node := f.node(t, f.acmePool, 8, "H100", adopted)
	admin := f.as(f.tokens["acme-admin"])
	revoke := func(reason string) *computev1.RevokeNodeResponse {
		res, err := admin.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: node, Reason: reason}))
		require.NoError(t, err)
		return res.Msg
	}
	get := func() *computev1.Node {
		res, err := admin.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: node}))
		require.NoError(t, err)
		return res.Msg.Node
	}

	first := revoke("  disk stolen ")
	require.False(t, first.AlreadyRevoked)
	require.Equal(t, "disk stolen", first.Node.RevokeReason)
	got := get()
	require.Equal(t, "disk stolen", got.RevokeReason)
	require.NotNil(t, got.RevokedAt)

	second := revoke("another reason")
	require.True(t, second.AlreadyRevoked)
	require.Equal(t, "disk stolen", second.Node.RevokeReason, "the first reason stands")
	require.True(t, second.Node.RevokedAt.AsTime().Equal(first.Node.RevokedAt.AsTime()))
	require.Equal(t, "disk stolen", get().RevokeReason)

	list, err := admin.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: f.acmePool}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Nodes, 1)
	require.Equal(t, "disk stolen", list.Msg.Nodes[0].RevokeReason)

	entries, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 10})
	require.NoError(t, err)
	var details []string
	for _, e := range entries {
		if e.Target == node {
			details = append(details, e.Detail)
		}
	}
	require.Len(t, details, 2)
	require.Contains(t, details[0], `already revoked at `)
	require.Contains(t, details[0], `(reason "disk stolen"); the reason given now ("another reason") was not recorded`)
	require.Contains(t, details[1], "revoked 0 certificate(s), failed 0 reservation(s): disk stolen")

	// A node revoked without a reason has none.
	other := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})
	res, err := admin.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: other}))
	require.NoError(t, err)
	require.Empty(t, res.Msg.Node.RevokeReason)
}
