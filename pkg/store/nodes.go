package store

// Nodes (docs/architecture.md, "Acceptance and adoption"): created by
// JoinService, read with their GPUs, cordoned and uncordoned. Acceptance
// moves them on (acceptance.go), sessions keep them reachable (sessions.go,
// liveness.go), revocation ends them (trust.go).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// Provision states of a node (nodes.provision_state).
const (
	NodeJoining          = "joining"
	NodeAccepting        = "accepting"
	NodeAdopted          = "adopted"
	NodeAcceptanceFailed = "acceptance_failed"
)

// Node is a row of nodes as the API shows it, with its devices and its
// pool's owner.
type Node struct {
	ID          string
	PoolID      string
	JoinTokenID string
	// ProvisionState is NodeJoining, NodeAccepting, NodeAdopted or
	// NodeAcceptanceFailed.
	ProvisionState string
	// ProvisionReason says why acceptance failed.
	ProvisionReason string
	Hostname        string
	MachineID       string
	Variant         string
	AgentVersion    string
	Cordoned        bool
	CordonReason    string
	Reachable       bool
	// GatewayID is the gateway holding the live session, empty without one.
	GatewayID string
	// SessionID is the live session's id, empty without one.
	SessionID          string
	SessionEpoch       int64
	BootID             string
	LastSeen           *time.Time
	SpecGeneration     int64
	ObservedGeneration int64
	AdoptedAt          *time.Time
	CreatedAt          time.Time
	UpdatedAt          time.Time
	// PoolOwnerTenantID is the tenant owning the node's pool.
	PoolOwnerTenantID string
	// RevokedAt is when the node was revoked (RevokeNode), nil if never.
	RevokedAt *time.Time
	// RevokeReason is the reason the first revocation gave, "" when it gave
	// none or the node is not revoked.
	RevokeReason string
	// CertNotAfter is when the node's newest certificate expires, nil when
	// it has none.
	CertNotAfter *time.Time
	// Devices are the node's GPUs (node_devices) ordered by index; filled
	// by GetNode and ListNodes.
	Devices []NodeDevice
}

// NodeDevice is a row of node_devices: one GPU of a node.
type NodeDevice struct {
	NodeID      string
	Index       int32
	UUID        string
	Model       string
	MemoryBytes int64
	Healthy     bool
}

// NewNode is what JoinService records about a machine that joins.
type NewNode struct {
	ID          string
	PoolID      string
	JoinTokenID string
	// Claims the machine made about itself.
	Hostname     string
	MachineID    string
	Variant      string
	AgentVersion string
	CreatedAt    time.Time
}

// CreateNode inserts a node in state NodeJoining.
func CreateNode(ctx context.Context, q DBTX, n NewNode) error {
	_, err := q.Exec(ctx, `INSERT INTO nodes (id, pool_id, join_token_id, provision_state, hostname, machine_id,
		variant, agent_version, created_at, updated_at) VALUES ($1, $2, NULLIF($3, ''), $4, $5, $6, $7, $8, $9, $9)`,
		n.ID, n.PoolID, n.JoinTokenID, NodeJoining, n.Hostname, n.MachineID, n.Variant, n.AgentVersion, n.CreatedAt)
	if err != nil {
		return queryErr(fmt.Sprintf("create node %s", n.ID), err)
	}
	return nil
}

// ConstraintNodeJoinKey makes a public key join as one node at most
// (nodes.join_key_sha256), for IsConstraint.
const ConstraintNodeJoinKey = "nodes_join_key"

