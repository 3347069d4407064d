-- The privileges of each service's database role (docs/architecture.md,
-- "Keys and roles"): exactly what the store functions the service calls
-- need, and nothing else. SetupRoles (roles.go) runs this file after
-- revoking everything the roles held on the schema's tables and sequences,
-- so a privilege removed here is removed from the database too.
--
-- Each GRANT names the store functions that need it. The triggers that
-- move nodes.capacity_generation (migration 000021) run as the writer of
-- node_devices or bookings and update nodes: every role that writes those
-- has UPDATE on nodes. Postgres asks for
-- SELECT on a table whose columns a statement reads (a WHERE clause, a
-- join, RETURNING), UPDATE for SELECT ... FOR UPDATE / FOR SHARE and the
-- DO UPDATE of an upsert, UPDATE, DELETE or TRUNCATE for LOCK TABLE, and
-- USAGE on the sequence of a bigserial column to insert a row. Foreign
-- keys and their ON DELETE CASCADE are checked as the tables' owner and
-- need nothing here.
--
-- Every event writer (WriteEvents and the statements that embed
-- eventWriterCTE) inserts into events, and the statements read back the
-- tenant and type of the rows they inserted (RETURNING): that is the
-- "events" pair of grants of each role. Events write no outbox row (their
-- hints are published after the commit).
-- To change what a service may do: change its store calls, then this file;
-- TestRoleGrants (roles_test.go) runs every store function each service
-- calls as its role and fails on a missing grant, or on a store function a
-- service calls that it does not run.

GRANT USAGE ON SCHEMA public TO bc_api, bc_joinservice, bc_gateway, bc_scheduler, bc_controllers;

-- ---------------------------------------------------------------- bc_api --
-- The public API: tenancy, tokens, pools, nodes, commands, reservations,
-- usage, events, audit, tunnels.

