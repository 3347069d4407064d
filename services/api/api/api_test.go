package api_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/api/apitest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
			goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
			goleak.IgnoreTopFunction("internal/poll.runtime_pollWait")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// fixture is two tenants with a pool each, and tokens of every role.
type fixture struct {
	db  *store.DB
	url string
	// pkiDir is the PKI directory of the fixture's API server (pki.Init).
	pkiDir  string
	rootTen string
	acme    string
	other   string
	site    store.Site
	// acmePool and otherPool belong to acme and other.
	acmePool, otherPool string
	// tokens are secrets by who: "root", "acme-admin", "acme-member",
	// "acme-viewer", "other-admin", "other-member", "other-viewer".
	tokens map[string]string
}

func setup(t *testing.T) *fixture {
	t.Helper()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	now := db.Now()
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, now)
	require.NoError(t, err)
	f := &fixture{db: db, pkiDir: dir, url: apitest.StartWith(t, db, api.Config{PKI: service.PKI{PKIDir: dir}})}
	f.rootTen = apitest.Tenant(t, db, "root")
	f.acme = apitest.Tenant(t, db, "acme")
	f.other = apitest.Tenant(t, db, "other")
	f.tokens = map[string]string{
		"root":         apitest.Token(t, db, f.rootTen, iam.RoleRootAdmin),
		"acme-admin":   apitest.Token(t, db, f.acme, iam.RoleTenantAdmin),
		"acme-member":  apitest.Token(t, db, f.acme, iam.RoleTenantMember),
		"acme-viewer":  apitest.Token(t, db, f.acme, iam.RoleViewer),
		"other-admin":  apitest.Token(t, db, f.other, iam.RoleTenantAdmin),
		"other-member": apitest.Token(t, db, f.other, iam.RoleTenantMember),
		"other-viewer": apitest.Token(t, db, f.other, iam.RoleViewer),
	}
	f.site = store.Site{ID: ids.New(ids.Site, now), Name: "dev-1", Region: "dev-1", CreatedAt: now}
	require.NoError(t, store.CreateSite(ctx, db.Pool, f.site))
	f.acmePool = ids.New(ids.Pool, now)
	require.NoError(t, store.CreatePool(ctx, db.Pool, store.Pool{ID: f.acmePool, SiteID: f.site.ID, OwnerTenantID: f.acme,
		Name: "acme-metal", Kind: "metal-host", GPUModel: "H100", ExpectGPUCount: 8, CreatedAt: now}))
	f.otherPool = ids.New(ids.Pool, now)
	require.NoError(t, store.CreatePool(ctx, db.Pool, store.Pool{ID: f.otherPool, SiteID: f.site.ID, OwnerTenantID: f.other,
		Name: "other-metal", Kind: "metal-host", CreatedAt: now}))
	return f
}

type clients struct {
	nodes     computev1connect.NodeServiceClient
	pools     computev1connect.PoolServiceClient
	res       computev1connect.ReservationServiceClient
	usage     computev1connect.UsageServiceClient
	tokens    computev1connect.JoinTokenServiceClient
	tenants   computev1connect.TenantServiceClient
	apiTokens computev1connect.TokenServiceClient
	audit     computev1connect.AuditServiceClient
	commands  computev1connect.CommandServiceClient
	tunnels   computev1connect.TunnelServiceClient
	// events sends the token on streams too (streamBearer, events_test.go).
	events computev1connect.EventServiceClient
}

