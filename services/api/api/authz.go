package api

import (
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/iam"
)

// Policy is the authorization of every RPC the API serves: the permission
// the caller's role must hold. Which tenant's resources a caller sees is
// decided by the handlers (own tenant, or all for root-admin). A procedure
// missing here is refused with PermissionDenied, so a new RPC must be added.
//
//	RPC                               permission     roles
//	NodeService.ListNodes, GetNode    fleet.read     any role (own tenant), root-admin (all)
//	PoolService.ListSites, ListPools  fleet.read     any role (own tenant), root-admin (all)
//	PoolService.CreateSite            fleet.manage   root-admin, tenant-admin
//	PoolService.CreatePool            fleet.manage   root-admin, tenant-admin (pool owned by the caller's tenant)
//	JoinTokenService.*                fleet.manage   root-admin, tenant-admin (own tenant's pools)
var Policy = iam.Policy{
	computev1connect.NodeServiceListNodesProcedure: {Permission: iam.PermFleetRead},
	computev1connect.NodeServiceGetNodeProcedure:   {Permission: iam.PermFleetRead},

	computev1connect.PoolServiceCreateSiteProcedure: {Permission: iam.PermFleetManage},
	computev1connect.PoolServiceListSitesProcedure:  {Permission: iam.PermFleetRead},
	computev1connect.PoolServiceCreatePoolProcedure: {Permission: iam.PermFleetManage},
	computev1connect.PoolServiceListPoolsProcedure:  {Permission: iam.PermFleetRead},

	computev1connect.JoinTokenServiceCreateJoinTokenProcedure: {Permission: iam.PermFleetManage},
	computev1connect.JoinTokenServiceListJoinTokensProcedure:  {Permission: iam.PermFleetManage},
	computev1connect.JoinTokenServiceRevokeJoinTokenProcedure: {Permission: iam.PermFleetManage},
}
