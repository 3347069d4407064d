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

// QueueCommand queues n on its node in q's transaction: it locks the node
// (refusing one that is not adopted or is revoked with a
// *NodeNotRunnableError), inserts the command as queued with its kind's
// retry-safety and purpose 'user', signs it with intent (nil: unsigned),
// writes a command.queued event for the node's tenant and pokes the gateway
// holding the node's session. A request id already used on the node
// returns that command with Existing and writes nothing. Errors:
// ErrNotFound (node unknown, or of a tenant other than n.TenantID), an
// error for an unknown kind.
func QueueCommand(ctx context.Context, q DBTX, intent *IntentSigner, now time.Time, n NewCommand) (QueuedCommand, error) {
	retrySafe, ok := CommandRetrySafe(n.Kind)
	if !ok {
		return QueuedCommand{}, fmt.Errorf("unknown command kind %q", n.Kind)
	}
	var state, tenant string
	var gatewayID *string
	var revoked bool
	err := q.QueryRow(ctx, `SELECT n.provision_state, n.revoked_at IS NOT NULL, p.owner_tenant_id, n.gateway_id
		FROM nodes n JOIN pools p ON p.id = n.pool_id WHERE n.id = $1 FOR SHARE OF n`, n.NodeID).Scan(&state, &revoked, &tenant, &gatewayID)
	if err != nil {
		return QueuedCommand{}, queryErr("node "+n.NodeID, err)
	}
	if n.TenantID != "" && n.TenantID != tenant {
		return QueuedCommand{}, fmt.Errorf("node %s: %w", n.NodeID, ErrNotFound)
	}
	if n.RequestID != "" {
		c, err := commandByRequest(ctx, q, n.NodeID, n.RequestID)
		if err == nil {
			return QueuedCommand{Command: c, Existing: true}, nil
		}
		if !errors.Is(err, ErrNotFound) {
			return QueuedCommand{}, err
		}
	}
	switch {
	case revoked:
		return QueuedCommand{}, &NodeNotRunnableError{NodeID: n.NodeID, Reason: "node " + n.NodeID + " is revoked"}
	case state != "adopted":
		return QueuedCommand{}, &NodeNotRunnableError{NodeID: n.NodeID,
			Reason: fmt.Sprintf("node %s is not adopted (it is %s)", n.NodeID, state)}
	}
	var requestID *string
	if n.RequestID != "" {
		requestID = &n.RequestID
	}
	// The row as stored (timestamps rounded to the microsecond), read back
	// by the insert itself rather than by another query.
	c, err := scanCommand(q.QueryRow(ctx, `INSERT INTO commands AS c (id, node_id, kind, args, purpose, state, retry_safe,
			deadline, created_by, created_at, updated_at, request_id)
		VALUES ($1, $2, $3, '{}', 'user', 'queued', $4, $5, $6, $7, $7, $8)
		ON CONFLICT (node_id, request_id) WHERE request_id IS NOT NULL DO NOTHING
		RETURNING c.id, c.node_id, $9::text, c.kind, c.purpose, c.state, c.retry_safe, c.deadline, c.result, c.error,
			c.deliveries, COALESCE(c.request_id, ''), c.created_by, c.created_at, c.updated_at, c.delivered_at, c.finished_at`,
		n.ID, n.NodeID, n.Kind, retrySafe, n.Deadline, n.CreatedBy, now, requestID, tenant))
	if errors.Is(err, pgx.ErrNoRows) {
		// A concurrent call with the same request id committed first.
		c, err := commandByRequest(ctx, q, n.NodeID, n.RequestID)
		if err != nil {
			return QueuedCommand{}, err
		}
		return QueuedCommand{Command: c, Existing: true}, nil
	}
	if err != nil {
		return QueuedCommand{}, queryErr("queue command", err)
	}
	if err := SignCommands(ctx, q, intent, []string{n.ID}); err != nil {
		return QueuedCommand{}, err
	}
	data, err := json.Marshal(map[string]any{"commandId": n.ID, "nodeId": n.NodeID, "kind": n.Kind,
		"deadline": n.Deadline.UTC()})
	if err != nil {
		return QueuedCommand{}, err
	}
	if err := InsertReservationEvent(ctx, q, now, tenant, EventCommandQueued, n.ID, data); err != nil {
		return QueuedCommand{}, err
	}
	// PokeNodes for one node, whose gateway the locked row gave.
	if gatewayID != nil {
		payload, err := json.Marshal(Poke{NodeIDs: []string{n.NodeID}})
		if err != nil {
			return QueuedCommand{}, err
		}
		if err := Enqueue(ctx, q, now, SubjectPokeGatewayPrefix+*gatewayID, payload); err != nil {
			return QueuedCommand{}, err
		}
	}
	return QueuedCommand{Command: c}, nil
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