// as returns clients that send token as a bearer token ("" sends none).
func (f *fixture) as(token string) clients {
	auth := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if token != "" {
				req.Header().Set("Authorization", "Bearer "+token)
			}
			return next(ctx, req)
		}
	})
	base := f.url + api.PathPrefix
	opt := connect.WithInterceptors(auth)
	return clients{
		nodes:     computev1connect.NewNodeServiceClient(http.DefaultClient, base, opt),
		pools:     computev1connect.NewPoolServiceClient(http.DefaultClient, base, opt),
		res:       computev1connect.NewReservationServiceClient(http.DefaultClient, base, opt),
		usage:     computev1connect.NewUsageServiceClient(http.DefaultClient, base, opt),
		tokens:    computev1connect.NewJoinTokenServiceClient(http.DefaultClient, base, opt),
		tenants:   computev1connect.NewTenantServiceClient(http.DefaultClient, base, opt),
		apiTokens: computev1connect.NewTokenServiceClient(http.DefaultClient, base, opt),
		audit:     computev1connect.NewAuditServiceClient(http.DefaultClient, base, opt),
		commands:  computev1connect.NewCommandServiceClient(http.DefaultClient, base, opt),
		tunnels:   computev1connect.NewTunnelServiceClient(http.DefaultClient, base, opt),
		events:    computev1connect.NewEventServiceClient(http.DefaultClient, base, connect.WithInterceptors(streamBearer(token))),
	}
}

// adopted is the options of an adopted node, for node.
var adopted = storetest.NodeOpts{State: store.NodeAdopted}

// node inserts a node of pool with gpus GPUs of model (80 GiB each), in the
// state of opts (storetest.NodeOpts; the pool, GPUs and machine claims are
// set here), and returns its id.
func (f *fixture) node(t *testing.T, pool string, gpus int, model string, opts storetest.NodeOpts) string {
	t.Helper()
	opts.ID = ids.New(ids.Node, f.db.Now())
	opts.PoolID, opts.Hostname, opts.Variant = pool, "h-"+opts.ID, "hgx-h100"
	opts.GPUs, opts.GPUModel, opts.GPUMemoryBytes = gpus, model, 85899345920
	return storetest.Node(t, f.db, &opts).ID
}

func requireCode(t *testing.T, err error, code connect.Code, contains string) {
	t.Helper()
	require.Error(t, err)
	require.Equal(t, code, connect.CodeOf(err), "%v", err)
	var cerr *connect.Error
	require.ErrorAs(t, err, &cerr)
	require.Contains(t, cerr.Message(), contains)
}

func TestAuthentication(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	revoked, tok, err := iam.MintAPIToken(ctx, f.db.Pool, f.db.Now(), f.acme, "", iam.RoleTenantAdmin, nil)
	require.NoError(t, err)
	require.NoError(t, store.RevokeAPIToken(ctx, f.db.Pool, store.AllTenants, tok.ID, f.db.Now()))

	for _, tc := range []struct {
		name, token, msg string
	}{
		{"no token", "", "missing bearer token"},
		{"bad token", "bct_not-a-real-token", "api token is not valid"},
		{"not an api token", "hello", "api token is not valid"},
		{"revoked", revoked, "api token was revoked"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := f.as(tc.token)
			_, err := c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
			requireCode(t, err, connect.CodeUnauthenticated, tc.msg)
			_, err = c.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: f.site.ID,
				Name: "x", Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}))
			requireCode(t, err, connect.CodeUnauthenticated, tc.msg)
		})
	}
}

