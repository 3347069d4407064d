package store

// Commands run by users (DESIGN §2 I2, issue 5): RunCommand queues a signed
// command for one node, the gateway delivers it, the daemon runs it at most
// once (its journal answers a redelivery) and reports; the command expiry
// reconciler ends what is still open at its deadline. A command belongs to
// its node's tenant (the pool's owner). Every state change here writes its
// event (command.queued, command.succeeded, command.failed,
// command.expired) through InsertReservationEvents in the same transaction.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// Command kinds a user may run (commands.kind).
const (
	CommandDiagNVML         = "diag.nvml"
	CommandInventoryRefresh = "inventory.refresh"
	CommandLogsCollect      = "logs.collect"
	CommandNodeReboot       = "node.reboot"
)

// Event types of user commands (events.type).
const (
	EventCommandQueued    = "command.queued"
	EventCommandSucceeded = "command.succeeded"
	EventCommandFailed    = "command.failed"
	EventCommandExpired   = "command.expired"
)

// DefaultCommandTimeout is a command's deadline from its creation when the
// caller gives none.
const DefaultCommandTimeout = 5 * time.Minute

// commandRetrySafe says, per kind, whether a daemon that lost its journal
// may run the command again (true) or must fail it (false): a reboot that
// may already have happened is never repeated.
var commandRetrySafe = map[string]bool{
	CommandDiagNVML:         true,
	CommandInventoryRefresh: true,
	CommandLogsCollect:      true,
	CommandNodeReboot:       false,
}

// CommandRetrySafe reports whether a command of kind is retry-safe; ok is
// false for a kind users may not run.
func CommandRetrySafe(kind string) (retrySafe, ok bool) {
	retrySafe, ok = commandRetrySafe[kind]
	return retrySafe, ok
}

// ErrNodeNotRunnable is the sentinel of NodeNotRunnableError.
var ErrNodeNotRunnable = errors.New("node cannot run commands")

// NodeNotRunnableError refuses a command for a node that is not adopted or
// is revoked. It matches ErrNodeNotRunnable under errors.Is.
type NodeNotRunnableError struct {
	NodeID string
	// Reason is a sentence for the caller, e.g. "node node_… is revoked".
	Reason string
}

func (e *NodeNotRunnableError) Error() string { return e.Reason }

// Is makes errors.Is(err, ErrNodeNotRunnable) true.
func (e *NodeNotRunnableError) Is(target error) bool { return target == ErrNodeNotRunnable }

// Command is a row of commands with its tenant.
type Command struct {
	ID     string
	NodeID string
	// TenantID is the owner of the node's pool.
	TenantID string
	Kind     string
	// Purpose is "user" or "acceptance".
	Purpose string
	// State is queued, delivered, running, succeeded, failed, expired or
	// canceled.
	State     string
	RetrySafe bool
	Deadline  time.Time
	// Result is the daemon's result (protojson of gatewayv1.CommandResult),
	// nil when none.
	Result []byte
	Error  string
	// Deliveries counts how often the gateway sent the command.
	Deliveries int32
	// RequestID is the caller's idempotency key, "" when none.
	RequestID string
	CreatedBy string
	CreatedAt time.Time
	UpdatedAt time.Time
	// DeliveredAt and FinishedAt are nil until then.
	DeliveredAt *time.Time
	FinishedAt  *time.Time
}

const commandColumns = `c.id, c.node_id, p.owner_tenant_id, c.kind, c.purpose, c.state, c.retry_safe, c.deadline,
	c.result, c.error, c.deliveries, COALESCE(c.request_id, ''), c.created_by, c.created_at, c.updated_at,
	c.delivered_at, c.finished_at`

const commandFrom = ` FROM commands c JOIN nodes n ON n.id = c.node_id JOIN pools p ON p.id = n.pool_id`

func scanCommand(row pgx.Row) (Command, error) {
	var c Command
	err := row.Scan(&c.ID, &c.NodeID, &c.TenantID, &c.Kind, &c.Purpose, &c.State, &c.RetrySafe, &c.Deadline,
		&c.Result, &c.Error, &c.Deliveries, &c.RequestID, &c.CreatedBy, &c.CreatedAt, &c.UpdatedAt,
		&c.DeliveredAt, &c.FinishedAt)
	return c, err
}

