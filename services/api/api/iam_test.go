package api_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
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

// matrixRow is the expected outcome of one RPC for each kind of caller. Every
// call acts on acme's resources (its pool, node, join token, API token).
type matrixRow struct {
	// call makes the request as c; who ("viewer", "other-member", …) keeps
	// the names of creates apart, so that each create is a new one.
	call func(c clients, who string) error
	// viewer is acme's viewer; otherMember and otherAdmin are a
	// tenant-member and tenant-admin of another tenant.
	viewer, otherMember, otherAdmin connect.Code
	// right is the token (fixture.tokens key) with the role the RPC needs.
	right string
	// bad makes the call with an invalid field (nil: the request has none),
	// refused with InvalidArgument naming field even for root.
	bad   func(c clients) error
	field string
}

// TestMatrix calls every public RPC as {no token, bad token, acme viewer,
// member of another tenant, admin of another tenant, the right role} and with
// bad input, checking the code of each; then checks that each call of a
// mutating RPC wrote exactly one audit row with its outcome, and read-only
// RPCs none. It fails when an RPC has no row.
func TestMatrix(t *testing.T) {
	f := setup(t)
	ctx := t.Context()
	acmeNode := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})
	// acmeRevokedNode is RevokeNode's: the rows run in map order, and a
	// revoked node cannot be cordoned.
	acmeRevokedNode := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})
	now := f.db.Now()
	acmeJoinToken := ids.New(ids.JoinToken, now)
	require.NoError(t, store.CreateJoinToken(ctx, f.db.Pool, store.AllTenants, store.JoinToken{ID: acmeJoinToken, PoolID: f.acmePool,
		Hash: iam.HashSecret(acmeJoinToken), MaxUses: 1, ExpiresAt: now.Add(time.Hour), CreatedAt: now}))
	_, victim, err := iam.MintAPIToken(ctx, f.db.Pool, now, f.acme, "victim", iam.RoleTenantMember, nil)
	require.NoError(t, err)
	// acme's pool is offered to acme, which holds a reservation in it.
	f.node(t, f.acmePool, 8, "H100", adopted)
	_, err = store.UpsertOffer(ctx, f.db.Pool, store.AllTenants, store.Offer{PoolID: f.acmePool, TenantID: f.acme, GPUQuota: 1000, UpdatedAt: now})
	require.NoError(t, err)
	acmeRes := f.reservation(t, f.acme, f.acmePool, 1, "")
	// acmeCmdNode runs commands; acmeCmd is one of its commands.
	acmeCmdNode := f.node(t, f.acmePool, 1, "H100", adopted)
	acmeCmd := ids.New(ids.Command, now)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.QueueCommand(ctx, tx, nil, now, store.NewCommand{Scope: store.AllTenants, ID: acmeCmd, NodeID: acmeCmdNode,
			Kind: store.CommandDiagNVML, Deadline: now.Add(time.Minute)})
		return err
	}))
	// An event of each tenant after watchFrom, so that every caller's
	// watch gets one at once.
	watchFrom := mark(t, f.db)
	insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	insertEvent(t, f.db, nil, now, f.other, "node.cordoned")
	long := strings.Repeat("x", 65)
	pd, nf := connect.CodePermissionDenied, connect.CodeNotFound

	rows := map[string]matrixRow{
		computev1connect.NodeServiceListNodesProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: f.acmePool}))
				return err
			},
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PageSize: 10001}))
				return err
			}, field: "page_size",
		},
		computev1connect.NodeServiceGetNodeProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: acmeNode}))
				return err
			},
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.nodes.GetNode(ctx, connect.NewRequest(&computev1.GetNodeRequest{NodeId: long}))
				return err
			}, field: "node_id",
		},
		computev1connect.NodeServiceRevokeNodeProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: acmeRevokedNode, Reason: "matrix"}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{}))
				return err
			}, field: "node_id",
		},
		computev1connect.NodeServiceCordonNodeProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: acmeNode, Reason: "matrix"}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.nodes.CordonNode(ctx, connect.NewRequest(&computev1.CordonNodeRequest{NodeId: acmeNode}))
				return err
			}, field: "reason",
		},
		computev1connect.NodeServiceUncordonNodeProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.nodes.UncordonNode(ctx, connect.NewRequest(&computev1.UncordonNodeRequest{NodeId: acmeNode}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.nodes.UncordonNode(ctx, connect.NewRequest(&computev1.UncordonNodeRequest{}))
				return err
			}, field: "node_id",
		},
		computev1connect.PoolServiceCreateSiteProcedure: {
			call: func(c clients, who string) error {
				_, err := c.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "site-" + who, Region: "eu"}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: pd, right: "root",
			bad: func(c clients) error {
				_, err := c.pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: "-bad-", Region: "eu"}))
				return err
			}, field: "name",
		},
		computev1connect.PoolServiceListSitesProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.pools.ListSites(ctx, connect.NewRequest(&computev1.ListSitesRequest{}))
				return err
			},
			viewer: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
		},
		computev1connect.PoolServiceCreatePoolProcedure: {
			call: func(c clients, who string) error {
				_, err := c.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: f.site.ID,
					Name: "pool-" + who, Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml"}}))
				return err
			},
			// Another tenant's admin creates a pool of its own tenant.
			viewer: pd, otherMember: pd, otherAdmin: codeOK, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{SiteId: f.site.ID,
					Name: "p", Kind: "metal-host", Acceptance: &computev1.Acceptance{Check: "diag.nvml", GpuModel: long}}))
				return err
			}, field: "acceptance.gpu_model",
		},
		computev1connect.PoolServiceListPoolsProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{SiteId: f.site.ID}))
				return err
			},
			viewer: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{SiteId: long}))
				return err
			}, field: "site_id",
		},
		computev1connect.PoolServiceOfferPoolProcedure: {
			call: func(c clients, _ string) error {
				// acme re-offers its pool to itself: an offer to the other
				// tenant would let it Reserve (rows run in any order).
				_, err := c.pools.OfferPool(ctx, connect.NewRequest(&computev1.OfferPoolRequest{PoolId: f.acmePool,
					TenantId: f.acme, GpuQuota: 1000}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.pools.OfferPool(ctx, connect.NewRequest(&computev1.OfferPoolRequest{PoolId: f.acmePool,
					TenantId: f.other, GpuQuota: -1}))
				return err
			}, field: "gpu_quota",
		},
		computev1connect.PoolServiceListOffersProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: f.acmePool}))
				return err
			},
			// Acme's pool is not offered to other tenants: it reads as a
			// missing one.
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: long}))
				return err
			}, field: "pool_id",
		},
		computev1connect.ReservationServiceReserveProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.res.Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 1,
					Duration: durationpb.New(time.Hour)}))
				return err
			},
			// acme's pool is not offered to the other tenant: to it, the
			// pool does not exist.
			viewer: pd, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.res.Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 0,
					Duration: durationpb.New(time.Hour)}))
				return err
			}, field: "gpus",
		},
		computev1connect.ReservationServiceGetReservationProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: acmeRes}))
				return err
			},
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{}))
				return err
			}, field: "reservation_id",
		},
		computev1connect.ReservationServiceListReservationsProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.res.ListReservations(ctx, connect.NewRequest(&computev1.ListReservationsRequest{PoolId: f.acmePool}))
				return err
			},
			// acme's pool is not offered to other: it reads as missing.
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.res.ListReservations(ctx, connect.NewRequest(&computev1.ListReservationsRequest{State: "running"}))
				return err
			}, field: "state",
		},
		computev1connect.ReservationServiceReleaseReservationProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: acmeRes}))
				return err
			},
			viewer: pd, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{}))
				return err
			}, field: "reservation_id",
		},
		computev1connect.UsageServiceListUsageProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.usage.ListUsage(ctx, connect.NewRequest(&computev1.ListUsageRequest{TenantId: f.acme}))
				return err
			},
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.usage.ListUsage(ctx, connect.NewRequest(&computev1.ListUsageRequest{PageSize: 10001}))
				return err
			}, field: "page_size",
		},
		computev1connect.JoinTokenServiceCreateJoinTokenProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
					PoolId: f.acmePool, MaxUses: 1, TtlSeconds: 60}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
					PoolId: f.acmePool, MaxUses: 100001, TtlSeconds: 60}))
				return err
			}, field: "max_uses",
		},
		computev1connect.JoinTokenServiceListJoinTokensProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{PoolId: f.acmePool}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.tokens.ListJoinTokens(ctx, connect.NewRequest(&computev1.ListJoinTokensRequest{PoolId: long}))
				return err
			}, field: "pool_id",
		},
		computev1connect.JoinTokenServiceRevokeJoinTokenProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{JoinTokenId: acmeJoinToken}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.tokens.RevokeJoinToken(ctx, connect.NewRequest(&computev1.RevokeJoinTokenRequest{}))
				return err
			}, field: "join_token_id",
		},
		computev1connect.TenantServiceCreateTenantProcedure: {
			call: func(c clients, who string) error {
				_, err := c.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "tenant-" + who}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: pd, right: "root",
			bad: func(c clients) error {
				_, err := c.tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: "Bad Name"}))
				return err
			}, field: "name",
		},
		computev1connect.TenantServiceListTenantsProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.tenants.ListTenants(ctx, connect.NewRequest(&computev1.ListTenantsRequest{}))
				return err
			},
			viewer: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
		},
		computev1connect.TokenServiceCreateTokenProcedure: {
			call: func(c clients, who string) error {
				_, err := c.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{TenantId: f.acme,
					Name: "by-" + who, Role: string(iam.RoleViewer)}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.apiTokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{Name: "x", Role: "god"}))
				return err
			}, field: "role",
		},
		computev1connect.TokenServiceListTokensProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{TenantId: f.acme}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.apiTokens.ListTokens(ctx, connect.NewRequest(&computev1.ListTokensRequest{TenantId: long}))
				return err
			}, field: "tenant_id",
		},
		computev1connect.TokenServiceRevokeTokenProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{TokenId: victim.ID}))
				return err
			},
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.apiTokens.RevokeToken(ctx, connect.NewRequest(&computev1.RevokeTokenRequest{}))
				return err
			}, field: "token_id",
		},
		computev1connect.CommandServiceRunCommandProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{NodeId: acmeCmdNode,
					Kind: "diag.nvml"}))
				return err
			},
			// Running commands (node.reboot among them) is an operator action.
			viewer: pd, otherMember: pd, otherAdmin: nf, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{NodeId: acmeCmdNode,
					Kind: "rm -rf"}))
				return err
			}, field: "kind",
		},
		computev1connect.CommandServiceGetCommandProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{CommandId: acmeCmd}))
				return err
			},
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.commands.GetCommand(ctx, connect.NewRequest(&computev1.GetCommandRequest{}))
				return err
			}, field: "command_id",
		},
		computev1connect.CommandServiceListCommandsProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.commands.ListCommands(ctx, connect.NewRequest(&computev1.ListCommandsRequest{NodeId: acmeCmdNode}))
				return err
			},
			viewer: codeOK, otherMember: nf, otherAdmin: nf, right: "acme-member",
			bad: func(c clients) error {
				_, err := c.commands.ListCommands(ctx, connect.NewRequest(&computev1.ListCommandsRequest{PageSize: 10001}))
				return err
			}, field: "page_size",
		},
		computev1connect.AuditServiceListAuditProcedure: {
			call: func(c clients, _ string) error {
				_, err := c.audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{}))
				return err
			},
			// Another tenant's admin reads its own tenant's log.
			viewer: pd, otherMember: pd, otherAdmin: codeOK, right: "acme-admin",
			bad: func(c clients) error {
				_, err := c.audit.ListAudit(ctx, connect.NewRequest(&computev1.ListAuditRequest{PageSize: 1001}))
				return err
			}, field: "page_size",
		},
		computev1connect.EventServiceWatchProcedure: {
			// A server stream: the call succeeds when the first event
			// arrives (every caller's tenant has one after watchFrom).
			call: func(c clients, _ string) error {
				return firstEvent(ctx, c, &computev1.WatchRequest{AfterId: watchFrom})
			},
			// Every tenant watches its own events.
			viewer: codeOK, otherMember: codeOK, otherAdmin: codeOK, right: "acme-member",
			bad: func(c clients) error {
				return firstEvent(ctx, c, &computev1.WatchRequest{Types: []string{"node.*", "Node.*"}})
			}, field: "types[1]",
		},
	}
	for _, proc := range procedures() {
		_, ok := rows[proc]
		require.True(t, ok, "%s has no row in the matrix: add one", proc)
	}
	require.Len(t, rows, len(procedures()), "the matrix names only served procedures")

	unknown, err := iam.NewSecret(iam.APITokenPrefix) // well-formed, never minted
	require.NoError(t, err)
	type column struct {
		who   string
		token string
		code  func(matrixRow) connect.Code
		msg   string
	}
	columns := []column{
		{"no-token", "", func(matrixRow) connect.Code { return connect.CodeUnauthenticated }, "missing bearer token"},
		{"bad-token", unknown, func(matrixRow) connect.Code { return connect.CodeUnauthenticated }, "api token is not valid"},
		{"viewer", f.tokens["acme-viewer"], func(r matrixRow) connect.Code { return r.viewer }, ""},
		{"other-member", f.tokens["other-member"], func(r matrixRow) connect.Code { return r.otherMember }, ""},
		{"other-admin", f.tokens["other-admin"], func(r matrixRow) connect.Code { return r.otherAdmin }, ""},
		{"right", "", func(matrixRow) connect.Code { return codeOK }, ""},
	}
	// want is the audit outcomes each mutating procedure should have written,
	// in order.
	want := map[string][]string{}
	for proc, row := range rows {
		t.Run(proc[strings.LastIndex(proc, ".")+1:], func(t *testing.T) {
			for _, col := range columns {
				token := col.token
				if col.who == "right" {
					token = f.tokens[row.right]
				}
				code := col.code(row)
				err := row.call(f.as(token), col.who)
				if code == codeOK {
					require.NoError(t, err, "%s as %s", proc, col.who)
				} else {
					requireCode(t, err, code, col.msg)
				}
				want[proc] = append(want[proc], outcome(code))
			}
			if row.bad != nil {
				requireCode(t, row.bad(f.as(f.tokens["root"])), connect.CodeInvalidArgument, row.field+":")
				want[proc] = append(want[proc], outcome(connect.CodeInvalidArgument))
			}
		})
	}

	// One audit row per call of a mutating RPC, in call order; none for
	// reads.
	entries, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 1000})
	require.NoError(t, err)
	got := map[string][]store.AuditEntry{}
	for _, e := range slices.Backward(entries) {
		got[e.Procedure] = append(got[e.Procedure], e)
	}
	for proc := range rows {
		if !api.Policy[proc].Mutating {
			require.Empty(t, got[proc], "%s is read-only: no audit rows", proc)
			continue
		}
		var outcomes []string
		for _, e := range got[proc] {
			outcomes = append(outcomes, e.Outcome)
		}
		require.Equal(t, want[proc], outcomes, "%s: audit outcomes", proc)
		rs := got[proc]
		require.Empty(t, rs[0].TenantID+rs[0].TokenID+rs[0].Role, "%s: an unauthenticated caller is nobody", proc)
		require.Equal(t, "missing bearer token: set the Authorization header to \"Bearer <api token>\"", rs[0].Detail)
		require.Equal(t, f.acme, rs[2].TenantID, "%s: the viewer's refusal names it", proc)
		require.Equal(t, string(iam.RoleViewer), rs[2].Role)
		require.NotEmpty(t, rs[2].TokenID)
		require.Equal(t, f.other, rs[3].TenantID)
		require.Equal(t, string(iam.RoleTenantMember), rs[3].Role)
		require.Equal(t, "ok", rs[5].Outcome)
		require.NotEmpty(t, rs[5].Target, "%s: a success names its target", proc)
	}
	// Targets: the resource acted on, or the new one.
	revoke := got[computev1connect.TokenServiceRevokeTokenProcedure]
	require.Equal(t, victim.ID, revoke[2].Target, "a refusal's target comes from the request")
	require.Equal(t, victim.ID, revoke[5].Target)
	require.Equal(t, "revoked", revoke[5].Detail)
	require.Equal(t, acmeRevokedNode, got[computev1connect.NodeServiceRevokeNodeProcedure][5].Target)
	require.NoError(t, ids.Check(ids.APIToken, got[computev1connect.TokenServiceCreateTokenProcedure][5].Target))
	require.NoError(t, ids.Check(ids.Tenant, got[computev1connect.TenantServiceCreateTenantProcedure][5].Target))
	require.Equal(t, "tenant-viewer", got[computev1connect.TenantServiceCreateTenantProcedure][2].Target)
	require.Equal(t, acmeJoinToken, got[computev1connect.JoinTokenServiceRevokeJoinTokenProcedure][4].Target)
	require.Equal(t, acmeRes, got[computev1connect.ReservationServiceReleaseReservationProcedure][5].Target)
	require.Equal(t, f.acmePool, got[computev1connect.ReservationServiceReserveProcedure][3].Target)
	require.NoError(t, ids.Check(ids.Reservation, got[computev1connect.ReservationServiceReserveProcedure][5].Target),
		"a reservation's audit row names the new reservation")
	require.Equal(t, f.acmePool, got[computev1connect.PoolServiceOfferPoolProcedure][5].Target)
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
	requireCode(t, err, connect.CodeUnauthenticated, "missing bearer token")
	_, err = f.as(f.tokens["other-admin"]).tokens.CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
		PoolId: f.acmePool, MaxUses: 1, TtlSeconds: 60}))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool "+f.acmePool+" not found")
	// Reads are not audited.
	_, err = admin.pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{}))
	require.NoError(t, err)

	entries, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 100})
	require.NoError(t, err)
	require.Len(t, entries, 4)
	created, dup, anon, foreign := entries[3], entries[2], entries[1], entries[0]
	require.Equal(t, store.AuditEntry{ID: created.ID, At: created.At, TenantID: f.acme, TokenID: adminTok.ID,
		Role: "tenant-admin", Procedure: computev1connect.PoolServiceCreatePoolProcedure, Target: pool.Msg.Pool.Id,
		Outcome: "ok", Detail: "pool gpu in site " + f.site.ID}, created)
	require.WithinDuration(t, f.db.Now(), created.At, time.Minute)
	require.Equal(t, store.AuditEntry{ID: dup.ID, At: dup.At, TenantID: f.acme, TokenID: adminTok.ID,
		Role: "tenant-admin", Procedure: computev1connect.PoolServiceCreatePoolProcedure, Target: "gpu",
		Outcome: "already_exists", Detail: "name: your tenant already has a pool with this name in the site"}, dup,
		"the refused create's row; its transaction's own row rolled back")
	require.Equal(t, store.AuditEntry{ID: anon.ID, At: anon.At, Procedure: computev1connect.JoinTokenServiceRevokeJoinTokenProcedure,
		Target: "", Outcome: "unauthenticated",
		Detail: "missing bearer token: set the Authorization header to \"Bearer <api token>\""}, anon)
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
	require.Len(t, all.Msg.Entries, 4, "root sees every row, unauthenticated calls included")
	require.Zero(t, all.Msg.NextPageToken, "not a full page")
}

// TestAuthenticationBeforeValidation checks that a caller without a valid
// token is told only that, whatever it sent, and that an authenticated
// caller's invalid request is audited with who sent it.
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
	require.Len(t, entries, 3)
	require.Equal(t, "invalid_argument", entries[0].Outcome)
	require.Equal(t, f.acme, entries[0].TenantID, "the refused call's row names its caller")
	require.Equal(t, "tenant-admin", entries[0].Role)
	for _, e := range entries[1:] {
		require.Equal(t, "unauthenticated", e.Outcome)
		require.Empty(t, e.Target, "an unauthenticated caller's target is not recorded")
	}
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