// CreateJoinedNodes inserts the nodes of a batch of joins (state
// NodeJoining) and their certificates, nodes[i] with certs[i] (whose public
// key becomes the node's join key), in two statements whatever the batch's
// size. Errors: ErrConflict when an id or serial exists, or a key joined
// already (ConstraintNodeJoinKey: a concurrent Join with the same key
// committed first; retried, the Join finds that node), ErrNotFound-like
// foreign key errors for a missing pool.
func CreateJoinedNodes(ctx context.Context, q DBTX, nodes []NewNode, certs []NewNodeCert) error {
	if len(nodes) != len(certs) {
		return fmt.Errorf("create joined nodes: %d nodes but %d certificates", len(nodes), len(certs))
	}
	if len(nodes) == 0 {
		return nil
	}
	var (
		ids, pools, tokens, hosts, machines, variants, versions []string
		created                                                 []time.Time
		joinKeys                                                [][]byte
	)
	for i, n := range nodes {
		joinKeys = append(joinKeys, certs[i].PublicKeySHA256)
		ids = append(ids, n.ID)
		pools = append(pools, n.PoolID)
		tokens = append(tokens, n.JoinTokenID)
		hosts = append(hosts, n.Hostname)
		machines = append(machines, n.MachineID)
		variants = append(variants, n.Variant)
		versions = append(versions, n.AgentVersion)
		created = append(created, n.CreatedAt)
	}
	_, err := q.Exec(ctx, `INSERT INTO nodes (id, pool_id, join_token_id, provision_state, hostname, machine_id,
		variant, agent_version, created_at, updated_at, join_key_sha256)
		SELECT id, pool_id, NULLIF(token, ''), $9, host, machine, variant, version, created, created, key
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::timestamptz[],
			$10::bytea[]) AS t(id, pool_id, token, host, machine, variant, version, created, key)`,
		ids, pools, tokens, hosts, machines, variants, versions, created, NodeJoining, joinKeys)
	if err != nil {
		return queryErr("create joined nodes", err)
	}
	var (
		serials, nodeIDs      []string
		keys                  [][]byte
		before, after, certAt []time.Time
	)
	for _, c := range certs {
		serials = append(serials, c.Serial)
		nodeIDs = append(nodeIDs, c.NodeID)
		keys = append(keys, c.PublicKeySHA256)
		before = append(before, c.NotBefore)
		after = append(after, c.NotAfter)
		certAt = append(certAt, c.CreatedAt)
	}
	_, err = q.Exec(ctx, `INSERT INTO node_certs (serial, node_id, public_key_sha256, not_before, not_after, created_at)
		SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::timestamptz[], $5::timestamptz[], $6::timestamptz[])`,
		serials, nodeIDs, keys, before, after, certAt)
	if err != nil {
		return queryErr("create node certs", err)
	}
	return nil
}

// RecordNodesJoined writes a node.joined event for each of nodeIDs (created
// in q's transaction by CreateJoinedNodes), for the tenant owning its pool.
func RecordNodesJoined(ctx context.Context, q DBTX, now time.Time, nodeIDs []string) error {
	return writeEventsOfNodes(ctx, q, now, nodeIDs, func(id string) EventData { return NodeJoinedData{NodeID: id} })
}

const nodeColumns = `n.id, n.pool_id, COALESCE(n.join_token_id, ''), n.provision_state, n.provision_reason, n.hostname,
	n.machine_id, n.variant, n.agent_version, n.cordoned, n.cordon_reason, n.reachable, COALESCE(n.gateway_id, ''),
	COALESCE(n.session_id, ''), n.session_epoch, n.boot_id, n.last_seen, n.spec_generation, n.observed_generation,
	n.adopted_at, n.created_at, n.updated_at, p.owner_tenant_id, n.revoked_at, n.revoke_reason,
	(SELECT max(c.not_after) FROM node_certs c WHERE c.node_id = n.id)`

func scanNode(row pgx.Row) (Node, error) {
	var n Node
	err := row.Scan(&n.ID, &n.PoolID, &n.JoinTokenID, &n.ProvisionState, &n.ProvisionReason, &n.Hostname,
		&n.MachineID, &n.Variant, &n.AgentVersion, &n.Cordoned, &n.CordonReason, &n.Reachable, &n.GatewayID,
		&n.SessionID, &n.SessionEpoch, &n.BootID, &n.LastSeen, &n.SpecGeneration, &n.ObservedGeneration,
		&n.AdoptedAt, &n.CreatedAt, &n.UpdatedAt, &n.PoolOwnerTenantID, &n.RevokedAt, &n.RevokeReason,
		&n.CertNotAfter)
	return n, err
}

// GetNode returns node id with its devices when scope includes the tenant
// owning its pool. Errors: ErrNotFound (missing, or outside scope).
func GetNode(ctx context.Context, q DBTX, scope Scope, id string) (Node, error) {
	n, err := scanNode(q.QueryRow(ctx, `SELECT `+nodeColumns+` FROM nodes n JOIN pools p ON p.id = n.pool_id
		WHERE n.id = $1 AND ($2::text IS NULL OR p.owner_tenant_id = $2)`, id, scope.arg()))
	if err != nil {
		return Node{}, queryErr(fmt.Sprintf("node %s", id), err)
	}
	nodes := []Node{n}
	if err := fillDevices(ctx, q, nodes); err != nil {
		return Node{}, err
	}
	return nodes[0], nil
}