func TestAuthorization(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	acmeNode := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})
	otherNode := f.node(t, f.otherPool, 0, "", storetest.NodeOpts{})
	createPool := func(c clients, name string) error {
		_, err := c.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: f.site.ID, Name: name,
			Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}))
		return err
	}

	// Readers may not write.
	for who, role := range map[string]string{"acme-viewer": "viewer", "acme-member": "tenant-member"} {
		c := f.as(f.tokens[who])
		requireCode(t, createPool(c, "nope"), connect.CodePermissionDenied, "role "+role+" may not call CreatePool")
		_, err := c.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "nope", Region: "eu"}))
		requireCode(t, err, connect.CodePermissionDenied, "may not call CreateSite (needs sites.manage)")
		_, err = c.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{PoolId: f.acmePool,
			MaxUses: 1, TtlSeconds: 60}))
		requireCode(t, err, connect.CodePermissionDenied, "CreateJoinToken")
		_, err = c.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{}))
		requireCode(t, err, connect.CodePermissionDenied, "ListJoinTokens")
		_, err = c.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: "jt_x"}))
		requireCode(t, err, connect.CodePermissionDenied, "RevokeJoinToken")
	}
	require.NoError(t, createPool(f.as(f.tokens["acme-admin"]), "acme-two"))
	require.NoError(t, createPool(f.as(f.tokens["root"]), "root-pool"))

	// A tenant sees its own pools and nodes; root sees everything.
	poolNames := func(who string) []string {
		res, err := f.as(f.tokens[who]).pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
		require.NoError(t, err)
		var names []string
		for _, p := range res.Msg.Pools {
			names = append(names, p.Name)
		}
		return names
	}
	require.ElementsMatch(t, []string{"acme-metal", "acme-two"}, poolNames("acme-viewer"))
	require.ElementsMatch(t, []string{"other-metal"}, poolNames("other-viewer"))
	require.ElementsMatch(t, []string{"acme-metal", "acme-two", "other-metal", "root-pool"}, poolNames("root"))

	nodeIDs := func(who string) []string {
		res, err := f.as(f.tokens[who]).nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{}))
		require.NoError(t, err)
		var out []string
		for _, n := range res.Msg.Nodes {
			out = append(out, n.Id)
		}
		return out
	}
	require.Equal(t, []string{acmeNode}, nodeIDs("acme-viewer"))
	require.Equal(t, []string{otherNode}, nodeIDs("other-viewer"))
	require.ElementsMatch(t, []string{acmeNode, otherNode}, nodeIDs("root"))

	viewer := f.as(f.tokens["acme-viewer"])
	_, err := viewer.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: otherNode}))
	requireCode(t, err, connect.CodeNotFound, "node "+otherNode+" not found")
	_, err = viewer.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: f.otherPool}))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool "+f.otherPool+" not found")
	res, err := f.as(f.tokens["root"]).nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: otherNode}))
	require.NoError(t, err)
	require.Equal(t, otherNode, res.Msg.Node.Id)

	// A tenant admin cannot mint tokens for another tenant's pool.
	_, err = f.as(f.tokens["acme-admin"]).tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
		PoolId: f.otherPool, MaxUses: 1, TtlSeconds: 60}))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool "+f.otherPool+" not found")
}

