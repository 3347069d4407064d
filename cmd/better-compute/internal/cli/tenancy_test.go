package cli_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/api/apitest"
)

// TestTenantSeesOfferedPools: a tenant's `pools list` shows the pools
// offered to it, with its quota and the GPUs in use, so it can find what to
// reserve from; another tenant's pool that is not offered to it reads, on
// reserve, exactly as a pool that does not exist.
func TestTenantSeesOfferedPools(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	ctx := t.Context()
	ten := apitest.Tenant(t, f.db, "beta")
	member := f.runner(apitest.Token(t, f.db, ten, iam.RoleTenantMember))
	hidden := ids.New(ids.Pool, f.now)
	require.NoError(t, store.CreatePool(ctx, f.db.Pool, store.Pool{ID: hidden, SiteID: f.siteID, OwnerTenantID: f.tenant,
		Name: "hidden", Kind: "metal-host", CreatedAt: f.now}))

	res := member.run(t, "pools", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.JSONEq(t, `[]`, res.stdout, "nothing offered yet")

	res = f.runner(f.root).run(t, "pools", "offer", f.poolID, "--to", ten, "--quota", "gpu=16")
	require.Equal(t, 0, res.code, res.stderr)
	res = member.run(t, "reserve", "--pool", f.poolID, "--gpus", "2", "--for", "1h")
	require.Equal(t, 0, res.code, res.stderr)

	res = member.run(t, "pools", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var pools []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &pools), res.stdout)
	require.Len(t, pools, 1, res.stdout)
	require.Equal(t, f.poolID, pools[0]["id"])
	require.Equal(t, f.tenant, pools[0]["owner"])
	require.Equal(t, map[string]any{"gpuQuota": 16.0, "gpusInUse": 2.0}, pools[0]["offer"])
	res = member.run(t, "pools", "list")
	require.Equal(t, 0, res.code, res.stderr)
	lines := strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	require.Len(t, lines, 2, res.stdout)
	require.Equal(t, []string{"ID", "NAME", "SITE", "KIND", "GPU", "MODEL", "EXPECT", "GPUS", "QUOTA", "NODES"}, strings.Fields(lines[0]))
	require.Equal(t, []string{f.poolID, "metal-host", f.siteID, "metal-host", "H100", "8", "2/16",
		"acceptance_failed=1", "adopted=1", "joining=1"}, strings.Fields(lines[1]))

	// Root sees every pool; the owner's own pools carry no offer.
	res = f.runner(f.root).run(t, "pools", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &pools), res.stdout)
	require.Len(t, pools, 2)
	for _, p := range pools {
		require.Nil(t, p["offer"], "root's tenant was offered nothing")
	}

	// A pool of another tenant not offered to this one, and a pool that
	// does not exist: the same answer.
	const missing = "pool_0000000000000000000000missing"
	foreign := member.run(t, "reserve", "--pool", hidden, "--gpus", "1", "--for", "1h")
	gone := member.run(t, "reserve", "--pool", missing, "--gpus", "1", "--for", "1h")
	require.Equal(t, 1, foreign.code)
	require.Equal(t, "error: not_found: --pool: pool "+missing+" not found, or not offered to your tenant (`better-compute pools list` "+
		"shows the pools you may reserve from, and a root-admin, or a tenant-admin of the pool's tenant, offers one with "+
		"`better-compute pools offer "+missing+" --to <your tenant id> --quota gpu=N`)\n", gone.stderr)
	require.Equal(t, strings.ReplaceAll(gone.stderr, missing, hidden), foreign.stderr)
	// BETTER_COMPUTE_TENANT is not the caller's tenant (the token says
	// which it is): the hint does not name it.
	member.env["BETTER_COMPUTE_TENANT"] = f.tenant
	res = member.run(t, "reserve", "--pool", missing, "--gpus", "1", "--for", "1h")
	require.Equal(t, gone.stderr, res.stderr)
	delete(member.env, "BETTER_COMPUTE_TENANT")

	// The owner sees its pool: not offered to its own tenant yet, it says
	// so, and how to offer it.
	res = f.runner(f.root).run(t, "reserve", "--pool", hidden, "--gpus", "1", "--for", "1h")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: permission_denied: --pool: pool "+hidden+" is not offered to tenant "+f.tenant+
		" (offer it first: `better-compute pools offer "+hidden+" --to "+f.tenant+" --quota gpu=N`)\n", res.stderr)
}

