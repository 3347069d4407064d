package api_test

import (
	"context"
	"fmt"
	"path"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/api/apitest"
)

// codeOK is the expectation of a call that succeeds (connect has no code 0).
const codeOK connect.Code = 0

// procedures returns every procedure of bc.compute.v1, from the generated
// descriptors, so that a new RPC shows up here by itself.
func procedures() []string {
	var out []string
	svcs := computev1.File_bc_compute_v1_compute_proto.Services()
	for i := range svcs.Len() {
		methods := svcs.Get(i).Methods()
		for j := range methods.Len() {
			out = append(out, "/"+string(svcs.Get(i).FullName())+"/"+string(methods.Get(j).Name()))
		}
	}
	return out
}

func TestPolicyCoversEveryProcedure(t *testing.T) {
	t.Parallel()
	procs := procedures()
	for _, proc := range procs {
		_, ok := api.Policy[proc]
		require.True(t, ok, "%s has no authorization rule", proc)
	}
	require.Len(t, api.Policy, len(procs), "the policy names only served procedures")
	for proc, rule := range api.Policy {
		require.False(t, rule.Public, "%s: the compute API has no public RPC", proc)
		require.NotEmpty(t, rule.Permission, "%s names a permission", proc)
		require.True(t, slices.Contains(iam.Permissions(), rule.Permission), "%s: unknown permission %s", proc, rule.Permission)
		require.Equal(t, rule.Mutating, rule.Target != "", "%s: a mutating RPC names its target field, only it", proc)
	}
}

// subject is what one call of a TestMatrix row acts on: the resource the
// row's arrange made for that call alone, in the fixture of the row's
// procedure.
type subject struct {
	f *fixture
	// who is the caller's column ("viewer", "member", …): it keeps the
	// names of creates apart, so that each create is a new one.
	who string
	// id is the resource made for the call (a node, pool, join token, API
	// token, reservation or command); "" when the row makes none.
	id string
	// after is the event id a Watch starts after.
	after int64
}

// matrixRow is the expected outcome of one RPC for each kind of caller.
// Every call acts on acme's resources, made for it by arrange.
type matrixRow struct {
	proc string
	// arrange, when set, makes what one call acts on (s.id, s.after); it
	// runs before every call of the row.
	arrange func(t *testing.T, s *subject)
	// call makes the request as c, on s.
	call func(ctx context.Context, c clients, s subject) error
	// viewer and member are acme's viewer and tenant-member (which holds
	// what a viewer does, and reservations.write: pkg/iam's
	// rolePermissions); otherMember and otherAdmin are a tenant-member and
	// tenant-admin of another tenant.
	viewer, member, otherMember, otherAdmin connect.Code
	// right is the token (fixture.tokens key) with the role the RPC needs.
	right string
	// bad makes the call with an invalid field (nil: the request has none),
	// refused with InvalidArgument naming field even for root.
	bad   func(ctx context.Context, c clients, s subject) error
	field string
	// The audit rows of a mutating RPC: target is the target an
	// authenticated caller's row takes from the request (s.id when nil); a
	// successful create names the new resource instead, an id with prefix
	// created. detail, when set, is the success row's detail.
	target  func(s subject) string
	created ids.Prefix
	detail  string
}

