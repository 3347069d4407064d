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

// Join is one join of a batch that RecordJoins records: the node and the
// certificate JoinService made for it before its token was counted.
type Join struct {
	// TokenHash is the SHA-256 of the join token's secret.
	TokenHash []byte
	// Node is the node to create: its ID and the machine's claims
	// (PoolID, JoinTokenID and CreatedAt are the token's and the batch's).
	Node NewNode
	// Cert is its certificate: Serial, PublicKeySHA256 (the node's join
	// key), NotBefore and NotAfter (NodeID and CreatedAt are the node's).
	Cert NewNodeCert
}

// JoinOutcome is what RecordJoins did with one Join: exactly one of a use
// counted (Err and Rejoin nil), a retry (Rejoin), or a refusal (Err).
type JoinOutcome struct {
	// Token is the join's token: with its use counted (Uses includes this
	// join's) when the node was created; as it was locked for a retry or a
	// refusal (zero for ErrJoinTokenUnknown).
	Token JoinToken
	// Rejoin, when set, is the node the join's key joined as already (a
	// retry: nothing was written for it, no use counted).
	Rejoin *JoinedKey
	// Err is a *JoinTokenRefusal (ErrJoinTokenUnknown, ErrJoinTokenRevoked,
	// ErrJoinTokenExpired, ErrJoinTokenUsedUp), or ErrSameKeyInBatch.
	Err error
}

// ErrSameKeyInBatch refuses a join of RecordJoins whose key an earlier join
// of its batch joins with: once that one is recorded, the caller joins again
// and finds it (a retry sent before the first attempt's answer).
var ErrSameKeyInBatch = errors.New("the same key joins in this batch")