// TestPoolsCreateBySiteName: --site takes a site id or a site name; neither
// is an error that says both were tried.
func TestPoolsCreateBySiteName(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)

	res := r.run(t, "pools", "create", "by-name", "--site", "dev-1")
	require.Equal(t, 0, res.code, res.stderr)
	byName := strings.TrimSpace(res.stdout)
	res = r.run(t, "pools", "create", "by-id", "--site", f.siteID)
	require.Equal(t, 0, res.code, res.stderr)
	byID := strings.TrimSpace(res.stdout)
	for _, id := range []string{byName, byID} {
		p, err := store.GetPool(t.Context(), f.db.Pool, store.AllTenants, id)
		require.NoError(t, err)
		require.Equal(t, f.siteID, p.SiteID)
	}

	res = r.run(t, "pools", "create", "nowhere", "--site", "dev-9")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: --site: no site has the id or the name \"dev-9\" (sites list shows them)\n", res.stderr)
	require.Empty(t, res.stdout)

	// pools list --site takes either too.
	for _, site := range []string{"dev-1", f.siteID} {
		res = r.run(t, "pools", "list", "--site", site, "-o", "json")
		require.Equal(t, 0, res.code, res.stderr)
		var pools []map[string]any
		require.NoError(t, json.Unmarshal([]byte(res.stdout), &pools))
		require.Len(t, pools, 3, site)
	}
	res = r.run(t, "pools", "list", "--site", "dev-9")
	require.Equal(t, 1, res.code)
	require.Contains(t, res.stderr, `no site has the id or the name "dev-9"`)
}

// TestSitesCreateNeedsRegion: a site is a place in a region: `sites create`
// without --region is refused by the CLI, and a blank one by the API,
// naming the field; nothing is created.
func TestSitesCreateNeedsRegion(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	res := r.run(t, "sites", "create", "s2")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: required flag(s) \"region\" not set\n", res.stderr)
	res = r.run(t, "sites", "create", "s2", "--region", "  ")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: invalid_argument: --region: is required: the region the site is in\n", res.stderr)
	_, err := store.GetSiteByName(t.Context(), f.db.Pool, "s2")
	require.ErrorIs(t, err, store.ErrNotFound)

	res = r.run(t, "sites", "create", "s2", "--region", "eu-west")
	require.Equal(t, 0, res.code, res.stderr)
	site, err := store.GetSiteByName(t.Context(), f.db.Pool, "s2")
	require.NoError(t, err)
	require.Equal(t, "eu-west", site.Region)
}