// matrixRows is TestMatrix's table, one row per procedure of bc.compute.v1.
func matrixRows() []matrixRow {
	long := strings.Repeat("x", 65)
	pd, nf := connect.CodePermissionDenied, connect.CodeNotFound
	// newNode and newCordonedNode make a node of acme's pool.
	newNode := func(t *testing.T, s *subject) { s.id = s.f.node(t, s.f.acmePool, 0, "", storetest.NodeOpts{}) }
	newCordonedNode := func(t *testing.T, s *subject) {
		s.id = s.f.node(t, s.f.acmePool, 0, "", storetest.NodeOpts{Cordoned: true, CordonReason: "matrix"})
	}
	// newCommandNode makes an adopted node of acme's pool, which runs
	// commands.
	newCommandNode := func(t *testing.T, s *subject) { s.id = s.f.node(t, s.f.acmePool, 1, "H100", adopted) }
	newPool := func(t *testing.T, s *subject) { s.id = s.f.newPool(t) }
	newOfferedPool := func(t *testing.T, s *subject) { s.id = s.f.newOfferedPool(t) }
	return []matrixRow{
		{
			proc: computev1connect.NodeServiceListNodesProcedure,
			// A pool of acme's with a node in it.
			arrange: func(t *testing.T, s *subject) {
				s.id = s.f.newPool(t)
				s.f.node(t, s.id, 0, "", storetest.NodeOpts{})
			},
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: s.id}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PageSize: 10001}))
				return err
			}, field: "page_size",
		},
		{
			proc:    computev1connect.NodeServiceGetNodeProcedure,
			arrange: newNode,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: s.id}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: long}))
				return err
			}, field: "node_id",
		},
		{
			proc:    computev1connect.NodeServiceRevokeNodeProcedure,
			arrange: newNode,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: s.id, Reason: "matrix"}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{}))
				return err
			}, field: "node_id",
		},
		{
			proc:    computev1connect.NodeServiceCordonNodeProcedure,
			arrange: newNode,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: s.id, Reason: "matrix"}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: s.id}))
				return err
			}, field: "reason",
		},
		{
			proc:    computev1connect.NodeServiceUncordonNodeProcedure,
			arrange: newCordonedNode,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.nodes.UncordonNode(ctx, connect.NewRequest(&computev1.UncordonNodeRequest{NodeId: s.id}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.nodes.UncordonNode(ctx, connect.NewRequest(&computev1.UncordonNodeRequest{}))
				return err
			}, field: "node_id",
		},
		{
			proc: computev1connect.PoolServiceCreateSiteProcedure,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "site-" + s.who, Region: "eu"}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: pd, right: "root",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "-bad-", Region: "eu"}))
				return err
			}, field: "name",
			target: func(s subject) string { return "site-" + s.who }, created: ids.Site,
		},
		{
			proc: computev1connect.PoolServiceListSitesProcedure,
			call: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.pools.ListSites(ctx, connect.NewRequest(&computev1.ListSitesRequest{}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
		},
		{
			proc: computev1connect.PoolServiceCreatePoolProcedure,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: s.f.site.ID,
					Name: "pool-" + s.who, Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}))
				return err
			},
			// Another tenant's admin creates a pool of its own tenant.
			viewer: pd, member: pd, otherMember: pd, otherAdmin: codeOK, right: "acme-admin",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: s.f.site.ID,
					Name: "p", Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml", GpuModel: long}}))
				return err
			}, field: "acceptance.gpu_model",
			target: func(s subject) string { return "pool-" + s.who }, created: ids.Pool,
		},
		{
			proc: computev1connect.PoolServiceListPoolsProcedure,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{SiteId: s.f.site.ID}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{SiteId: long}))
				return err
			}, field: "site_id",
		},
		{
			proc: computev1connect.PoolServiceOfferPoolProcedure,
			// acme offers a pool of its own to itself.
			arrange: newPool,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.pools.OfferPool(ctx, connect.NewRequest(&computev1.OfferPoolRequest{PoolId: s.id,
					TenantId: s.f.acme, GpuQuota: 1000}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.pools.OfferPool(ctx, connect.NewRequest(&computev1.OfferPoolRequest{PoolId: s.id,
					TenantId: s.f.acme, GpuQuota: -1}))
				return err
			}, field: "gpu_quota",
		},
		{
			proc:    computev1connect.PoolServiceListOffersProcedure,
			arrange: newOfferedPool,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: s.id}))
				return err
			},
			// Acme's pool is not offered to other tenants: it reads as a
			// missing one.
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: long}))
				return err
			}, field: "pool_id",
		},
		{
			proc:    computev1connect.ReservationServiceReserveProcedure,
			arrange: newOfferedPool,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.res.Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: s.id, Gpus: 1,
					Duration: durationpb.New(time.Hour)}))
				return err
			},
			// acme's pool is not offered to the other tenant: to it, the
			// pool does not exist.
			viewer: pd, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.res.Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: s.id, Gpus: 0,
					Duration: durationpb.New(time.Hour)}))
				return err
			}, field: "gpus",
			created: ids.Reservation,
		},
		{
			proc:    computev1connect.ReservationServiceGetReservationProcedure,
			arrange: func(t *testing.T, s *subject) { s.id = s.f.newReservation(t, s.f.acmePool) },
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: s.id}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{}))
				return err
			}, field: "reservation_id",
		},
		{
			proc: computev1connect.ReservationServiceListReservationsProcedure,
			// A pool of acme's with a reservation in it.
			arrange: func(t *testing.T, s *subject) {
				s.id = s.f.newPool(t)
				s.f.newReservation(t, s.id)
			},
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.res.ListReservations(ctx, connect.NewRequest(&computev1.ListReservationsRequest{PoolId: s.id}))
				return err
			},
			// acme's pool is not offered to other: it reads as missing.
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.res.ListReservations(ctx, connect.NewRequest(&computev1.ListReservationsRequest{State: "running"}))
				return err
			}, field: "state",
		},
		{
			proc:    computev1connect.ReservationServiceReleaseReservationProcedure,
			arrange: func(t *testing.T, s *subject) { s.id = s.f.newReservation(t, s.f.acmePool) },
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: s.id}))
				return err
			},
			viewer: pd, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{}))
				return err
			}, field: "reservation_id",
			detail: "released",
		},
		{
			proc: computev1connect.UsageServiceListUsageProcedure,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.usage.ListUsage(ctx, connect.NewRequest(&computev1.ListUsageRequest{TenantId: s.f.acme}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.usage.ListUsage(ctx, connect.NewRequest(&computev1.ListUsageRequest{PageSize: 10001}))
				return err
			}, field: "page_size",
		},
		{
			proc:    computev1connect.JoinTokenServiceCreateJoinTokenProcedure,
			arrange: newPool,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
					PoolId: s.id, MaxUses: 1, TtlSeconds: 60}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
					PoolId: s.id, MaxUses: 100001, TtlSeconds: 60}))
				return err
			}, field: "max_uses",
			created: ids.JoinToken,
		},
		{
			proc: computev1connect.JoinTokenServiceListJoinTokensProcedure,
			// A pool of acme's with a join token of it.
			arrange: func(t *testing.T, s *subject) {
				s.id = s.f.newPool(t)
				s.f.newJoinToken(t, s.id)
			},
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{PoolId: s.id}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{PoolId: long}))
				return err
			}, field: "pool_id",
		},
		{
			proc:    computev1connect.JoinTokenServiceRevokeJoinTokenProcedure,
			arrange: func(t *testing.T, s *subject) { s.id = s.f.newJoinToken(t, s.f.acmePool) },
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: s.id}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{}))
				return err
			}, field: "join_token_id",
			detail: "revoked",
		},
		{
			proc: computev1connect.TenantServiceCreateTenantProcedure,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "tenant-" + s.who}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: pd, right: "root",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "Bad Name"}))
				return err
			}, field: "name",
			target: func(s subject) string { return "tenant-" + s.who }, created: ids.Tenant,
		},
		{
			proc: computev1connect.TenantServiceListTenantsProcedure,
			call: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.tenants.ListTenants(ctx, connect.NewRequest(&computev1.ListTenantsRequest{}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
		},
		{
			proc: computev1connect.TokenServiceCreateTokenProcedure,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{TenantId: s.f.acme,
					Name: "by-" + s.who, Role: string(iam.RoleViewer)}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "x", Role: "god"}))
				return err
			}, field: "role",
			target: func(s subject) string { return s.f.acme }, created: ids.APIToken,
		},
		{
			proc: computev1connect.TokenServiceListTokensProcedure,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{TenantId: s.f.acme}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{TenantId: long}))
				return err
			}, field: "tenant_id",
		},
		{
			proc: computev1connect.TokenServiceRevokeTokenProcedure,
			// The victim, a tenant-member token of acme.
			arrange: func(t *testing.T, s *subject) { s.id = s.f.newAPIToken(t) },
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: s.id}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{}))
				return err
			}, field: "token_id",
			detail: "revoked",
		},
		{
			proc:    computev1connect.CommandServiceRunCommandProcedure,
			arrange: newCommandNode,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{NodeId: s.id,
					Kind: "diag.nvml"}))
				return err
			},
			// Running commands (node.reboot among them) is an operator action.
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{NodeId: s.id,
					Kind: "rm -rf"}))
				return err
			}, field: "kind",
			created: ids.Command,
		},
		{
			proc: computev1connect.CommandServiceGetCommandProcedure,
			arrange: func(t *testing.T, s *subject) {
				newCommandNode(t, s)
				s.id = s.f.newCommand(t, s.id)
			},
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{CommandId: s.id}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{}))
				return err
			}, field: "command_id",
		},
		{
			proc: computev1connect.CommandServiceListCommandsProcedure,
			// A node of acme's with a command.
			arrange: func(t *testing.T, s *subject) {
				newCommandNode(t, s)
				s.f.newCommand(t, s.id)
			},
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.commands.ListCommands(ctx, connect.NewRequest(&computev1.ListCommandsRequest{NodeId: s.id}))
				return err
			},
			viewer: codeOK, member: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.commands.ListCommands(ctx, connect.NewRequest(&computev1.ListCommandsRequest{PageSize: 10001}))
				return err
			}, field: "page_size",
		},
		{
			proc: computev1connect.AuditServiceListAuditProcedure,
			call: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{}))
				return err
			},
			// Another tenant's admin reads its own tenant's log.
			viewer: pd, member: pd, otherMember: pd, otherAdmin: codeOK, right: "acme-admin",
			bad: func(ctx context.Context, c clients, _ subject) error {
				_, err := c.audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{PageSize: 1001}))
				return err
			}, field: "page_size",
		},
		{
			proc:    computev1connect.EventServiceWatchProcedure,
			arrange: func(t *testing.T, s *subject) { s.after = s.f.newEvents(t) },
			// A server stream: the call succeeds when the first event
			// arrives (every caller's tenant has one after s.after).
			call: func(ctx context.Context, c clients, s subject) error {
				return firstEvent(ctx, c, &computev1.WatchRequest{AfterId: s.after})
			},
			// Every tenant watches its own events.
			viewer: codeOK, member: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
			bad: func(ctx context.Context, c clients, _ subject) error {
				return firstEvent(ctx, c, &computev1.WatchRequest{Types: []string{"node.*", "Node.*"}})
			}, field: "types[1]",
		},
		{
			proc: computev1connect.TunnelServiceCreateTicketProcedure,
			// A shell on an adopted node of acme's: an operator's access.
			arrange: newCommandNode,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tunnels.CreateTicket(ctx, connect.NewRequest(&computev1.CreateTicketRequest{NodeId: s.id,
					Purpose: "shell"}))
				return err
			},
			// A tenant-member passes the policy (reservations.write, for
			// sandboxes) but a shell needs nodes.access.
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tunnels.CreateTicket(ctx, connect.NewRequest(&computev1.CreateTicketRequest{NodeId: s.id,
					Purpose: "rsh"}))
				return err
			}, field: "purpose",
		},
		{
			proc: computev1connect.TunnelServiceIssueSshCertificateProcedure,
			// A break-glass certificate for an adopted node of acme's.
			arrange: newCommandNode,
			call: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tunnels.IssueSshCertificate(ctx, connect.NewRequest(&computev1.IssueSshCertificateRequest{
					NodeId: s.id, PublicKey: testSSHKey}))
				return err
			},
			viewer: pd, member: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(ctx context.Context, c clients, s subject) error {
				_, err := c.tunnels.IssueSshCertificate(ctx, connect.NewRequest(&computev1.IssueSshCertificateRequest{
					NodeId: s.id, PublicKey: "ssh-ed25519 not-base64"}))
				return err
			}, field: "public_key",
		},
	}
}