// NodeFilter narrows ListNodes; zero fields other than Scope match
// everything.
type NodeFilter struct {
	// Scope keeps the nodes of pools its tenants own (the zero Scope: none).
	Scope  Scope
	PoolID string
	// After keeps only nodes whose id sorts after it (paging).
	After string
	// Limit caps the number of nodes; 0 means no limit.
	Limit int
}

// ListNodes returns the nodes matching f ordered by id, with their devices.
func ListNodes(ctx context.Context, q DBTX, f NodeFilter) ([]Node, error) {
	limit := any(nil)
	if f.Limit > 0 {
		limit = f.Limit
	}
	rows, err := q.Query(ctx, `SELECT `+nodeColumns+` FROM nodes n JOIN pools p ON p.id = n.pool_id
		WHERE ($1 = '' OR n.pool_id = $1) AND ($2::text IS NULL OR p.owner_tenant_id = $2) AND n.id > $3
		ORDER BY n.id LIMIT $4`, f.PoolID, f.Scope.arg(), f.After, limit)
	if err != nil {
		return nil, queryErr("list nodes", err)
	}
	nodes, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Node, error) { return scanNode(r) })
	if err != nil {
		return nil, queryErr("list nodes", err)
	}
	if err := fillDevices(ctx, q, nodes); err != nil {
		return nil, err
	}
	return nodes, nil
}

// fillDevices loads the devices of nodes in one query.
func fillDevices(ctx context.Context, q DBTX, nodes []Node) error {
	if len(nodes) == 0 {
		return nil
	}
	idx := make(map[string]int, len(nodes))
	ids := make([]string, len(nodes))
	for i, n := range nodes {
		idx[n.ID] = i
		ids[i] = n.ID
	}
	rows, err := q.Query(ctx, `SELECT node_id, device_index, uuid, model, memory_bytes, healthy FROM node_devices
		WHERE node_id = ANY($1) ORDER BY node_id, device_index`, ids)
	if err != nil {
		return queryErr("list node devices", err)
	}
	devs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (NodeDevice, error) {
		var d NodeDevice
		err := r.Scan(&d.NodeID, &d.Index, &d.UUID, &d.Model, &d.MemoryBytes, &d.Healthy)
		return d, err
	})
	if err != nil {
		return queryErr("list node devices", err)
	}
	for _, d := range devs {
		i := idx[d.NodeID]
		nodes[i].Devices = append(nodes[i].Devices, d)
	}
	return nil
}

// replaceNodeDevices replaces the node_devices rows of nodeIDs with
// devices[id] (none for a node missing there), in one statement; what
// names the caller in errors. With state not empty it replaces only those
// of nodeIDs in that provision state, which it locks (FOR NO KEY UPDATE, in
// id order) so that they stay in it until the transaction ends, and returns
// them, ordered by id; with state empty it returns nil.
func replaceNodeDevices(ctx context.Context, q DBTX, what string, state string, nodeIDs []string, devices map[string][]NodeDevice) ([]string, error) {
	if len(nodeIDs) == 0 {
		return nil, nil
	}
	var (
		devNode, devUUID, devModel []string
		devIndex                   []int32
		devMemory                  []int64
		devHealthy                 []bool
	)
	for _, id := range nodeIDs {
		for _, d := range devices[id] {
			devNode = append(devNode, id)
			devIndex = append(devIndex, d.Index)
			devUUID = append(devUUID, d.UUID)
			devModel = append(devModel, d.Model)
			devMemory = append(devMemory, d.MemoryBytes)
			devHealthy = append(devHealthy, d.Healthy)
		}
	}
	if state == "" {
		// One statement: the insert reads the delete's count, so that the
		// delete runs first and the new rows take the old ones' keys.
		_, err := q.Exec(ctx, `WITH del AS (DELETE FROM node_devices WHERE node_id = ANY($1) RETURNING 1)
			INSERT INTO node_devices (node_id, device_index, uuid, model, memory_bytes, healthy)
			SELECT * FROM unnest($2::text[], $3::int[], $4::text[], $5::text[], $6::bigint[], $7::bool[])
			WHERE (SELECT count(*) FROM del) >= 0`,
			nodeIDs, devNode, devIndex, devUUID, devModel, devMemory, devHealthy)
		if err != nil {
			return nil, fmt.Errorf("%s: replace devices: %w", what, interpretError(err))
		}
		return nil, nil
	}
	// The same statement over the nodes the lock found in state: the delete
	// reads them, the insert the delete's count.
	ids, err := queryIDs(ctx, q, what+": replace devices", `WITH n AS MATERIALIZED (
			SELECT id FROM nodes WHERE id = ANY($1) AND provision_state = $8 ORDER BY id FOR NO KEY UPDATE),
		del AS (DELETE FROM node_devices WHERE node_id IN (SELECT id FROM n) RETURNING 1),
		ins AS (
			INSERT INTO node_devices (node_id, device_index, uuid, model, memory_bytes, healthy)
			SELECT u.* FROM unnest($2::text[], $3::int[], $4::text[], $5::text[], $6::bigint[], $7::bool[])
				AS u(node_id, device_index, uuid, model, memory_bytes, healthy)
			WHERE u.node_id IN (SELECT id FROM n) AND (SELECT count(*) FROM del) >= 0)
		SELECT id FROM n ORDER BY id`,
		nodeIDs, devNode, devIndex, devUUID, devModel, devMemory, devHealthy, state)
	if err != nil {
		return nil, err
	}
	return ids, nil
}