// TestReserveTimeoutNeedsWait: --timeout bounds --wait only; given alone it
// is refused before anything is reserved.
func TestReserveTimeoutNeedsWait(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	r := f.runner(f.root)
	res := r.run(t, "pools", "offer", f.poolID, "--to", f.tenant, "--quota", "gpu=16")
	require.Equal(t, 0, res.code, res.stderr)
	res = r.run(t, "reserve", "--pool", f.poolID, "--gpus", "1", "--for", "1h", "--timeout", "5s")
	require.Equal(t, 1, res.code)
	require.Equal(t, "error: --timeout applies only with --wait (how long to wait for the reservation to be active): "+
		"add --wait or drop --timeout\n", res.stderr)
	require.Empty(t, res.stdout)
	var n int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM reservations`).Scan(&n))
	require.Zero(t, n, "nothing reserved")
}

// TestNodesRevokeReason: the reason of a revocation shows in `nodes get`
// and in `nodes list` (JSON, the same object, and the table's REASON); a
// second revoke keeps the first reason and says so.
func TestNodesRevokeReason(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	root := f.runner(f.root)
	res := root.run(t, "nodes", "revoke", f.failed, "--reason", "disk stolen")
	require.Equal(t, 0, res.code, res.stderr)

	get := func() map[string]any {
		t.Helper()
		res := f.runner(f.viewer).run(t, "nodes", "get", f.failed)
		require.Equal(t, 0, res.code, res.stderr)
		var node map[string]any
		require.NoError(t, json.Unmarshal([]byte(res.stdout), &node), res.stdout)
		return node
	}
	node := get()
	require.Equal(t, "disk stolen", node["revokeReason"])
	revokedAt, err := time.Parse(time.RFC3339, node["revokedAt"].(string))
	require.NoError(t, err)

	res = f.runner(f.viewer).run(t, "nodes", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var nodes []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &nodes))
	for _, n := range nodes {
		if n["id"] == f.failed {
			require.Equal(t, node, n, "list and get show the same node")
		} else {
			require.NotContains(t, n, "revokeReason")
		}
	}
	res = f.runner(f.viewer).run(t, "nodes", "list")
	require.Equal(t, 0, res.code, res.stderr)
	for line := range strings.Lines(res.stdout) {
		if strings.HasPrefix(line, f.failed) {
			require.Equal(t, "acceptance_failed,revoked", strings.Fields(line)[2], line)
			require.True(t, strings.HasSuffix(strings.TrimSpace(line), "disk stolen"), line)
		}
	}

	res = root.run(t, "nodes", "revoke", f.failed, "--reason", "changed my mind")
	require.Equal(t, 0, res.code, res.stderr)
	require.Equal(t, f.failed+" was already revoked at "+revokedAt.UTC().Format(time.RFC3339)+
		" (reason: disk stolen); nothing changed (0 certificate(s) revoked now)\n", res.stdout)
	require.Equal(t, "warning: --reason was not recorded: a node keeps the reason of its first revocation\n", res.stderr)
	node = get()
	require.Equal(t, "disk stolen", node["revokeReason"], "the first reason stands")
	require.Equal(t, revokedAt.Format(time.RFC3339Nano), node["revokedAt"])
}

// TestPoolsListCountsRevokedApart: `pools list` counts revoked nodes under
// "revoked", not under their provision state: a revoked adopted node is no
// placeable capacity.
func TestPoolsListCountsRevokedApart(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	ctx := t.Context()
	for _, state := range []string{store.NodeAdopted, store.NodeAdopted, store.NodeAcceptanceFailed} {
		id := storetest.Node(t, f.db, &storetest.NodeOpts{PoolID: f.poolID, State: state, CreatedAt: f.now}).ID
		_, err := store.RevokeNode(ctx, f.db.Pool, store.AllTenants, f.now, id, "stolen")
		require.NoError(t, err)
	}
	r := f.runner(f.root)
	res := r.run(t, "pools", "list", "-o", "json")
	require.Equal(t, 0, res.code, res.stderr)
	var pools []map[string]any
	require.NoError(t, json.Unmarshal([]byte(res.stdout), &pools), res.stdout)
	require.Len(t, pools, 1, res.stdout)
	require.Equal(t, map[string]any{"acceptance_failed": 1.0, "adopted": 1.0, "joining": 1.0, "revoked": 3.0}, pools[0]["nodes"])
	res = r.run(t, "pools", "list")
	require.Equal(t, 0, res.code, res.stderr)
	lines := strings.Split(strings.TrimRight(res.stdout, "\n"), "\n")
	require.Len(t, lines, 2, res.stdout)
	require.Equal(t, []string{"acceptance_failed=1", "adopted=1", "joining=1", "revoked=3"},
		strings.Fields(lines[1])[len(strings.Fields(lines[1]))-4:])
}