// The fixtures of TestMatrix's calls: each makes a new resource of acme's
// with the storetest factory and returns its id.

// newPool makes a pool of acme's in the fixture's site.
func (f *fixture) newPool(t *testing.T) string {
	t.Helper()
	return storetest.Pool(t, f.db, &storetest.PoolOpts{SiteID: f.site.ID, OwnerTenantID: f.acme}).ID
}

// newOfferedPool makes a pool of acme's offered to acme (a quota of 1000
// GPUs), with an adopted node of 8 GPUs to reserve.
func (f *fixture) newOfferedPool(t *testing.T) string {
	t.Helper()
	pool := f.newPool(t)
	f.node(t, pool, 8, "H100", adopted)
	storetest.Offer(t, f.db, &storetest.OfferOpts{PoolID: pool, TenantID: f.acme, GPUQuota: 1000})
	return pool
}

// newReservation makes a pending reservation of one GPU of pool for acme.
func (f *fixture) newReservation(t *testing.T, pool string) string {
	t.Helper()
	return storetest.Reservation(t, f.db, &storetest.ReservationOpts{TenantID: f.acme, PoolID: pool}).ID
}

// newJoinToken makes a join token of pool, of one use for a day.
func (f *fixture) newJoinToken(t *testing.T, pool string) string {
	t.Helper()
	return storetest.JoinToken(t, f.db, &storetest.JoinTokenOpts{PoolID: pool}).ID
}