func TestListNodes(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	seen := f.db.Now().Add(-3 * time.Second)
	adopted := f.node(t, f.acmePool, 8, "NVIDIA H100 80GB HBM3", storetest.NodeOpts{State: store.NodeAdopted, GatewayID: "gw-a",
		LastSeen: seen, Reachable: true, SpecGeneration: 1, ObservedGeneration: 1, BootID: "boot-1"})
	failed := f.node(t, f.acmePool, 7, "NVIDIA H100 80GB HBM3", storetest.NodeOpts{State: store.NodeAcceptanceFailed,
		Reason: "expected 8 GPUs, found 7", Cordoned: true, CordonReason: "bad gpu"})
	joining := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})

	c := f.as(f.tokens["acme-viewer"])
	res, err := c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: f.acmePool}))
	require.NoError(t, err)
	require.Len(t, res.Msg.Nodes, 3)
	require.Empty(t, res.Msg.NextPageToken)
	byID := map[string]*computev1.Node{}
	for _, n := range res.Msg.Nodes {
		byID[n.Id] = n
	}
	a := byID[adopted]
	require.Equal(t, "adopted", a.ProvisionState)
	require.Equal(t, f.acmePool, a.PoolId)
	require.Equal(t, "gw-a", a.GatewayId)
	require.True(t, a.Reachable)
	require.True(t, a.LastSeen.AsTime().Equal(seen))
	require.Len(t, a.Gpus, 8)
	require.EqualValues(t, 7, a.Gpus[7].Index)
	require.Equal(t, "NVIDIA H100 80GB HBM3", a.Gpus[0].Model)
	require.EqualValues(t, 85899345920, a.Gpus[0].MemoryBytes)
	require.Equal(t, "NVIDIA H100 80GB HBM3", a.GpuModel)
	require.EqualValues(t, 1, a.SpecGeneration)
	require.EqualValues(t, 1, a.ObservedGeneration)
	require.Equal(t, "boot-1", a.BootId)
	require.Equal(t, "hgx-h100", a.Variant)

	x := byID[failed]
	require.Equal(t, "acceptance_failed", x.ProvisionState)
	require.Equal(t, "expected 8 GPUs, found 7", x.ProvisionReason)
	require.True(t, x.Cordoned)
	require.Equal(t, "bad gpu", x.CordonReason)
	require.Len(t, x.Gpus, 7)
	require.False(t, x.Reachable)
	require.Nil(t, x.LastSeen)

	j := byID[joining]
	require.Equal(t, "joining", j.ProvisionState)
	require.Empty(t, j.Gpus)
	require.Empty(t, j.GpuModel)
	require.Empty(t, j.GatewayId)

	// Paging by last id.
	var paged []string
	token := ""
	for {
		res, err := c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PageSize: 2, PageToken: token}))
		require.NoError(t, err)
		for _, n := range res.Msg.Nodes {
			paged = append(paged, n.Id)
		}
		if res.Msg.NextPageToken == "" {
			break
		}
		token = res.Msg.NextPageToken
	}
	require.ElementsMatch(t, []string{adopted, failed, joining}, paged)

	got, err := c.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: failed}))
	require.NoError(t, err)
	require.Equal(t, "expected 8 GPUs, found 7", got.Msg.Node.ProvisionReason)

	_, err = c.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{}))
	requireCode(t, err, connect.CodeInvalidArgument, "node_id")
	_, err = c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PageSize: -1}))
	requireCode(t, err, connect.CodeInvalidArgument, "page_size")
	_, err = c.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: "node_missing"}))
	requireCode(t, err, connect.CodeNotFound, "node node_missing not found")
}