// ErrNodeRevoked is the sentinel of NodeRevokedError.
var ErrNodeRevoked = errors.New("node is revoked")

// NodeRevokedError refuses a change that makes no sense on a revoked node
// (cordoning it). It matches ErrNodeRevoked under errors.Is.
type NodeRevokedError struct{ NodeID string }

func (e *NodeRevokedError) Error() string { return "node " + e.NodeID + " is revoked" }

// Is makes errors.Is(err, ErrNodeRevoked) true.
func (e *NodeRevokedError) Is(target error) bool { return target == ErrNodeRevoked }

// CordonResult is what CordonNode did.
type CordonResult struct {
	// Changed is true when the node was not cordoned or its reason changed
	// (and a node.cordoned event was written).
	Changed bool
	// WasCordoned is true when the node was cordoned already, with
	// PreviousReason.
	WasCordoned    bool
	PreviousReason string
}

// CordonNode cordons node nodeID with reason at now: the scheduler places
// nothing new on it (its reservations stay). Cordoning a cordoned node sets
// the new reason. It writes a node.cordoned event (with reason) only when the
// node was not cordoned or its reason changes. Call it in a transaction.
// Errors: ErrNotFound (missing, or its pool's owner outside scope), a
// *NodeRevokedError (ErrNodeRevoked) when the node is revoked (nothing
// changes).
func CordonNode(ctx context.Context, q DBTX, scope Scope, now time.Time, nodeID, reason string) (CordonResult, error) {
	var (
		res     CordonResult
		revoked bool
		owner   string
	)
	err := q.QueryRow(ctx, `SELECT n.cordoned, n.cordon_reason, n.revoked_at IS NOT NULL, p.owner_tenant_id
		FROM nodes n JOIN pools p ON p.id = n.pool_id WHERE n.id = $1 AND ($2::text IS NULL OR p.owner_tenant_id = $2)
		FOR NO KEY UPDATE OF n`, nodeID, scope.arg()).
		Scan(&res.WasCordoned, &res.PreviousReason, &revoked, &owner)
	if err != nil {
		return CordonResult{}, queryErr(fmt.Sprintf("node %s", nodeID), err)
	}
	if revoked {
		return CordonResult{}, &NodeRevokedError{NodeID: nodeID}
	}
	if res.WasCordoned && res.PreviousReason == reason {
		return res, nil
	}
	if _, err := q.Exec(ctx, `UPDATE nodes SET cordoned = true, cordon_reason = $2, updated_at = $3 WHERE id = $1`,
		nodeID, reason, now); err != nil {
		return CordonResult{}, fmt.Errorf("cordon node %s: %w", nodeID, interpretError(err))
	}
	res.Changed = true
	return res, WriteEvents(ctx, q, now, NewEvent{TenantID: owner, Data: NodeCordonedData{NodeID: nodeID, Reason: reason}})
}