// newAPIToken makes a tenant-member API token of acme.
func (f *fixture) newAPIToken(t *testing.T) string {
	t.Helper()
	return storetest.APIToken(t, f.db, &storetest.APITokenOpts{TenantID: f.acme, Role: string(iam.RoleTenantMember)}).ID
}

// newCommand makes a queued diag.nvml command of node.
func (f *fixture) newCommand(t *testing.T, node string) string {
	t.Helper()
	return storetest.Command(t, f.db, &storetest.CommandOpts{NodeID: node}).ID
}

// newEvents writes a mark of each tenant (acme's, the other's), then an
// event of each, and returns the first mark's id: at most the newest id of
// either tenant, so that a watch of either (or root) may start after it,
// and gets an event at once.
func (f *fixture) newEvents(t *testing.T) int64 {
	t.Helper()
	from := mark(t, f.db, f.acme)
	mark(t, f.db, f.other)
	insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.cordoned")
	insertEvent(t, f.db, nil, f.db.Now(), f.other, "node.cordoned")
	return from
}

// caller is who makes one call of TestMatrix: column names its subtest, key
// is its token's fixture.tokens key, "" when it has none (secret is then
// empty, or well-formed and never minted).
type caller struct{ column, key, secret string }

// owner returns the tenant and role of the fixture's token key, as the
// audit rows of its calls name them.
func (f *fixture) owner(t *testing.T, key string) (string, iam.Role) {
	t.Helper()
	owners := map[string]struct {
		tenant string
		role   iam.Role
	}{
		"root":         {f.rootTen, iam.RoleRootAdmin},
		"acme-admin":   {f.acme, iam.RoleTenantAdmin},
		"acme-member":  {f.acme, iam.RoleTenantMember},
		"acme-viewer":  {f.acme, iam.RoleViewer},
		"other-admin":  {f.other, iam.RoleTenantAdmin},
		"other-member": {f.other, iam.RoleTenantMember},
		"other-viewer": {f.other, iam.RoleViewer},
	}
	o, ok := owners[key]
	require.True(t, ok, "no token %q in the fixture", key)
	return o.tenant, o.role
}

// newestAudit returns the id of the newest audit row, 0 when there is none.
func (f *fixture) newestAudit(t *testing.T) int64 {
	t.Helper()
	entries, err := store.ListAudit(t.Context(), f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 1})
	require.NoError(t, err)
	if len(entries) == 0 {
		return 0
	}
	return entries[0].ID
}

// auditAfter returns the audit rows newer than id, oldest first (of the
// newest 100: a procedure's database holds one row per call at most).
func (f *fixture) auditAfter(t *testing.T, id int64) []store.AuditEntry {
	t.Helper()
	entries, err := store.ListAudit(t.Context(), f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 100})
	require.NoError(t, err)
	var out []store.AuditEntry
	for _, e := range slices.Backward(entries) {
		if e.ID > id {
			out = append(out, e)
		}
	}
	return out
}

// errMessage returns the message of err, a Connect error.
func errMessage(t *testing.T, err error) string {
	t.Helper()
	var cerr *connect.Error
	require.ErrorAs(t, err, &cerr)
	return cerr.Message()
}

// matrixCall makes one call of row (call: the row's, or its bad one) as who
// on what row.arrange makes for it, checks that it ends with code (and a
// message containing msg), and checks the audit rows it wrote: none for a
// read-only RPC or a call that did not authenticate, one for a mutating one
// with its outcome, its caller and its target. No other call may write to f's
// database meanwhile: the call's rows are those newer than a mark taken
// before it.
func (f *fixture) matrixCall(t *testing.T, row matrixRow, call func(context.Context, clients, subject) error, who caller,
	code connect.Code, msg string) {
	t.Helper()
	s := subject{f: f, who: who.column}
	if row.arrange != nil {
		row.arrange(t, &s)
	}
	from := f.newestAudit(t)
	err := call(t.Context(), f.as(who.secret), s)
	if code == codeOK {
		require.NoError(t, err)
	} else {
		requireCode(t, err, code, msg)
	}
	rule := api.Policy[row.proc]
	var (
		tenant string
		role   iam.Role
	)
	if who.key != "" {
		tenant, role = f.owner(t, who.key)
		if !role.Grants(rule.Permission) {
			// A role without the RPC's permission is refused by the
			// authorization interceptor, before the handler sees the
			// request.
			requireCode(t, err, connect.CodePermissionDenied, fmt.Sprintf("role %s may not call %s (needs %s)", role,
				path.Base(row.proc), rule.Permission))
		}
	}

	entries := f.auditAfter(t, from)
	if !rule.Mutating {
		require.Empty(t, entries, "%s is read-only: no audit rows", row.proc)
		return
	}
	if code == connect.CodeUnauthenticated {
		require.Empty(t, entries, "a call that did not authenticate writes no audit row")
		return
	}
	require.Len(t, entries, 1, "a call of a mutating RPC writes one audit row")
	e := entries[0]
	require.Equal(t, row.proc, e.Procedure)
	require.Equal(t, outcome(code), e.Outcome)
	if code != codeOK {
		require.Equal(t, errMessage(t, err), e.Detail, "a refusal's detail is its message")
	}
	require.Equal(t, tenant, e.TenantID, "the row names the caller's tenant")
	require.Equal(t, string(role), e.Role)
	require.Equal(t, tokenID(t, f.db, who.secret), e.TokenID)
	if who.column == "bad-input" {
		// Its target is whatever the invalid request names.
		return
	}
	// Targets: the resource acted on, as the request names it, or the new
	// one.
	switch {
	case code == codeOK && row.created != "":
		require.NoError(t, ids.Check(row.created, e.Target), "a create's row names the new resource")
	case row.target != nil:
		require.Equal(t, row.target(s), e.Target, "the target comes from the request")
	default:
		require.Equal(t, s.id, e.Target, "the target comes from the request")
	}
	if code == codeOK && row.detail != "" {
		require.Equal(t, row.detail, e.Detail)
	}
}