func TestSitesAndPools(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	root := f.as(f.tokens["root"])

	// Sites are shared by every tenant: only root-admin creates them.
	_, err := admin.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "eu-west", Region: "eu"}))
	requireCode(t, err, connect.CodePermissionDenied, "role tenant-admin may not call CreateSite (needs sites.manage)")
	site, err := root.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "eu-west", Region: "eu"}))
	require.NoError(t, err)
	require.NoError(t, ids.Check(ids.Site, site.Msg.Site.Id))
	_, err = root.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "eu-west", Region: "eu"}))
	requireCode(t, err, connect.CodeAlreadyExists, "name: a site with this name already exists")
	_, err = root.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "Bad Name", Region: "eu"}))
	requireCode(t, err, connect.CodeInvalidArgument, "name")
	sites, err := f.as(f.tokens["other-viewer"]).pools.ListSites(ctx, connect.NewRequest(&computev1.ListSitesRequest{}))
	require.NoError(t, err)
	require.Len(t, sites.Msg.Sites, 2, "sites are shared")

	req := &computev1.CreatePoolRequest{SiteId: site.Msg.Site.Id, Name: "l40s", Kind: "metal-host",
		Acceptance: &computev1.Acceptance{Check: "diag.nvml", GpuModel: "L40S", ExpectGpuCount: 4}}
	pool, err := admin.pools.CreatePool(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	p := pool.Msg.Pool
	require.Equal(t, f.acme, p.OwnerTenantId)
	require.Equal(t, "L40S", p.Acceptance.GpuModel)
	require.EqualValues(t, 4, p.Acceptance.ExpectGpuCount)
	_, err = admin.pools.CreatePool(ctx, connect.NewRequest(req))
	requireCode(t, err, connect.CodeAlreadyExists, "name: your tenant already has a pool with this name in the site")
	// Another tenant may use the same name: names of other tenants' pools
	// are not revealed by an AlreadyExists.
	other, err := f.as(f.tokens["other-admin"]).pools.CreatePool(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	require.NotEqual(t, p.Id, other.Msg.Pool.Id)

	for _, tc := range []struct {
		name  string
		req   *computev1.CreatePoolRequest
		code  connect.Code
		field string
	}{
		{"missing site", &computev1.CreatePoolRequest{SiteId: "site_missing", Name: "x", Kind: "metal-host",
			Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}, connect.CodeNotFound, "site_id: site site_missing not found"},
		{"bad kind", &computev1.CreatePoolRequest{SiteId: f.site.ID, Name: "x", Kind: "vm",
			Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}, connect.CodeInvalidArgument, "kind"},
		{"no acceptance", &computev1.CreatePoolRequest{SiteId: f.site.ID, Name: "x", Kind: "metal-host"},
			connect.CodeInvalidArgument, "acceptance"},
		{"bad check", &computev1.CreatePoolRequest{SiteId: f.site.ID, Name: "x", Kind: "metal-host",
			Acceptance: &computev1.Acceptance{Check: "diag.fake"}}, connect.CodeInvalidArgument, "acceptance.check"},
		{"too many gpus", &computev1.CreatePoolRequest{SiteId: f.site.ID, Name: "x", Kind: "metal-host",
			Acceptance: &computev1.Acceptance{Check: "diag.nvml", ExpectGpuCount: 65}}, connect.CodeInvalidArgument, "acceptance.expect_gpu_count"},
	} {
		_, err := admin.pools.CreatePool(ctx, connect.NewRequest(tc.req))
		requireCode(t, err, tc.code, tc.field)
	}

	f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})
	f.node(t, f.acmePool, 0, "", adopted)
	f.node(t, f.acmePool, 0, "", adopted)
	// Revoked nodes are counted apart: they are no placeable capacity.
	f.node(t, f.acmePool, 0, "", storetest.NodeOpts{State: store.NodeAdopted, RevokedAt: f.db.Now()})
	f.node(t, f.acmePool, 0, "", storetest.NodeOpts{State: store.NodeAcceptanceFailed, RevokedAt: f.db.Now()})
	pools, err := f.as(f.tokens["acme-viewer"]).pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{SiteId: f.site.ID}))
	require.NoError(t, err)
	require.Len(t, pools.Msg.Pools, 1)
	require.Equal(t, map[string]int32{"joining": 1, "adopted": 2, "revoked": 2}, pools.Msg.Pools[0].NodeCounts)
}

