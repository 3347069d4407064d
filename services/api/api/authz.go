package api

import (
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/iam"
)

// Policy is the authorization of every RPC the API serves: the permission
// the caller's role must hold (pkg/iam's rolePermissions says which roles
// hold it), whether the RPC mutates (and is audited), and the request field
// naming its target for the audit log. Which tenant's resources a caller
// reaches is its scope (iam.Principal.Scope): its own tenant's, or every
// tenant's for root-admin. Handlers pass that scope to the store, whose
// queries apply it; another tenant's resource reads as NotFound. A procedure
// missing here is refused with PermissionDenied, so a new RPC must be added
// (TestPolicyCoversEveryProcedure and the matrix test fail until it is).
//
// Sites are places shared by every tenant: any role reads all of them, only
// root-admin creates them (sites.manage). Pools, nodes, join tokens, API
// tokens, reservations, usage and audit rows belong to a tenant. A pool's
// owner offers it to tenants (its own included); a tenant reserves only in
// pools offered to it. A tenant sees the pools it owns and those offered to
// it (pools list, offers, reserve); a pool it neither owns nor was offered
// reads as NotFound, in the words of a missing pool, in every RPC that
// names one. Its owner's business (offering it, its join tokens, its nodes)
// stays the owner's: PermissionDenied for a pool the caller was offered,
// and it lists none of its nodes. Reserving in a pool the caller sees but
// was not offered (its own, or any for root-admin) is PermissionDenied.
//
//	RPC                                    permission          roles                        audited
//	NodeService.ListNodes, GetNode         fleet.read          any (own tenant), root       no
//	NodeService.RevokeNode                 fleet.manage        tenant-admin (own), root     yes (node_id)
//	NodeService.CordonNode, UncordonNode   fleet.manage        tenant-admin (own), root     yes (node_id)
//	PoolService.ListSites                  fleet.read          any (all sites)              no
//	PoolService.CreateSite                 sites.manage        root                         yes (name)
//	PoolService.ListPools                  fleet.read          any (owned or offered), root no
//	PoolService.CreatePool                 fleet.manage        tenant-admin (own), root     yes (name)
//	PoolService.OfferPool                  fleet.manage        tenant-admin (own to own),   yes (pool_id)
//	                                                           root
//	PoolService.ListOffers                 fleet.read          any (to or of own), root     no
//	ReservationService.Reserve             reservations.write  tenant-member+ (offered)     yes (pool_id)
//	ReservationService.GetReservation      reservations.read   any (own tenant), root       no
//	ReservationService.ListReservations    reservations.read   any (own tenant), root       no
//	ReservationService.ReleaseReservation  reservations.write  tenant-member+ (own), root   yes (reservation_id)
//	UsageService.ListUsage                 usage.read          any (own tenant), root       no
//	JoinTokenService.CreateJoinToken       fleet.manage        tenant-admin (own), root     yes (pool_id)
//	JoinTokenService.ListJoinTokens        fleet.manage        tenant-admin (own), root     no
//	JoinTokenService.RevokeJoinToken       fleet.manage        tenant-admin (own), root     yes (join_token_id)
//	TenantService.CreateTenant             tenants.manage      root                         yes (name)
//	TenantService.ListTenants              tenants.read        any (own tenant), root       no
//	TokenService.CreateToken               iam.manage          tenant-admin (own), root     yes (tenant_id)
//	TokenService.ListTokens                iam.manage          tenant-admin (own), root     no
//	TokenService.RevokeToken               iam.manage          tenant-admin (own), root     yes (token_id)
//	AuditService.ListAudit                 audit.read          tenant-admin (own), root     no
//	CommandService.RunCommand              commands.run        tenant-admin (own), root     yes (node_id)
//	CommandService.GetCommand              commands.read       any (own tenant), root       no
//	CommandService.ListCommands            commands.read       any (own tenant), root       no
//	EventService.Watch                     events.read         any (own tenant), root       no
//	TunnelService.CreateTicket             reservations.write  see below                    yes (node_id)
//	TunnelService.IssueSshCertificate      reservations.write  see below                    yes (node_id)
//
// TunnelService's two RPCs admit tenant-member and stronger here; the
// handler then asks for more (checkAccess, tunnels.go): a shell and
// break-glass SSH (no reservation_id) need nodes.access (tenant-admin of the
// node's tenant, root-admin), sandbox SSH (reservation_id) a reservation of
// the caller's tenant active on the node. The tunnel each ticket opens is
// authorized again, in the same words, while it is open (tunnel_ws.go).
var Policy = iam.Policy{
	computev1connect.NodeServiceListNodesProcedure:    {Permission: iam.PermFleetRead},
	computev1connect.NodeServiceGetNodeProcedure:      {Permission: iam.PermFleetRead},
	computev1connect.NodeServiceRevokeNodeProcedure:   {Permission: iam.PermFleetManage, Mutating: true, Target: "node_id"},
	computev1connect.NodeServiceCordonNodeProcedure:   {Permission: iam.PermFleetManage, Mutating: true, Target: "node_id"},
	computev1connect.NodeServiceUncordonNodeProcedure: {Permission: iam.PermFleetManage, Mutating: true, Target: "node_id"},

	computev1connect.PoolServiceCreateSiteProcedure: {Permission: iam.PermSitesManage, Mutating: true, Target: "name"},
	computev1connect.PoolServiceListSitesProcedure:  {Permission: iam.PermFleetRead},
	computev1connect.PoolServiceCreatePoolProcedure: {Permission: iam.PermFleetManage, Mutating: true, Target: "name"},
	computev1connect.PoolServiceListPoolsProcedure:  {Permission: iam.PermFleetRead},
	computev1connect.PoolServiceOfferPoolProcedure:  {Permission: iam.PermFleetManage, Mutating: true, Target: "pool_id"},
	computev1connect.PoolServiceListOffersProcedure: {Permission: iam.PermFleetRead},

	computev1connect.ReservationServiceReserveProcedure:          {Permission: iam.PermReservationsWrite, Mutating: true, Target: "pool_id"},
	computev1connect.ReservationServiceGetReservationProcedure:   {Permission: iam.PermReservationsRead},
	computev1connect.ReservationServiceListReservationsProcedure: {Permission: iam.PermReservationsRead},
	computev1connect.ReservationServiceReleaseReservationProcedure: {Permission: iam.PermReservationsWrite, Mutating: true,
		Target: "reservation_id"},

	computev1connect.UsageServiceListUsageProcedure: {Permission: iam.PermUsageRead},

	computev1connect.JoinTokenServiceCreateJoinTokenProcedure: {Permission: iam.PermFleetManage, Mutating: true, Target: "pool_id"},
	computev1connect.JoinTokenServiceListJoinTokensProcedure:  {Permission: iam.PermFleetManage},
	computev1connect.JoinTokenServiceRevokeJoinTokenProcedure: {Permission: iam.PermFleetManage, Mutating: true, Target: "join_token_id"},

	computev1connect.TenantServiceCreateTenantProcedure: {Permission: iam.PermTenantsManage, Mutating: true, Target: "name"},
	computev1connect.TenantServiceListTenantsProcedure:  {Permission: iam.PermTenantsRead},

	computev1connect.TokenServiceCreateTokenProcedure: {Permission: iam.PermIAMManage, Mutating: true, Target: "tenant_id"},
	computev1connect.TokenServiceListTokensProcedure:  {Permission: iam.PermIAMManage},
	computev1connect.TokenServiceRevokeTokenProcedure: {Permission: iam.PermIAMManage, Mutating: true, Target: "token_id"},

	computev1connect.AuditServiceListAuditProcedure: {Permission: iam.PermAuditRead},

	computev1connect.CommandServiceRunCommandProcedure:   {Permission: iam.PermCommandsRun, Mutating: true, Target: "node_id"},
	computev1connect.CommandServiceGetCommandProcedure:   {Permission: iam.PermCommandsRead},
	computev1connect.CommandServiceListCommandsProcedure: {Permission: iam.PermCommandsRead},

	computev1connect.EventServiceWatchProcedure: {Permission: iam.PermEventsRead},

	computev1connect.TunnelServiceCreateTicketProcedure: {Permission: iam.PermReservationsWrite, Mutating: true, Target: "node_id"},
	computev1connect.TunnelServiceIssueSshCertificateProcedure: {Permission: iam.PermReservationsWrite, Mutating: true,
		Target: "node_id"},
}