// TestMatrix calls every public RPC as {no token, bad token, acme viewer,
// acme tenant-member, member of another tenant, admin of another tenant,
// the right role} and with bad input, checking the code of each call and
// the audit rows it wrote: one with its outcome for a mutating RPC, none
// for a read-only one. It fails when an RPC has no row, or a row names a
// procedure that is not served.
//
// Each procedure has a fixture (a database) of its own, and each call
// resources of its own in it (arrange): no call depends on another or on
// the order of the calls. The procedures run in parallel; the calls of one
// run one after another, so that the audit rows newer than a mark taken
// before a call are that call's.
func TestMatrix(t *testing.T) {
	t.Parallel()
	rows := matrixRows()
	served := procedures()
	seen := map[string]bool{}
	for _, row := range rows {
		require.False(t, seen[row.proc], "%s has two rows in the matrix", row.proc)
		seen[row.proc] = true
		require.True(t, slices.Contains(served, row.proc), "the matrix names only served procedures: %s is not one", row.proc)
	}
	for _, proc := range served {
		require.True(t, seen[proc], "%s has no row in the matrix: add one", proc)
	}

	unknown, err := iam.NewSecret(iam.APITokenPrefix) // well-formed, never minted
	require.NoError(t, err)
	type column struct {
		caller
		code func(matrixRow) connect.Code
		msg  string
	}
	unauthenticated := func(matrixRow) connect.Code { return connect.CodeUnauthenticated }
	columns := []column{
		{caller{column: "no-token"}, unauthenticated, "missing bearer token"},
		{caller{column: "bad-token", secret: unknown}, unauthenticated, "api token is not valid"},
		{caller{column: "viewer", key: "acme-viewer"}, func(r matrixRow) connect.Code { return r.viewer }, ""},
		{caller{column: "member", key: "acme-member"}, func(r matrixRow) connect.Code { return r.member }, ""},
		{caller{column: "other-member", key: "other-member"}, func(r matrixRow) connect.Code { return r.otherMember }, ""},
		{caller{column: "other-admin", key: "other-admin"}, func(r matrixRow) connect.Code { return r.otherAdmin }, ""},
		// The right role's key is the row's.
		{caller{column: "right"}, func(matrixRow) connect.Code { return codeOK }, ""},
	}
	for _, row := range rows {
		t.Run(procName(row.proc), func(t *testing.T) {
			t.Parallel()
			// The procedure's own database: its calls alone write to it.
			f := setup(t)
			for _, col := range columns {
				t.Run(col.column, func(t *testing.T) {
					who := col.caller
					if who.column == "right" {
						who.key = row.right
					}
					if who.key != "" {
						who.secret = f.tokens[who.key]
					}
					f.matrixCall(t, row, row.call, who, col.code(row), col.msg)
				})
			}
			if row.bad != nil {
				t.Run("bad-input", func(t *testing.T) {
					who := caller{column: "bad-input", key: "root", secret: f.tokens["root"]}
					f.matrixCall(t, row, row.bad, who, connect.CodeInvalidArgument, row.field+":")
				})
			}
		})
	}
}

// procName returns the short name of procedure proc:
// "/bc.compute.v1.NodeService/GetNode" is "NodeService.GetNode".
func procName(proc string) string {
	svc := path.Dir(proc)
	return svc[strings.LastIndex(svc, ".")+1:] + "." + path.Base(proc)
}

// outcome is the audit outcome of a call expected to end with code.
func outcome(code connect.Code) string {
	if code == codeOK {
		return iam.OutcomeOK
	}
	return code.String()
}

func TestTenants(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	root := f.as(f.tokens["root"])

	res, err := root.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "beta"}))
	require.NoError(t, err)
	beta := res.Msg.Tenant
	require.NoError(t, ids.Check(ids.Tenant, beta.Id))
	require.Equal(t, f.rootTen, beta.ParentId, "under the root tenant by default")
	res, err = root.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "acme-eu", ParentId: f.acme}))
	require.NoError(t, err)
	require.Equal(t, f.acme, res.Msg.Tenant.ParentId)

	_, err = root.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "beta"}))
	requireCode(t, err, connect.CodeAlreadyExists, "name: a tenant with this name already exists")
	_, err = root.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "gamma", ParentId: "ten_missing"}))
	requireCode(t, err, connect.CodeNotFound, "parent_id: tenant ten_missing not found")
	_, err = f.as(f.tokens["acme-admin"]).tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "gamma"}))
	requireCode(t, err, connect.CodePermissionDenied, "role tenant-admin may not call CreateTenant (needs tenants.manage)")

	names := func(who string) []string {
		res, err := f.as(f.tokens[who]).tenants.ListTenants(ctx, connect.NewRequest(&computev1.ListTenantsRequest{}))
		require.NoError(t, err)
		var out []string
		for _, t := range res.Msg.Tenants {
			out = append(out, t.Name)
		}
		return out
	}
	require.Equal(t, []string{"root", "acme", "other", "beta", "acme-eu"}, names("root"))
	require.Equal(t, []string{"acme"}, names("acme-viewer"), "its own tenant only, not its children")
	require.Equal(t, []string{"other"}, names("other-member"))

	// A new tenant starts empty and sees nothing of the others.
	betaAdmin := f.as(apitest.Token(t, f.db, beta.Id, iam.RoleTenantAdmin))
	pools, err := betaAdmin.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
	require.NoError(t, err)
	require.Empty(t, pools.Msg.Pools)
	toks, err := betaAdmin.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{}))
	require.NoError(t, err)
	require.Len(t, toks.Msg.Tokens, 1, "its own token")
}