-- CreateTenant, GetTenant, ListTenants, TenantScope's reads, CreatePool,
-- UpsertOffer (the tenant must exist).
GRANT SELECT, INSERT ON tenants TO bc_api;
-- iam: MintAPIToken (CreateAPIToken), the authenticator (GetAPITokenByHash,
-- TouchAPIToken); GetAPIToken, ListAPITokens, RevokeAPIToken,
-- CountLiveRootAdminTokens (FOR UPDATE).
GRANT SELECT, INSERT, UPDATE ON api_tokens TO bc_api;
-- CreateSite, GetSite, ListSites, CreatePool.
GRANT SELECT, INSERT ON sites TO bc_api;
-- CreatePool, GetPool, ListPools, and every read of a node's owner.
GRANT SELECT, INSERT ON pools TO bc_api;
-- UpsertOffer (ON CONFLICT DO UPDATE), ListOffers, GetPool, ListPools,
-- CreateReservation (the offer FOR UPDATE: the quota).
GRANT SELECT, INSERT, UPDATE ON pool_offers TO bc_api;
-- CreateJoinToken, ListJoinTokens, RevokeJoinToken.
GRANT SELECT, INSERT, UPDATE ON join_tokens TO bc_api;
-- GetNode, ListNodes; CordonNode, UncordonNode, RevokeNode;
-- EndReservation and FailNodeReservations (the node's spec);
-- QueueCommands (FOR KEY SHARE); NodeTunnelRoute.
GRANT SELECT, UPDATE ON nodes TO bc_api;
-- GetNode, ListNodes (the certificates' expiry); RevokeNode.
GRANT SELECT, UPDATE ON node_certs TO bc_api;
-- GetNode, ListNodes, CreateReservation (the pool's capacity).
GRANT SELECT ON node_devices TO bc_api;
-- QueueCommands, GetCommand, ListCommands; RevokeNode fails the node's
-- open commands.
GRANT SELECT, INSERT, UPDATE ON commands TO bc_api;
-- CreateReservation, GetReservation, ListReservations, EndReservation,
-- FailNodeReservations.
GRANT SELECT, INSERT, UPDATE ON reservations TO bc_api;
-- CreateReservation (capacity), GetReservation, ListReservations;
-- EndReservation and FailNodeReservations end or drop the bookings.
GRANT SELECT, UPDATE, DELETE ON bookings TO bc_api;
-- ListUsage.
GRANT SELECT ON usage_windows TO bc_api;
-- Events: the writers, and ScanEvents, MaxEventID (the events watch).
GRANT SELECT, INSERT ON events TO bc_api;
GRANT USAGE ON SEQUENCE events_id_seq TO bc_api;
-- ScanEvents, MaxEventID, EventRetention: what retention removed.
GRANT SELECT ON event_retention TO bc_api;
-- RevokeAPIToken (the revocation), QueueCommands (the gateways' pokes, their
-- ids by subject), CreateReservation (the scheduler's poke).
GRANT SELECT (id, subject), INSERT ON outbox TO bc_api;
GRANT USAGE ON SEQUENCE outbox_id_seq TO bc_api;
-- iam's audit interceptor and AuditInTx (InsertAudit), QueueCommands, ListAudit.
GRANT SELECT, INSERT ON audit TO bc_api;
GRANT USAGE ON SEQUENCE audit_id_seq TO bc_api;
-- NodeTunnelRoute: the presence of the node's gateway.
GRANT SELECT ON leases TO bc_api;
-- NodeTunnelRoute: the gateway's control URL.
GRANT SELECT ON gateways TO bc_api;
-- CreateTunnelTicket, ConsumeTunnelTicket (FOR UPDATE), TouchTunnel,
-- CloseTunnel.
GRANT SELECT, INSERT, UPDATE ON tunnel_tickets TO bc_api;
-- EndReservation, FailNodeReservations (the CAs of the rebuilt spec).
GRANT SELECT ON ssh_user_cas TO bc_api;

-- -------------------------------------------------------- bc_joinservice --
-- Join: a join token's uses, the nodes it creates and their first
-- certificates; the certificates gateways renew (NodeCertService).

-- CheckJoinToken, LockJoinToken (FOR UPDATE), RecordJoins (the uses).
GRANT SELECT, UPDATE ON join_tokens TO bc_joinservice;
-- GetNode (the pool's owner), RecordJoins (the event's tenant).
GRANT SELECT ON pools TO bc_joinservice;
-- RecordJoins; JoinedKeys and GetNode (a retried join);
-- GetSessionCert, LockSessionCert (a renewal). LockSessionCert locks the
-- node FOR NO KEY UPDATE, which PostgreSQL allows only with UPDATE on a
-- column: updated_at, the one whose change says nothing.
GRANT SELECT, INSERT, UPDATE (updated_at) ON nodes TO bc_joinservice;
-- RecordJoins, CreateNodeCert; GetNode; GetSessionCert,
-- LockSessionCert, LastNodeCertCreatedAt (a renewal).
GRANT SELECT, INSERT ON node_certs TO bc_joinservice;
-- GetNode.
GRANT SELECT ON node_devices TO bc_joinservice;
-- RecordJoins.
GRANT SELECT, INSERT ON events TO bc_joinservice;
GRANT USAGE ON SEQUENCE events_id_seq TO bc_joinservice;
-- RecordJoins (the controllers' poke).
GRANT SELECT (id), INSERT ON outbox TO bc_joinservice;
GRANT USAGE ON SEQUENCE outbox_id_seq TO bc_joinservice;

-- ------------------------------------------------------------ bc_gateway --
-- Sessions: their nodes, commands and desired state, presence. Renewals
-- are JoinService's (NodeCertService).

-- OpenSession, CloseSession, ResetGatewaySessions, RecordSessionLastSeen,
-- RecordSessionObservedGenerations, ClaimSessionDeliveries,
-- PendingSessionWork, GetSessionCert.
GRANT SELECT, UPDATE ON nodes TO bc_gateway;
-- The owner of a node's pool: the tenant of its events
-- (ApplySessionCommandUpdates, RecordSpecRefused, RecordSSHRefused).
GRANT SELECT ON pools TO bc_gateway;
-- GetSessionCert, PendingSessionWork.
GRANT SELECT ON node_certs TO bc_gateway;
-- ClaimSessionDeliveries, PendingSessionWork, ApplySessionCommandUpdates.
GRANT SELECT, UPDATE ON commands TO bc_gateway;
-- ActivateReservation (AllocationBound).
GRANT SELECT, UPDATE ON reservations TO bc_gateway;
-- The writers of events.
GRANT SELECT, INSERT ON events TO bc_gateway;
GRANT USAGE ON SEQUENCE events_id_seq TO bc_gateway;
-- ApplySessionCommandUpdates pokes the controllers.
GRANT SELECT (id), INSERT ON outbox TO bc_gateway;
GRANT USAGE ON SEQUENCE outbox_id_seq TO bc_gateway;
-- RecordGatewayPresence (an upsert of the gateway's presence lease).
GRANT SELECT, INSERT, UPDATE ON leases TO bc_gateway;
-- RegisterGateway (an upsert of its control URL).
GRANT SELECT, INSERT, UPDATE ON gateways TO bc_gateway;

-- ---------------------------------------------------------- bc_scheduler --
-- Placement: pending reservations onto nodes' devices.

-- PendingReservations, SetPendingReasons, PlaceReservationsAt,
-- FailReservations.
GRANT SELECT, UPDATE ON reservations TO bc_scheduler;
-- PoolCapacitySince, PlaceReservationsAt (I1 holds by the exclusion
-- constraint).
GRANT SELECT, INSERT ON bookings TO bc_scheduler;
-- PoolCapacitySince; PlaceReservationsAt rebuilds the nodes' specs (FOR NO
-- KEY UPDATE; the spec generation's move moves capacity_generation).
GRANT SELECT, UPDATE ON nodes TO bc_scheduler;
-- PoolCapacitySince.
GRANT SELECT ON node_devices TO bc_scheduler;
-- PlaceReservationsAt (the CAs of the rebuilt spec).
GRANT SELECT ON ssh_user_cas TO bc_scheduler;
-- The writers of events.
GRANT SELECT, INSERT ON events TO bc_scheduler;
GRANT USAGE ON SEQUENCE events_id_seq TO bc_scheduler;
-- The gateways' pokes (PlaceReservationsAt), the scheduler's own.
GRANT SELECT (id), INSERT ON outbox TO bc_scheduler;
GRANT USAGE ON SEQUENCE outbox_id_seq TO bc_scheduler;
-- lease: TryAcquireLease, ReleaseLease.
GRANT SELECT, INSERT, UPDATE, DELETE ON leases TO bc_scheduler;

-- -------------------------------------------------------- bc_controllers --
-- The reconcilers (acceptance, expiry, usage, liveness, command expiry,
-- joining, SSH CAs, retention) and the outbox relay.

-- ClaimJoiningNodes, MarkNodesAccepting, AdoptNodes, FailAcceptance,
-- SweepUnreachable, SetSSHUserCAs, EndReservation, PokeNodes; ExpireJoiningNodes
-- deletes the nodes that never opened a session; FleetStatsAt counts them.
GRANT SELECT, UPDATE, DELETE ON nodes TO bc_controllers;
-- The owner of a node's pool: AcceptanceChecks, the tenant of events;
-- FleetStatsAt (GPUs per pool).
GRANT SELECT ON pools TO bc_controllers;
-- AdoptNodes and FailAcceptance replace the devices; ExpireJoiningNodes;
-- FleetStatsAt.
GRANT SELECT, INSERT, DELETE ON node_devices TO bc_controllers;
-- ExpireJoiningNodes; DeleteOldNodeCerts (FOR UPDATE SKIP LOCKED: the
-- UPDATE).
GRANT SELECT, UPDATE, DELETE ON node_certs TO bc_controllers;
-- ExpireJoiningNodes gives the token its use back; DeleteOldJoinTokens.
GRANT SELECT, UPDATE, DELETE ON join_tokens TO bc_controllers;
-- QueueAcceptanceCommands, ClaimDueAcceptances, AcceptanceChecks,
-- ExpireCommands, ExpireDueCommands, FleetStatsAt; DeleteOldCommands.
GRANT SELECT, INSERT, UPDATE, DELETE ON commands TO bc_controllers;
-- ClaimDueReservations, EndReservation, FailNeverPlaced, UsageCandidates,
-- WriteUsageWindows, SetSSHUserCAs (the specs it rebuilds), FleetStatsAt;
-- DeleteOldReservations.
GRANT SELECT, UPDATE, DELETE ON reservations TO bc_controllers;
-- EndReservation; UsageCandidates, WriteUsageWindows; FleetStatsAt;
-- DeleteOldReservations.
GRANT SELECT, UPDATE, DELETE ON bookings TO bc_controllers;
-- DeleteOldReservations deletes the reservation's tickets.
GRANT SELECT, DELETE ON tunnel_tickets TO bc_controllers;
-- UsageCandidates, WriteUsageWindows; DeleteOldUsageWindows (FOR UPDATE).
GRANT SELECT, INSERT, UPDATE, DELETE ON usage_windows TO bc_controllers;
-- SetSSHUserCAs (LOCK TABLE, then replaces the rows).
GRANT SELECT, INSERT, DELETE ON ssh_user_cas TO bc_controllers;
-- The writers of events; DeleteOldEvents.
GRANT SELECT, INSERT, DELETE ON events TO bc_controllers;
GRANT USAGE ON SEQUENCE events_id_seq TO bc_controllers;
-- DeleteOldEvents records what it deleted (an upsert).
GRANT SELECT, INSERT, UPDATE ON event_retention TO bc_controllers;
-- DeleteOldAudit.
GRANT SELECT, DELETE ON audit TO bc_controllers;
-- Enqueue, PokeNodes, AdoptNodes; the outbox relay (TakeOutbox)
-- deletes what it publishes, having locked it (FOR UPDATE SKIP LOCKED: the
-- UPDATE); FleetStatsAt reads the backlog.
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO bc_controllers;
GRANT USAGE ON SEQUENCE outbox_id_seq TO bc_controllers;
-- The outbox relay sets aside a row NATS can never take (DeadLetterOutbox).
GRANT INSERT ON outbox_dead_letters TO bc_controllers;
GRANT USAGE ON SEQUENCE outbox_dead_letters_id_seq TO bc_controllers;
-- lease: TryAcquireLease, ReleaseLease; SweepUnreachable reads the
-- gateways' presence.
GRANT SELECT, INSERT, UPDATE, DELETE ON leases TO bc_controllers;