// GetCommand returns command id with its tenant, or ErrNotFound.
func GetCommand(ctx context.Context, q DBTX, id string) (Command, error) {
	c, err := scanCommand(q.QueryRow(ctx, `SELECT `+commandColumns+commandFrom+` WHERE c.id = $1`, id))
	if err != nil {
		return Command{}, queryErr("command "+id, err)
	}
	return c, nil
}

// CommandFilter selects commands for ListCommands.
type CommandFilter struct {
	// TenantID, when set, keeps the commands of that tenant's nodes.
	TenantID string
	// NodeID, when set, keeps the commands of that node.
	NodeID string
	// Before, when set, keeps ids less than it (the previous page's last id).
	Before string
	// Limit is the page size (> 0).
	Limit int
}

// ListCommands returns the commands f selects, newest first (by id; ids
// sort by creation time).
func ListCommands(ctx context.Context, q DBTX, f CommandFilter) ([]Command, error) {
	rows, err := q.Query(ctx, `SELECT `+commandColumns+commandFrom+`
		WHERE ($1 = '' OR p.owner_tenant_id = $1) AND ($2 = '' OR c.node_id = $2) AND ($3 = '' OR c.id < $3)
		ORDER BY c.id DESC LIMIT $4`, f.TenantID, f.NodeID, f.Before, f.Limit)
	if err != nil {
		return nil, queryErr("list commands", err)
	}
	defer rows.Close()
	var out []Command
	for rows.Next() {
		c, err := scanCommand(rows)
		if err != nil {
			return nil, queryErr("list commands", err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, queryErr("list commands", err)
	}
	return out, nil
}

// NewCommand is a user command to queue.
type NewCommand struct {
	// ID is "cmd_…" (ids.Command).
	ID     string
	NodeID string
	// Kind is one of the Command* kinds.
	Kind string
	// Deadline is when the command must have finished (now + timeout).
	Deadline time.Time
	// RequestID is the caller's idempotency key; "" for none.
	RequestID string
	// CreatedBy names the caller (its token id).
	CreatedBy string
	// TenantID, when not empty, is the caller's tenant: a node whose pool
	// another tenant owns is refused with ErrNotFound, as an unknown one is.
	TenantID string
}

// QueuedCommand is what QueueCommand did.
type QueuedCommand struct {
	Command
	// Existing is true when RequestID had already queued this command on
	// the node (nothing was written).
	Existing bool
}

// QueueCommand queues n on its node in q's transaction: QueueCommands of
// one command, its error returned as the error.
func QueueCommand(ctx context.Context, q DBTX, intent *IntentSigner, now time.Time, n NewCommand) (QueuedCommand, error) {
	res, err := QueueCommands(ctx, q, intent, now, []NewCommand{n})
	if err != nil {
		return QueuedCommand{}, err
	}
	return res[0].QueuedCommand, res[0].Err
}

// QueueResult is the outcome of one NewCommand of QueueCommands: the
// command, or Err for this command alone.
type QueueResult struct {
	QueuedCommand
	// Err is ErrNotFound (node unknown, or of a tenant other than the
	// command's TenantID), a *NodeNotRunnableError, or an error for an
	// unknown kind; nothing was written for the command then.
	Err error
}

// queueNode is what QueueCommands reads of a node it locks.
type queueNode struct {
	state, tenant string
	gatewayID     *string
	revoked       bool
}

// QueueCommands queues cmds in q's transaction, in a fixed number of round
// trips whatever their number (the API batches concurrent RunCommand calls
// into one call). For each command it locks the node (in node id order, so
// concurrent batches do not deadlock), refuses one that is unknown or of
// another tenant than the command's TenantID (ErrNotFound) or is not
// adopted or is revoked (*NodeNotRunnableError), inserts the command as
// queued with its kind's retry-safety and purpose 'user', signs it with
// intent (nil: unsigned), writes a command.queued event for the node's
// tenant and pokes the gateways holding the nodes' sessions (one poke per
// gateway). A request id already used on the node — before or earlier in
// cmds — answers that command with Existing and writes nothing. Per-command
// refusals are in the results (one per command, in order); the error is
// the database's and fails them all.
func QueueCommands(ctx context.Context, q DBTX, intent *IntentSigner, now time.Time, cmds []NewCommand) ([]QueueResult, error) {
	out := make([]QueueResult, len(cmds))
	nodeIDs := make([]string, 0, len(cmds))
	for _, n := range cmds {
		nodeIDs = append(nodeIDs, n.NodeID)
	}
	slices.Sort(nodeIDs)
	nodeIDs = slices.Compact(nodeIDs)
	rows, err := q.Query(ctx, `SELECT n.id, n.provision_state, n.revoked_at IS NOT NULL, p.owner_tenant_id, n.gateway_id
		FROM nodes n JOIN pools p ON p.id = n.pool_id WHERE n.id = ANY($1) ORDER BY n.id FOR SHARE OF n`, nodeIDs)
	if err != nil {
		return nil, queryErr("lock nodes", err)
	}
	nodes := make(map[string]queueNode, len(nodeIDs))
	for rows.Next() {
		var id string
		var n queueNode
		if err := rows.Scan(&id, &n.state, &n.revoked, &n.tenant, &n.gatewayID); err != nil {
			rows.Close()
			return nil, queryErr("lock nodes", err)
		}
		nodes[id] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, queryErr("lock nodes", err)
	}

	// Refusals, then request ids already used.
	type reqKey struct{ node, request string }
	var reqNodes, reqIDs []string
	for i, n := range cmds {
		node, ok := nodes[n.NodeID]
		switch {
		case !ok || (n.TenantID != "" && n.TenantID != node.tenant):
			out[i].Err = fmt.Errorf("node %s: %w", n.NodeID, ErrNotFound)
		case n.RequestID != "":
			reqNodes, reqIDs = append(reqNodes, n.NodeID), append(reqIDs, n.RequestID)
		}
		if out[i].Err == nil {
			if _, ok := CommandRetrySafe(n.Kind); !ok {
				out[i].Err = fmt.Errorf("unknown command kind %q", n.Kind)
			}
		}
	}
	existing := map[reqKey]Command{}
	if len(reqIDs) > 0 {
		found, err := commandsByRequest(ctx, q, reqNodes, reqIDs)
		if err != nil {
			return nil, err
		}
		for _, c := range found {
			existing[reqKey{c.NodeID, c.RequestID}] = c
		}
	}
	// The commands to insert; a request id repeated in cmds is inserted
	// once, and the later ones answer that insert.
	var ins []int
	first := map[reqKey]int{}
	dup := map[int]int{}
	for i, n := range cmds {
		if out[i].Err != nil {
			continue
		}
		node := nodes[n.NodeID]
		if n.RequestID != "" {
			k := reqKey{n.NodeID, n.RequestID}
			if c, ok := existing[k]; ok {
				out[i].QueuedCommand = QueuedCommand{Command: c, Existing: true}
				continue
			}
			if j, ok := first[k]; ok {
				dup[i] = j
				continue
			}
			first[k] = i
		}
		switch {
		case node.revoked:
			out[i].Err = &NodeNotRunnableError{NodeID: n.NodeID, Reason: "node " + n.NodeID + " is revoked"}
		case node.state != "adopted":
			out[i].Err = &NodeNotRunnableError{NodeID: n.NodeID,
				Reason: fmt.Sprintf("node %s is not adopted (it is %s)", n.NodeID, node.state)}
		default:
			ins = append(ins, i)
		}
	}
	if len(ins) > 0 {
		if err := insertCommands(ctx, q, intent, now, cmds, ins, nodes, out); err != nil {
			return nil, err
		}
	}
	for i, j := range dup {
		out[i] = QueueResult{QueuedCommand: QueuedCommand{Command: out[j].Command, Existing: true}, Err: out[j].Err}
	}
	return out, nil
}

// insertCommands inserts cmds[ins] (valid, on locked nodes), signs them,
// writes their command.queued events and pokes their gateways, filling
// out[ins]. A command whose request id a concurrent transaction used first
// answers that transaction's command.
func insertCommands(ctx context.Context, q DBTX, intent *IntentSigner, now time.Time, cmds []NewCommand, ins []int,
	nodes map[string]queueNode, out []QueueResult,
) error {
	n := len(ins)
	id, node, kind, created, reqs, tenant := make([]string, n), make([]string, n), make([]string, n), make([]string, n),
		make([]*string, n), make([]string, n)
	safe := make([]bool, n)
	deadline := make([]time.Time, n)
	for k, i := range ins {
		c := cmds[i]
		id[k], node[k], kind[k], created[k], deadline[k], tenant[k] = c.ID, c.NodeID, c.Kind, c.CreatedBy, c.Deadline,
			nodes[c.NodeID].tenant
		safe[k], _ = CommandRetrySafe(c.Kind)
		if c.RequestID != "" {
			reqs[k] = &cmds[i].RequestID
		}
	}
	// The rows as stored (timestamps rounded to the microsecond), read back
	// by the insert itself.
	rows, err := q.Query(ctx, `INSERT INTO commands AS c (id, node_id, kind, args, purpose, state, retry_safe,
			deadline, created_by, created_at, updated_at, request_id)
		SELECT u.id, u.node, u.kind, '{}', 'user', 'queued', u.safe, u.deadline, u.created, $7, $7, u.req
		FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[], $5::timestamptz[], $6::text[], $8::text[])
			WITH ORDINALITY AS u(id, node, kind, safe, deadline, created, req, ord)
		ORDER BY u.ord
		ON CONFLICT (node_id, request_id) WHERE request_id IS NOT NULL DO NOTHING
		RETURNING c.id, c.node_id, '', c.kind, c.purpose, c.state, c.retry_safe, c.deadline, c.result, c.error,
			c.deliveries, COALESCE(c.request_id, ''), c.created_by, c.created_at, c.updated_at, c.delivered_at, c.finished_at`,
		id, node, kind, safe, deadline, created, now, reqs)
	if err != nil {
		return queryErr("queue commands", err)
	}
	stored := make(map[string]Command, n)
	for rows.Next() {
		c, err := scanCommand(rows)
		if err != nil {
			rows.Close()
			return queryErr("queue commands", err)
		}
		stored[c.ID] = c
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return queryErr("queue commands", err)
	}
	var signed []string
	events := make([]ReservationEvent, 0, n)
	pokes := map[string][]string{}
	for k, i := range ins {
		c, ok := stored[id[k]]
		if !ok {
			// A concurrent call with the same request id committed first.
			prev, err := commandByRequest(ctx, q, node[k], cmds[i].RequestID)
			if err != nil {
				return err
			}
			out[i].QueuedCommand = QueuedCommand{Command: prev, Existing: true}
			continue
		}
		c.TenantID = tenant[k]
		out[i].QueuedCommand = QueuedCommand{Command: c}
		signed = append(signed, c.ID)
		data, err := json.Marshal(map[string]any{"commandId": c.ID, "nodeId": c.NodeID, "kind": c.Kind,
			"deadline": cmds[i].Deadline.UTC()})
		if err != nil {
			return err
		}
		events = append(events, ReservationEvent{TenantID: c.TenantID, Type: EventCommandQueued, SubjectID: c.ID, Data: data})
		if gw := nodes[c.NodeID].gatewayID; gw != nil && !slices.Contains(pokes[*gw], c.NodeID) {
			pokes[*gw] = append(pokes[*gw], c.NodeID)
		}
	}
	if err := SignCommands(ctx, q, intent, signed); err != nil {
		return err
	}
	if err := InsertReservationEvents(ctx, q, now, events); err != nil {
		return err
	}
	// One poke per gateway holding a session of the nodes, which the
	// locked rows named.
	gws := slices.Sorted(maps.Keys(pokes))
	subjects, payloads := make([]string, len(gws)), make([][]byte, len(gws))
	for k, gw := range gws {
		p, err := json.Marshal(Poke{NodeIDs: pokes[gw]})
		if err != nil {
			return err
		}
		subjects[k], payloads[k] = SubjectPokeGatewayPrefix+gw, p
	}
	return EnqueueMany(ctx, q, now, subjects, payloads)
}

// commandsByRequest returns the commands with the (node, request id)
// pairs of nodeIDs and requestIDs (same length).
func commandsByRequest(ctx context.Context, q DBTX, nodeIDs, requestIDs []string) ([]Command, error) {
	rows, err := q.Query(ctx, `SELECT `+commandColumns+commandFrom+`
		JOIN unnest($1::text[], $2::text[]) AS r(node, req) ON c.node_id = r.node AND c.request_id = r.req`,
		nodeIDs, requestIDs)
	if err != nil {
		return nil, queryErr("commands of requests", err)
	}
	defer rows.Close()
	var out []Command
	for rows.Next() {
		c, err := scanCommand(rows)
		if err != nil {
			return nil, queryErr("commands of requests", err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, queryErr("commands of requests", err)
	}
	return out, nil
}

func commandByRequest(ctx context.Context, q DBTX, nodeID, requestID string) (Command, error) {
	c, err := scanCommand(q.QueryRow(ctx, `SELECT `+commandColumns+commandFrom+`
		WHERE c.node_id = $1 AND c.request_id = $2`, nodeID, requestID))
	if err != nil {
		return Command{}, queryErr("command of request "+requestID, err)
	}
	return c, nil
}

// ExpireDueCommands moves up to limit open user commands whose deadline is
// at or before now to expired ("deadline passed" as error, unless the daemon
// reported one), skipping rows another transaction holds, writes a
// command.expired event for each and returns the commands it expired.
// Acceptance commands are left to the acceptance reconciler.
func ExpireDueCommands(ctx context.Context, q DBTX, now time.Time, limit int) ([]Command, error) {
	rows, err := q.Query(ctx, `WITH due AS (
			SELECT id FROM commands WHERE state IN ('queued', 'delivered', 'running') AND purpose = 'user'
				AND deadline <= $1 ORDER BY deadline, id LIMIT $2 FOR UPDATE SKIP LOCKED)
		UPDATE commands c SET state = 'expired', error = CASE WHEN c.error = '' THEN 'deadline passed' ELSE c.error END,
			finished_at = $1, updated_at = $1
		FROM due WHERE c.id = due.id RETURNING c.id`, now, limit)
	if err != nil {
		return nil, queryErr("expire commands", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, queryErr("expire commands", err)
	}
	if len(ids) == 0 {
		return nil, nil
	}
	cmds, err := commandsByID(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	if err := insertCommandEvents(ctx, q, now, EventCommandExpired, cmds); err != nil {
		return nil, err
	}
	return cmds, nil
}

// commandsByID returns the commands ids, ordered by id.
func commandsByID(ctx context.Context, q DBTX, ids []string) ([]Command, error) {
	rows, err := q.Query(ctx, `SELECT `+commandColumns+commandFrom+` WHERE c.id = ANY($1) ORDER BY c.id`, ids)
	if err != nil {
		return nil, queryErr("read commands", err)
	}
	defer rows.Close()
	var out []Command
	for rows.Next() {
		c, err := scanCommand(rows)
		if err != nil {
			return nil, queryErr("read commands", err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, queryErr("read commands", err)
	}
	return out, nil
}

// insertCommandEvents writes an event of type typ for each of cmds (tenant:
// the command's; subject: its id).
func insertCommandEvents(ctx context.Context, q DBTX, now time.Time, typ string, cmds []Command) error {
	events := make([]ReservationEvent, 0, len(cmds))
	for _, c := range cmds {
		e, err := commandEvent(typ, c)
		if err != nil {
			return err
		}
		events = append(events, e)
	}
	return InsertReservationEvents(ctx, q, now, events)
}

// commandEvent is the event of type typ of command c: tenant the command's,
// subject its id, data its id, node, kind, state and error.
func commandEvent(typ string, c Command) (ReservationEvent, error) {
	d := map[string]any{"commandId": c.ID, "nodeId": c.NodeID, "kind": c.Kind, "state": c.State}
	if c.Error != "" {
		d["error"] = c.Error
	}
	data, err := json.Marshal(d)
	if err != nil {
		return ReservationEvent{}, err
	}
	return ReservationEvent{TenantID: c.TenantID, Type: typ, SubjectID: c.ID, Data: data}, nil
}