func TestAPITokens(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	root := f.as(f.tokens["root"])
	before := f.db.Now()

	// A tenant-admin mints a member token of its tenant; the secret works.
	res, err := admin.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "ci",
		Role: "tenant-member", TtlSeconds: 3600}))
	require.NoError(t, err)
	secret, tok := res.Msg.Secret, res.Msg.Token
	require.True(t, strings.HasPrefix(secret, "bct_"), secret)
	_, err = iam.ParseBearer("Bearer " + secret)
	require.NoError(t, err)
	require.Equal(t, f.acme, tok.TenantId)
	require.Equal(t, "tenant-member", tok.Role)
	require.Equal(t, "ci", tok.Name)
	require.WithinDuration(t, before.Add(time.Hour), tok.ExpiresAt.AsTime(), time.Minute)
	stored, err := store.GetAPIToken(ctx, f.db.Pool, store.AllTenants, tok.Id)
	require.NoError(t, err)
	require.Equal(t, iam.HashSecret(secret), stored.Hash, "only the hash is kept")
	member := f.as(secret)
	_, err = member.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
	require.NoError(t, err)
	_, err = member.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{}))
	requireCode(t, err, connect.CodePermissionDenied, "role tenant-member may not call ListTokens (needs iam.manage)")

	// No stronger than the caller, and only in its own tenant.
	_, err = admin.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "x", Role: "root-admin"}))
	requireCode(t, err, connect.CodePermissionDenied, "role: a tenant-admin may not mint root-admin tokens")
	_, err = admin.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "x", Role: "viewer",
		TenantId: f.other}))
	requireCode(t, err, connect.CodeNotFound, "tenant_id: tenant "+f.other+" not found")
	res, err = admin.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "admin2",
		Role: "tenant-admin", TenantId: f.acme}))
	require.NoError(t, err)
	require.Nil(t, res.Msg.Token.ExpiresAt, "no ttl: never expires")

	// Root mints for any tenant, but root-admin tokens only in its own.
	res, err = root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "ops",
		Role: "tenant-admin", TenantId: f.other}))
	require.NoError(t, err)
	require.Equal(t, f.other, res.Msg.Token.TenantId)
	_, err = root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "x", Role: "root-admin",
		TenantId: f.acme}))
	requireCode(t, err, connect.CodeInvalidArgument, "role: root-admin tokens belong to the root tenant")
	res, err = root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "root2", Role: "root-admin"}))
	require.NoError(t, err)
	root2 := res.Msg.Token
	_, err = root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "x", Role: "viewer",
		TenantId: "ten_missing"}))
	requireCode(t, err, connect.CodeNotFound, "tenant_id: tenant ten_missing not found")

	// Lists: a tenant's own tokens, never another's, never a secret.
	list := func(c clients, tenant string) ([]string, error) {
		res, err := c.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{TenantId: tenant}))
		if err != nil {
			return nil, err
		}
		var names []string
		for _, t := range res.Msg.Tokens {
			names = append(names, t.Name)
		}
		return names, nil
	}
	acmeNames := []string{"tenant-admin", "tenant-member", "viewer", "ci", "admin2"}
	got, err := list(admin, "")
	require.NoError(t, err)
	require.Equal(t, acmeNames, got)
	_, err = list(admin, f.other)
	requireCode(t, err, connect.CodeNotFound, "tenant_id: tenant "+f.other+" not found")
	got, err = list(root, "")
	require.NoError(t, err)
	require.Equal(t, []string{"root-admin", "root2"}, got, "root's own tenant by default")
	got, err = list(root, f.acme)
	require.NoError(t, err)
	require.Equal(t, acmeNames, got)
	got, err = list(f.as(f.tokens["other-admin"]), "")
	require.NoError(t, err)
	require.Equal(t, []string{"tenant-admin", "tenant-member", "viewer", "ops"}, got)

	// Revocation: at once, idempotent, another tenant's token is NotFound.
	_, err = f.as(f.tokens["other-admin"]).apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: tok.Id}))
	requireCode(t, err, connect.CodeNotFound, "api token "+tok.Id+" not found")
	rev, err := admin.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: tok.Id}))
	require.NoError(t, err)
	require.NotNil(t, rev.Msg.Token.RevokedAt)
	_, err = member.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
	requireCode(t, err, connect.CodeUnauthenticated, "api token was revoked")
	again, err := admin.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: tok.Id}))
	require.NoError(t, err)
	require.True(t, again.Msg.Token.RevokedAt.AsTime().Equal(rev.Msg.Token.RevokedAt.AsTime()))
	_, err = admin.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: root2.Id}))
	requireCode(t, err, connect.CodeNotFound, "api token "+root2.Id+" not found")
	_, err = admin.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: "tok_missing"}))
	requireCode(t, err, connect.CodeNotFound, "api token tok_missing not found")

	// A tenant-admin of the root tenant may not revoke a root-admin token.
	rootTenantAdmin := f.as(apitest.Token(t, f.db, f.rootTen, iam.RoleTenantAdmin))
	_, err = rootTenantAdmin.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: root2.Id}))
	requireCode(t, err, connect.CodePermissionDenied, "token_id: a tenant-admin may not revoke root-admin tokens")
	_, err = root.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: root2.Id}))
	require.NoError(t, err)
}