// RecordJoins records a batch of joins in one statement, whatever its size
// or its number of tokens: it locks the batch's tokens (FOR UPDATE, in hash
// order, so concurrent batches never deadlock and can never take more than
// a token's max_uses in all), refuses the joins of an unknown, revoked or
// expired token, answers a key that joined already as a retry (Rejoin;
// nodes.join_key_sha256), grants each token's remaining uses to its other
// joins in batch order (the rest are refused as used up), counts them,
// inserts the nodes (state NodeJoining) with their certificates (whose
// public key becomes the node's join key), writes a node.joined event for
// each node (ordered by node id, for the tenant owning its pool; their
// hints published after the commit) and one SubjectPokeControllers poke
// naming the nodes (payload Poke, ordered by node id), and signals the
// outbox. Run it on DB.AutoCommit (one round trip: the statement is the
// transaction) or in a transaction. A join whose key an earlier one of the
// batch has is not sent (ErrSameKeyInBatch). It returns one JoinOutcome per
// join, in order.
//
// The lock and the counts are the latest committed (a locked row is read
// again after the wait), the keys that joined are the statement's snapshot:
// a key that another JoinService's batch made join while this one waited
// for the token fails the statement on ConstraintNodeJoinKey, and nothing is
// written (the caller records the batch again, and finds it as a retry).
// Errors: the database's, for the whole batch.
func RecordJoins(ctx context.Context, q DBTX, now time.Time, joins []Join) ([]JoinOutcome, error) {
	out := make([]JoinOutcome, len(joins))
	// The first join of each key is sent; the others are refused.
	first := make(map[string]bool, len(joins))
	var sent []int
	for i, j := range joins {
		key := string(j.Cert.PublicKeySHA256)
		if first[key] {
			out[i].Err = ErrSameKeyInBatch
			continue
		}
		first[key] = true
		sent = append(sent, i)
	}
	if len(sent) == 0 {
		return out, nil
	}
	n := len(sent)
	hashes, keys := make([][]byte, n), make([][]byte, n)
	ids, hosts, machines, variants, versions := make([]string, n), make([]string, n), make([]string, n), make([]string, n),
		make([]string, n)
	serials, before, after, data := make([]string, n), make([]time.Time, n), make([]time.Time, n), make([]string, n)
	for x, i := range sent {
		j := joins[i]
		b, err := json.Marshal(NodeJoinedData{NodeID: j.Node.ID})
		if err != nil {
			return nil, fmt.Errorf("record joins: %w", err)
		}
		hashes[x], keys[x], data[x] = j.TokenHash, j.Cert.PublicKeySHA256, string(b)
		ids[x], hosts[x], machines[x], variants[x], versions[x] = j.Node.ID, j.Node.Hostname, j.Node.MachineID, j.Node.Variant,
			j.Node.AgentVersion
		serials[x], before[x], after[x] = j.Cert.Serial, j.Cert.NotBefore, j.Cert.NotAfter
	}
	rows, err := q.Query(ctx, recordJoinsSQL, hashes, ids, hosts, machines, variants, versions, keys, serials, before, after,
		data, now, NodeJoining, SubjectPokeControllers, telemetry.Traceparent(ctx))
	if err != nil {
		return nil, queryErr("record joins", err)
	}
	var (
		created, usedTokens, inserted, certified, evented, poked int64
		hints                                                    []string
		tokens                                                   = map[string]bool{}
	)
	for rows.Next() {
		var (
			ord                                   int
			rank                                  *int64
			tid, tpool, tby, rejoinID, rejoinPool *string
			thash                                 []byte
			tmax, tuses                           *int32
			texp, tcreated                        *time.Time
			t                                     JoinToken
		)
		if err := rows.Scan(&ord, &tid, &tpool, &thash, &tmax, &tuses, &texp, &t.RevokedAt, &tby, &tcreated, &rejoinID,
			&rejoinPool, &rank, &usedTokens, &inserted, &certified, &evented, &poked, &hints); err != nil {
			rows.Close()
			return nil, queryErr("record joins", err)
		}
		o := &out[sent[ord-1]]
		if tid == nil {
			o.Err = &JoinTokenRefusal{Reason: ErrJoinTokenUnknown}
			continue
		}
		t.ID, t.PoolID, t.Hash, t.MaxUses, t.Uses, t.ExpiresAt, t.CreatedBy, t.CreatedAt = *tid, *tpool, thash, *tmax, *tuses,
			*texp, *tby, *tcreated
		switch {
		case t.RevokedAt != nil:
			o.Token, o.Err = t, &JoinTokenRefusal{Reason: ErrJoinTokenRevoked, Token: t}
		case !t.ExpiresAt.After(now):
			o.Token, o.Err = t, &JoinTokenRefusal{Reason: ErrJoinTokenExpired, Token: t}
		case rejoinID != nil:
			o.Token, o.Rejoin = t, &JoinedKey{NodeID: *rejoinID, PoolID: *rejoinPool}
		case rank == nil || *rank > int64(t.MaxUses-t.Uses):
			used := t
			used.Uses = t.MaxUses
			o.Token, o.Err = t, &JoinTokenRefusal{Reason: ErrJoinTokenUsedUp, Token: used}
		default:
			o.Token = t
			o.Token.Uses = t.Uses + int32(*rank)
			created++
			tokens[t.ID] = true
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, queryErr("record joins", err)
	}
	wantPokes := int64(0)
	if created > 0 {
		wantPokes = 1
	}
	if usedTokens != int64(len(tokens)) || inserted != created || certified != created || evented != created || poked != wantPokes {
		return nil, fmt.Errorf("record joins: %d of %d tokens, %d nodes, %d certificates, %d events and %d pokes for %d joins",
			usedTokens, len(tokens), inserted, certified, evented, poked, created)
	}
	if created == 0 {
		return out, nil
	}
	hintEvents(q, hints)
	return out, signalOutbox(ctx, q)
}

// recordJoinsSQL is RecordJoins's statement. r is the joins sent, in
// order; tok their tokens, locked in hash order and read again after a
// wait; c each join with its token and the node its key joined as (jn);
// ok the joins granted a use: a usable token's joins that are not retries,
// ranked in batch order within their token, up to its remaining uses. It
// returns, per join, its token as locked (NULLs: unknown), its retry's node,
// its rank among its token's new joins (NULL: not one), and the counts
// written and the events' hints (the same on every row).
var recordJoinsSQL = `WITH r AS (
		SELECT * FROM unnest($1::bytea[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::bytea[], $8::text[],
			$9::timestamptz[], $10::timestamptz[], $11::text[])
			WITH ORDINALITY AS r(hash, id, host, machine, variant, version, key, serial, nb, na, data, ord)),
	tok AS MATERIALIZED (
		SELECT ` + joinTokenColumns + ` FROM join_tokens j WHERE j.hash = ANY($1::bytea[]) ORDER BY j.hash FOR UPDATE),
	jn AS MATERIALIZED (
		SELECT n.join_key_sha256 AS key, n.id, n.pool_id FROM nodes n WHERE n.join_key_sha256 = ANY($7::bytea[])),
	c AS MATERIALIZED (
		SELECT r.*, t.id AS token_id, t.pool_id, t.max_uses, t.uses, jn.id AS rejoin_id, jn.pool_id AS rejoin_pool,
			row_number() OVER (PARTITION BY t.id, t.revoked_at IS NULL AND t.expires_at > $12 AND jn.id IS NULL
				ORDER BY r.ord) AS rank,
			t.revoked_at IS NULL AND t.expires_at > $12 AND jn.id IS NULL AS fresh
		FROM r LEFT JOIN tok t ON t.hash = r.hash LEFT JOIN jn ON jn.key = r.key),
	ok AS MATERIALIZED (
		SELECT * FROM c WHERE c.fresh AND c.rank <= c.max_uses - c.uses),
	used AS (
		UPDATE join_tokens j SET uses = j.uses + u.n
		FROM (SELECT token_id, count(*) AS n FROM ok GROUP BY token_id) AS u
		WHERE j.id = u.token_id RETURNING j.id),
	nd AS (
		INSERT INTO nodes (id, pool_id, join_token_id, provision_state, hostname, machine_id, variant, agent_version,
			created_at, updated_at, join_key_sha256)
		SELECT id, pool_id, token_id, $13, host, machine, variant, version, $12, $12, key FROM ok ORDER BY ord
		RETURNING id),
	nc AS (
		INSERT INTO node_certs (serial, node_id, public_key_sha256, not_before, not_after, created_at)
		SELECT serial, id, key, nb, na, $12 FROM ok ORDER BY ord
		RETURNING serial),
	src AS (
		SELECT row_number() OVER (ORDER BY ok.id) AS ord, p.owner_tenant_id AS tenant, '` + EventNodeJoined + `' AS type,
			ok.id AS subject, ok.data::jsonb AS data, $12::timestamptz AS at
		FROM ok JOIN pools p ON p.id = ok.pool_id),
	` + eventWriterCTE("src") + `,
	pk AS (
		INSERT INTO outbox (subject, payload, created_at, traceparent)
		SELECT $14, convert_to(jsonb_build_object('nodeIds', array_agg(id ORDER BY id))::text, 'UTF8'), $12, $15
		FROM ok HAVING count(*) > 0
		RETURNING id),
	counts AS MATERIALIZED (
		SELECT (SELECT count(*) FROM used) AS used, (SELECT count(*) FROM nd) AS nd, (SELECT count(*) FROM nc) AS nc,
			` + eventCountSQL + ` AS ev, (SELECT count(*) FROM pk) AS pk, ` + eventHintsSQL + ` AS hints)
	SELECT c.ord, t.id, t.pool_id, t.hash, t.max_uses, t.uses, t.expires_at, t.revoked_at, t.created_by, t.created_at,
		c.rejoin_id, c.rejoin_pool, CASE WHEN c.fresh THEN c.rank END,
		counts.used, counts.nd, counts.nc, counts.ev, counts.pk, counts.hints
	FROM c LEFT JOIN tok t ON t.id = c.token_id CROSS JOIN counts
	ORDER BY c.ord`