// UncordonNode lets the scheduler place on node nodeID again: it clears the
// cordon and its reason, writes a node.uncordoned event and pokes the
// scheduler when the node was cordoned, and reports whether it was. The
// event's data is {"nodeId", "previousReason"}: the reason of the cordon it
// lifted, not a reason of its own (an uncordon has none). Call it in a
// transaction. Errors: ErrNotFound (missing, or its pool's owner outside
// scope).
func UncordonNode(ctx context.Context, q DBTX, scope Scope, now time.Time, nodeID string) (bool, error) {
	var (
		was           bool
		reason, owner string
	)
	err := q.QueryRow(ctx, `WITH prev AS (
			SELECT n.id, n.cordoned, n.cordon_reason FROM nodes n JOIN pools p ON p.id = n.pool_id
			WHERE n.id = $1 AND ($3::text IS NULL OR p.owner_tenant_id = $3) FOR NO KEY UPDATE OF n)
		UPDATE nodes n SET cordoned = false, cordon_reason = '',
			updated_at = CASE WHEN prev.cordoned THEN $2 ELSE n.updated_at END
		FROM prev, pools p WHERE n.id = prev.id AND p.id = n.pool_id
		RETURNING prev.cordoned, prev.cordon_reason, p.owner_tenant_id`, nodeID, now, scope.arg()).Scan(&was, &reason, &owner)
	if err != nil {
		return false, queryErr(fmt.Sprintf("node %s", nodeID), err)
	}
	if !was {
		return false, nil
	}
	if err := WriteEvents(ctx, q, now, NewEvent{TenantID: owner,
		Data: NodeUncordonedData{NodeID: nodeID, PreviousReason: reason}}); err != nil {
		return false, err
	}
	// Pending reservations may fit on the node now.
	if err := Enqueue(ctx, q, now, SubjectPokeScheduler, nil); err != nil {
		return false, err
	}
	return true, nil
}

// ExpireJoiningNodes deletes at most limit nodes that joined more than
// timeout before now and never opened a session (still joining, no
// last_seen): a Join whose machine never came, or a replayed Join that made
// a phantom. Each gives its join token its use back (when the token is not
// revoked), and its certificates are deleted with it, so the machine, if
// it ever comes, must join again. Nodes locked by another transaction are
// skipped. It returns the ids deleted.
func ExpireJoiningNodes(ctx context.Context, q DBTX, now time.Time, timeout time.Duration, limit int) ([]string, error) {
	ids, err := queryIDs(ctx, q, "expire joining nodes", `SELECT id FROM nodes
		WHERE provision_state = 'joining' AND last_seen IS NULL AND gateway_id IS NULL AND created_at < $1
		ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED`, now.Add(-timeout), limit)
	if err != nil || len(ids) == 0 {
		return nil, err
	}
	if _, err := q.Exec(ctx, `UPDATE join_tokens j SET uses = j.uses - u.n
		FROM (SELECT join_token_id AS id, count(*) AS n FROM nodes WHERE id = ANY($1) AND join_token_id IS NOT NULL
			GROUP BY join_token_id) AS u
		WHERE j.id = u.id AND j.revoked_at IS NULL`, ids); err != nil {
		return nil, queryErr("give join token uses back", err)
	}
	for _, stmt := range []string{
		`DELETE FROM node_certs WHERE node_id = ANY($1)`,
		`DELETE FROM node_devices WHERE node_id = ANY($1)`,
		`DELETE FROM nodes WHERE id = ANY($1)`,
	} {
		if _, err := q.Exec(ctx, stmt, ids); err != nil {
			return nil, queryErr("expire joining nodes", err)
		}
	}
	return ids, nil
}

// JoinTokenUses are Uses more uses of join token TokenID, granted by
// GrantJoinTokenUses of the token locked by LockJoinToken.
type JoinTokenUses struct {
	TokenID string
	Uses    int
}