// TestAudit checks the rows of successful and refused calls, that a refused
// change leaves no "ok" row behind, and that ListAudit shows a tenant its
// own rows only.
func TestAudit(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	adminTok, err := store.GetAPITokenByHash(ctx, f.db.Pool, iam.HashSecret(f.tokens["acme-admin"]))
	require.NoError(t, err)

	pool, err := admin.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: f.site.ID, Name: "gpu",
		Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}))
	require.NoError(t, err)
	_, err = admin.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: f.site.ID, Name: "gpu",
		Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}))
	requireCode(t, err, connect.CodeAlreadyExists, "name: your tenant already has a pool with this name in the site")
	_, err = f.as("").tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: "jt_x"}))
	requireCode(t, err, connect.CodeUnauthenticated, "missing bearer token") // no row: it names nobody
	_, err = f.as(f.tokens["other-admin"]).tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
		PoolId: f.acmePool, MaxUses: 1, TtlSeconds: 60}))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool "+f.acmePool+" not found")
	// Reads are not audited.
	_, err = admin.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
	require.NoError(t, err)

	entries, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 100})
	require.NoError(t, err)
	require.Len(t, entries, 3)
	created, dup, foreign := entries[2], entries[1], entries[0]
	require.Equal(t, store.AuditEntry{ID: created.ID, At: created.At, TenantID: f.acme, TokenID: adminTok.ID,
		Role: "tenant-admin", Procedure: computev1connect.PoolServiceCreatePoolProcedure, Target: pool.Msg.Pool.Id,
		Outcome: "ok", Detail: "pool gpu in site " + f.site.ID}, created)
	require.WithinDuration(t, f.db.Now(), created.At, time.Minute)
	require.Equal(t, store.AuditEntry{ID: dup.ID, At: dup.At, TenantID: f.acme, TokenID: adminTok.ID,
		Role: "tenant-admin", Procedure: computev1connect.PoolServiceCreatePoolProcedure, Target: "gpu",
		Outcome: "already_exists", Detail: "name: your tenant already has a pool with this name in the site"}, dup,
		"the refused create's row; its transaction's own row rolled back")
	require.Equal(t, f.other, foreign.TenantID)
	require.Equal(t, "not_found", foreign.Outcome)
	require.Equal(t, f.acmePool, foreign.Target)

	// ListAudit: newest first, a tenant's own rows, paged.
	page, err := admin.audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{PageSize: 1}))
	require.NoError(t, err)
	require.Len(t, page.Msg.Entries, 1)
	require.Equal(t, dup.ID, page.Msg.Entries[0].Id)
	require.Equal(t, "already_exists", page.Msg.Entries[0].Outcome)
	require.Equal(t, dup.ID, page.Msg.NextPageToken)
	page, err = admin.audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{PageSize: 1, PageToken: page.Msg.NextPageToken}))
	require.NoError(t, err)
	require.Len(t, page.Msg.Entries, 1)
	e := page.Msg.Entries[0]
	require.Equal(t, created.ID, e.Id)
	require.Equal(t, pool.Msg.Pool.Id, e.Target)
	require.Equal(t, adminTok.ID, e.TokenId)
	require.Equal(t, f.acme, e.TenantId)
	require.Equal(t, "tenant-admin", e.Role)
	require.Equal(t, computev1connect.PoolServiceCreatePoolProcedure, e.Procedure)
	require.True(t, e.At.AsTime().Equal(created.At))
	page, err = admin.audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{PageSize: 1, PageToken: page.Msg.NextPageToken}))
	require.NoError(t, err)
	require.Empty(t, page.Msg.Entries)
	require.Zero(t, page.Msg.NextPageToken)

	other, err := f.as(f.tokens["other-admin"]).audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{}))
	require.NoError(t, err)
	require.Len(t, other.Msg.Entries, 1)
	require.Equal(t, foreign.ID, other.Msg.Entries[0].Id)
	all, err := f.as(f.tokens["root"]).audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{}))
	require.NoError(t, err)
	require.Len(t, all.Msg.Entries, 3, "root sees every tenant's rows")
	require.Zero(t, all.Msg.NextPageToken, "not a full page")
}

// TestAuthenticationBeforeValidation checks that a caller without a valid
// token is told only that, whatever it sent, and writes no audit row, and
// that an authenticated caller's invalid request is audited with who sent
// it.
func TestAuthenticationBeforeValidation(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	for _, tok := range []string{"", "bct_not-a-token"} {
		_, err := f.as(tok).tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: ""}))
		require.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(err), "token %q: %v", tok, err)
	}
	_, err := f.as(f.tokens["acme-admin"]).tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
		PoolId: f.acmePool, MaxUses: 0, TtlSeconds: 60}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	require.Contains(t, err.Error(), "max_uses")
	entries, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 100})
	require.NoError(t, err)
	require.Len(t, entries, 1, "the unauthenticated calls wrote none")
	require.Equal(t, "invalid_argument", entries[0].Outcome)
	require.Equal(t, f.acme, entries[0].TenantID, "the refused call's row names its caller")
	require.Equal(t, "tenant-admin", entries[0].Role)
}

// TestTokenLifetimeAndLastRoot checks that a token never mints one that
// outlives it, and that the last live root-admin token cannot be revoked.
func TestTokenLifetimeAndLastRoot(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	exp := f.db.Now().Add(time.Hour)
	short, _, err := iam.MintAPIToken(ctx, f.db.Pool, f.db.Now(), f.acme, "short", iam.RoleTenantAdmin, &exp)
	require.NoError(t, err)
	c := f.as(short)
	for _, ttl := range []int64{0, 7200} {
		_, err = c.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "forever",
			Role: "tenant-admin", TtlSeconds: ttl}))
		requireCode(t, err, connect.CodeInvalidArgument, "ttl_seconds: a token may not outlive the token that mints it")
	}
	res, err := c.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "ci",
		Role: "viewer", TtlSeconds: 1800}))
	require.NoError(t, err)
	require.NotNil(t, res.Msg.Token.ExpiresAt)

	// Every root-admin token of the fixture but one is revoked; the last
	// one refuses, and a new one makes the old one revocable.
	root := f.as(f.tokens["root"])
	all, err := root.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{}))
	require.NoError(t, err)
	rootTok, err := store.GetAPITokenByHash(ctx, f.db.Pool, iam.HashSecret(f.tokens["root"]))
	require.NoError(t, err)
	for _, tok := range all.Msg.Tokens {
		if tok.Role == "root-admin" && tok.Id != rootTok.ID && tok.RevokedAt == nil {
			_, err := root.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: tok.Id}))
			require.NoError(t, err)
		}
	}
	_, err = root.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: rootTok.ID}))
	requireCode(t, err, connect.CodeFailedPrecondition, "is the last live root-admin token")
	next, err := root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "root-next", Role: "root-admin"}))
	require.NoError(t, err)
	require.Equal(t, "root-admin", next.Msg.Token.Role)
	_, err = root.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: rootTok.ID}))
	require.NoError(t, err)
}