func TestJoinTokens(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	before := f.db.Now()

	res, err := admin.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
		PoolId: f.acmePool, MaxUses: 3, TtlSeconds: 3600}))
	require.NoError(t, err)
	secret := res.Msg.Secret
	require.True(t, strings.HasPrefix(secret, "bcjt_"), secret)
	jt := res.Msg.JoinToken
	require.EqualValues(t, 3, jt.MaxUses)
	require.Zero(t, jt.Uses)
	require.WithinDuration(t, before.Add(time.Hour), jt.ExpiresAt.AsTime(), time.Minute)

	// Only the hash is stored, and it works for joining.
	stored, err := store.GetJoinTokenByHash(ctx, f.db.Pool, iam.HashSecret(secret))
	require.NoError(t, err)
	require.Equal(t, jt.Id, stored.ID)
	require.NotContains(t, string(stored.Hash), secret)
	_, err = store.UseJoinToken(ctx, f.db.Pool, iam.HashSecret(secret), f.db.Now())
	require.NoError(t, err)

	list, err := admin.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{PoolId: f.acmePool}))
	require.NoError(t, err)
	require.Len(t, list.Msg.JoinTokens, 1)
	require.EqualValues(t, 1, list.Msg.JoinTokens[0].Uses)

	rev, err := admin.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: jt.Id}))
	require.NoError(t, err)
	require.NotNil(t, rev.Msg.JoinToken.RevokedAt)
	again, err := admin.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: jt.Id}))
	require.NoError(t, err)
	require.True(t, again.Msg.JoinToken.RevokedAt.AsTime().Equal(rev.Msg.JoinToken.RevokedAt.AsTime()))
	_, err = store.UseJoinToken(ctx, f.db.Pool, iam.HashSecret(secret), f.db.Now())
	require.ErrorIs(t, err, store.ErrJoinTokenRevoked)

	// Another tenant's admin sees none of it.
	otherAdmin := f.as(apitest.Token(t, f.db, f.other, iam.RoleTenantAdmin))
	_, err = otherAdmin.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: jt.Id}))
	requireCode(t, err, connect.CodeNotFound, "join token "+jt.Id+" not found")
	list, err = otherAdmin.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{}))
	require.NoError(t, err)
	require.Empty(t, list.Msg.JoinTokens)
	list, err = f.as(f.tokens["root"]).tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.JoinTokens, 1)

	for _, tc := range []struct {
		req   *computev1.CreateJoinTokenRequest
		field string
	}{
		{&computev1.CreateJoinTokenRequest{PoolId: f.acmePool, MaxUses: 0, TtlSeconds: 60}, "max_uses"},
		{&computev1.CreateJoinTokenRequest{PoolId: f.acmePool, MaxUses: 1, TtlSeconds: 0}, "ttl_seconds"},
		{&computev1.CreateJoinTokenRequest{PoolId: f.acmePool, MaxUses: 1, TtlSeconds: 2592001}, "ttl_seconds"},
		{&computev1.CreateJoinTokenRequest{MaxUses: 1, TtlSeconds: 60}, "pool_id"},
	} {
		_, err := admin.tokens.CreateJoinToken(ctx, connect.NewRequest(tc.req))
		requireCode(t, err, connect.CodeInvalidArgument, tc.field)
	}
	_, err = admin.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: "jt_missing"}))
	requireCode(t, err, connect.CodeNotFound, "join token jt_missing not found")
}

func TestHTTPSurface(t *testing.T) {
	t.Parallel()
	f := setup(t)
	resp, err := http.Get(f.url + "/healthz")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.NoError(t, resp.Body.Close())

	// Connect's JSON over HTTP/1.1 under the path prefix, as curl would.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost,
		f.url+"/api/compute/bc.compute.v1.PoolService/ListSites", strings.NewReader("{}"))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+f.tokens["acme-viewer"])
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	require.Contains(t, string(body), `"name":"dev-1"`)

	resp, err = http.Post(f.url+"/bc.compute.v1.PoolService/ListSites", "application/json", strings.NewReader("{}"))
	require.NoError(t, err)
	require.Equal(t, http.StatusNotFound, resp.StatusCode, "the services live under /api/compute only")
	require.NoError(t, resp.Body.Close())
}

// TestMessageLimit checks that the API refuses a request beyond
// service.MaxMessageBytes with ResourceExhausted, sent as it is or as a
// gzip bomb, before it authenticates or validates anything.
func TestMessageLimit(t *testing.T) {
	t.Parallel()
	f := setup(t)
	huge := &computev1.CreateSiteRequest{Name: strings.Repeat("a", 64<<20), Region: "r"}
	for _, c := range []struct {
		name string
		opts []connect.ClientOption
		says string
	}{
		{name: "plain", says: "larger than configured max"},
		{name: "gzip bomb", opts: []connect.ClientOption{connect.WithSendGzip()}, says: "inflates beyond"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pools := computev1connect.NewPoolServiceClient(http.DefaultClient, f.url+api.PathPrefix, c.opts...)
			_, err := pools.CreateSite(t.Context(), connect.NewRequest(huge))
			requireCode(t, err, connect.CodeResourceExhausted, c.says)
		})
	}
}