// RecordJoins records a batch of joins in one statement, whatever its size:
// it counts the token uses (each token locked by LockJoinToken in q's
// transaction, the uses granted by GrantJoinTokenUses), inserts the nodes
// (state NodeJoining) and their certificates, nodes[i] with certs[i] (whose
// public key becomes the node's join key), writes a node.joined event for
// each node (ordered by node id, for the tenant owning its pool, as
// RecordNodesJoined does; its hint published after the commit) and one SubjectPokeControllers
// poke naming the nodes (payload Poke, in the order of nodes), and signals
// the outbox. It is what CountJoinTokenUses, CreateJoinedNodes,
// RecordNodesJoined and Enqueue of the poke did in six statements. Errors:
// as CreateJoinedNodes's (ErrConflict, ConstraintNodeJoinKey for a key that
// joined concurrently); nothing is written then.
func RecordJoins(ctx context.Context, q DBTX, now time.Time, uses []JoinTokenUses, nodes []NewNode, certs []NewNodeCert) error {
	if len(nodes) != len(certs) {
		return fmt.Errorf("record joins: %d nodes but %d certificates", len(nodes), len(certs))
	}
	if len(nodes) == 0 {
		return nil
	}
	var (
		tokenIDs []string
		tokenN   []int32
	)
	for _, u := range uses {
		tokenIDs = append(tokenIDs, u.TokenID)
		tokenN = append(tokenN, int32(u.Uses))
	}
	n := len(nodes)
	ids, pools, tokens, hosts, machines := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	variants, versions, created := make([]string, n), make([]string, n), make([]time.Time, n)
	joinKeys := make([][]byte, n)
	serials, before, after, certAt := make([]string, n), make([]time.Time, n), make([]time.Time, n), make([]time.Time, n)
	for i, nd := range nodes {
		c := certs[i]
		if c.NodeID != nd.ID {
			return fmt.Errorf("record joins: certificate %d is node %s's, not %s's", i, c.NodeID, nd.ID)
		}
		ids[i], pools[i], tokens[i], hosts[i], machines[i] = nd.ID, nd.PoolID, nd.JoinTokenID, nd.Hostname, nd.MachineID
		variants[i], versions[i], created[i], joinKeys[i] = nd.Variant, nd.AgentVersion, nd.CreatedAt, c.PublicKeySHA256
		serials[i], before[i], after[i], certAt[i] = c.Serial, c.NotBefore, c.NotAfter, c.CreatedAt
	}
	// The events, ordered by node id as RecordNodesJoined orders them.
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(ids[a], ids[b]) })
	evNodes, evPools, evData := make([]string, n), make([]string, n), make([]string, n)
	for k, i := range order {
		b, err := json.Marshal(NodeJoinedData{NodeID: ids[i]})
		if err != nil {
			return fmt.Errorf("record joins: %w", err)
		}
		evNodes[k], evPools[k], evData[k] = ids[i], pools[i], string(b)
	}
	poke, err := json.Marshal(Poke{NodeIDs: ids})
	if err != nil {
		return fmt.Errorf("record joins: %w", err)
	}
	var usedTokens, inserted, certified, evented, poked int
	var hints []string
	err = q.QueryRow(ctx, `WITH tok AS (
			UPDATE join_tokens j SET uses = j.uses + u.n FROM unnest($1::text[], $2::int[]) AS u(id, n)
			WHERE j.id = u.id RETURNING j.id),
		nd AS (
			INSERT INTO nodes (id, pool_id, join_token_id, provision_state, hostname, machine_id,
				variant, agent_version, created_at, updated_at, join_key_sha256)
			SELECT id, pool_id, NULLIF(token, ''), $11, host, machine, variant, version, created, created, key
			FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::text[],
				$10::timestamptz[], $12::bytea[]) AS t(id, pool_id, token, host, machine, variant, version, created, key)
			RETURNING id),
		nc AS (
			INSERT INTO node_certs (serial, node_id, public_key_sha256, not_before, not_after, created_at)
			SELECT * FROM unnest($13::text[], $3::text[], $12::bytea[], $14::timestamptz[], $15::timestamptz[], $16::timestamptz[])
			RETURNING serial),
		src AS (
			SELECT u.ord, p.owner_tenant_id AS tenant, '`+EventNodeJoined+`' AS type, u.id AS subject, u.data::jsonb AS data,
				$17::timestamptz AS at
			FROM unnest($18::text[], $19::text[], $20::text[]) WITH ORDINALITY AS u(id, pool, data, ord)
			JOIN pools p ON p.id = u.pool),
		`+eventWriterCTE("src")+`,
		pk AS (
			INSERT INTO outbox (subject, payload, created_at, traceparent) VALUES ($21, $22, $17, $23) RETURNING id)
		SELECT (SELECT count(*) FROM tok), (SELECT count(*) FROM nd), (SELECT count(*) FROM nc), `+eventCountSQL+`,
			(SELECT count(*) FROM pk), `+eventHintsSQL,
		tokenIDs, tokenN, ids, pools, tokens, hosts, machines, variants, versions, created, NodeJoining, joinKeys,
		serials, before, after, certAt, now, evNodes, evPools, evData,
		SubjectPokeControllers, poke, telemetry.Traceparent(ctx),
	).Scan(&usedTokens, &inserted, &certified, &evented, &poked, &hints)
	if err != nil {
		return queryErr("record joins", err)
	}
	if usedTokens != len(uses) || inserted != n || certified != n || evented != n || poked != 1 {
		return fmt.Errorf("record joins: %d of %d tokens, %d nodes, %d certificates, %d events and %d pokes for %d joins",
			usedTokens, len(uses), inserted, certified, evented, poked, n)
	}
	hintEvents(q, hints)
	return signalOutbox(ctx, q)
}