// TestFreeTextRefusesControlCharacters checks that names and reasons that
// end up in tables and the audit log cannot carry control characters.
func TestFreeTextRefusesControlCharacters(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	root := f.as(f.tokens["root"])
	for _, name := range []string{"a\nb", "\x1b[31mRED\x1b[0m"} {
		_, err := root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: name, Role: "viewer"}))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%q: %v", name, err)
		require.Contains(t, err.Error(), "name")
	}
	_, err := root.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: "node_x", Reason: "x\ry"}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	require.Contains(t, err.Error(), "reason")
	_, err = root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "ci bot (nightly) é", Role: "viewer"}))
	require.NoError(t, err)
}

// TestTextRefusesFormatCharacters checks that names, labels and ids refuse
// every format character (Unicode Cf: bidi overrides, zero-width
// characters, the byte-order mark) and line separators, which would make
// one name look like another or reorder a table's line, and that free-text
// reasons refuse the bidi embeddings, overrides and isolates but keep the
// zero-width joiners and marks that scripts such as Persian need.
func TestTextRefusesFormatCharacters(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	root := f.as(f.tokens["root"])
	refused := func(t *testing.T, field string, err error) {
		t.Helper()
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
		require.Contains(t, err.Error(), field)
	}
	for _, c := range []string{"\u202e", "\u202a", "\u2066", "\u2069", "\u200b", "\u200c", "\u200d", "\u200e", "\ufeff", "\u00ad", "\u2028", "\u2029"} {
		t.Run(fmt.Sprintf("U+%04X", []rune(c)[0]), func(t *testing.T) {
			_, err := root.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "ci" + c + "bot", Role: "viewer"}))
			refused(t, "name", err)
			_, err = root.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "site-x", Region: "eu" + c}))
			refused(t, "region", err)
			_, err = f.as(f.tokens["acme-member"]).res.Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: f.acmePool,
				Gpus: 1, Duration: durationpb.New(time.Hour), RequestId: "r" + c}))
			refused(t, "request_id", err)
			_, err = root.commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{NodeId: "node_x", Kind: "diag.nvml",
				RequestId: "r" + c}))
			refused(t, "request_id", err)
		})
	}
	for _, c := range []string{"\u202e", "\u202a", "\u202d", "\u2066", "\u2068", "\u2069", "\u2028"} {
		_, err := root.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: "node_x", Reason: "fan " + c + "dead"}))
		refused(t, "reason", err)
		_, err = root.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: "node_x", Reason: "stolen" + c}))
		refused(t, "reason", err)
	}
	// "I want" in Persian, with its zero-width non-joiner, and a right-to-left mark.
	_, err := root.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: "node_x", Reason: "می\u200cخواهم \u200f"}))
	requireCode(t, err, connect.CodeNotFound, "node_x")
}

// TestValidationNamesTheField checks that a request breaking its proto's
// rules is refused, unary or streaming, with InvalidArgument whose message
// is each violation as "<field>: <reason>" joined by "; ", without
// protovalidate's own "validation error:" wording.
func TestValidationNamesTheField(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	root := f.as(f.tokens["root"])
	message := func(t *testing.T, err error) string {
		t.Helper()
		var cerr *connect.Error
		require.ErrorAs(t, err, &cerr)
		require.Equal(t, connect.CodeInvalidArgument, cerr.Code(), "%v", err)
		return cerr.Message()
	}
	t.Run("one field", func(t *testing.T) {
		t.Parallel()
		_, err := root.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{PoolId: f.acmePool, MaxUses: 0, TtlSeconds: 60}))
		require.Equal(t, "max_uses: must be greater than or equal to 1 and less than or equal to 100000", message(t, err))
	})
	t.Run("two fields", func(t *testing.T) {
		t.Parallel()
		_, err := root.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{PoolId: f.acmePool}))
		require.Equal(t, "max_uses: must be greater than or equal to 1 and less than or equal to 100000; "+
			"ttl_seconds: must be greater than or equal to 1 and less than or equal to 2592000", message(t, err))
	})
	t.Run("custom rule", func(t *testing.T) {
		t.Parallel()
		_, err := root.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: "node_x", Reason: "  "}))
		require.Equal(t, "reason: must not be empty or only spaces", message(t, err))
	})
	t.Run("stream", func(t *testing.T) {
		t.Parallel()
		s := watch(t, root, &computev1.WatchRequest{Types: []string{"node.cordoned", "Bad"}})
		err := <-s.done
		require.Equal(t, `types[1]: does not match regex pattern `+"`^[a-z_]+(\\.[a-z_]+)*(\\.\\*)?$`", message(t, err))
	})
	t.Run("message rule", func(t *testing.T) {
		t.Parallel()
		s := watch(t, root, &computev1.WatchRequest{FromStart: true, AfterId: 3})
		err := <-s.done
		require.Equal(t, "from_start: cannot be combined with a non-zero after_id (from_start replays from the first "+
			"retained event, after_id resumes after an event)", message(t, err))
	})
}
