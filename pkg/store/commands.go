package store

// Commands run by users (docs/architecture.md, "Commands", invariant I2): RunCommand queues a signed
// command for one node, the gateway delivers it, the daemon runs it at most
// once (its journal answers a redelivery) and reports; the command expiry
// reconciler ends what is still open at its deadline. A command belongs to
// its node's tenant (the pool's owner). Every state change here writes its
// event (command.queued, command.succeeded, command.failed,
// command.expired) through WriteEvents in the same transaction.

import (
	"context"
	"errors"
	"fmt"
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

// CommandErrTextExpired is the error a daemon reports, with state failed,
// for a command it received after its deadline (pkg/daemon ErrTextExpired:
// daemons report only running, succeeded and failed).
// ApplySessionCommandUpdates records such a failure as expired.
const CommandErrTextExpired = "deadline passed before the command started"

// commandErrDeadline is the error of a command that expired.
const commandErrDeadline = "deadline passed"

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

// GetCommand returns command id with its tenant when scope includes that
// tenant. Errors: ErrNotFound (missing, or outside scope).
func GetCommand(ctx context.Context, q DBTX, scope Scope, id string) (Command, error) {
	c, err := scanCommand(q.QueryRow(ctx, `SELECT `+commandColumns+commandFrom+`
		WHERE c.id = $1 AND ($2::text IS NULL OR p.owner_tenant_id = $2)`, id, scope.arg()))
	if err != nil {
		return Command{}, queryErr("command "+id, err)
	}
	return c, nil
}

// CommandFilter selects commands for ListCommands.
type CommandFilter struct {
	// Scope keeps the commands of nodes its tenants own (the zero Scope:
	// none).
	Scope Scope
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
		WHERE ($1::text IS NULL OR p.owner_tenant_id = $1) AND ($2 = '' OR c.node_id = $2) AND ($3 = '' OR c.id < $3)
		ORDER BY c.id DESC LIMIT $4`, f.Scope.arg(), f.NodeID, f.Before, f.Limit)
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
	// Scope is whose nodes the caller may run commands on: a node whose
	// pool's owner is outside it is refused with ErrNotFound, as an unknown
	// one is (the zero Scope refuses every node).
	Scope Scope
	// Audit, when set, is the audit row of the call that queues the
	// command: QueueCommands writes it with the command (its TenantID,
	// TokenID, Role and Procedure are used; At, Target, Outcome and Detail
	// are set there).
	Audit *AuditEntry
	// Traceparent is the W3C trace context of the call that queues the
	// command (telemetry.Traceparent of its context), "" for none: stored
	// with the command and with its gateway poke (docs/architecture.md,
	// "Traces").
	Traceparent string
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
	// GatewayID is the gateway that held the node's session when a new
	// command was queued ("" when none did): the poke went to it.
	GatewayID string
	// PokeID is the outbox row id of that gateway's poke (0 when none):
	// a writer that publishes the poke itself names the row in the
	// message's OutboxIDHeader, as the relay does, so that the gateway acts
	// on one of the two copies.
	PokeID int64
	// Err is ErrNotFound (node unknown, or of a tenant outside the
	// command's Scope), a *NodeNotRunnableError, or an error for an
	// unknown kind; nothing was written for the command then.
	Err error
}

// QueueCommands queues cmds in one statement (one round trip, whatever
// their number: the API batches concurrent RunCommand calls into one call),
// in q's transaction or, on DB.AutoCommit, in a transaction of its own. For
// each command it locks the node FOR KEY SHARE (in node id order, so
// concurrent batches do not deadlock). That lock conflicts only with FOR
// UPDATE, which the writers of what it checks take (OpenSessions moving the
// session, RevokeNode, acceptance): a session opening on another gateway
// waits for the commit, then claims the command, and the poke goes to the
// gateway read, which still holds the session. Writers of other columns
// (last_seen flushes, cordon, specs) lock FOR NO KEY UPDATE and neither wait
// for it nor make it wait. It refuses one that is unknown or of a
// tenant outside the command's Scope (ErrNotFound) or is not adopted or is
// revoked (*NodeNotRunnableError), inserts the command as queued with its kind's
// retry-safety and purpose 'user', signed with intent (nil: unsigned),
// writes a command.queued event for the node's tenant, pokes the gateways
// holding the nodes' sessions (one poke per gateway) and writes the
// command's Audit row when it has one. A request id already used on the
// node — before or earlier in cmds — answers that command with Existing and
// writes only its audit row (none when its kind differs: the caller refuses
// that). Per-command refusals are in the results (one per command, in
// order); the error is the database's and fails them all.
func QueueCommands(ctx context.Context, q DBTX, intent *IntentSigner, now time.Time, cmds []NewCommand) ([]QueueResult, error) {
	out := make([]QueueResult, len(cmds))
	// Every call goes to the statement, repeats of a request id included:
	// each is checked against its own scope, the first of a node's request
	// id inserts, and the others find its command (queueCommands) with an
	// audit row of their own.
	var sent []int // indexes of cmds sent to the database
	for i, n := range cmds {
		if _, ok := CommandRetrySafe(n.Kind); !ok {
			out[i].Err = fmt.Errorf("unknown command kind %q", n.Kind)
			continue
		}
		sent = append(sent, i)
	}
	if len(sent) > 0 {
		if err := queueCommands(ctx, q, intent, now, cmds, sent, out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// queueSQL is QueueCommands' statement. Its CTEs: u the commands sent, n
// their nodes locked in id order, ok those of the caller's tenant, prev the
// commands of request ids already used, cand the commands to insert, done
// those inserted, queued their command.queued events (type and data
// encoded by encodeEvents, tenant the node's), then the events
// (eventWriterCTE), the gateway pokes and the audit rows. It returns, per
// command in order, what the node was, the outbox id of its gateway's poke
// (0: none), whether the command was inserted, the events and the pokes
// written, and, for a request id already used, that command.
var queueSQL = `WITH u AS (
		SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[], $5::timestamptz[], $6::text[], $7::text[],
			$8::text[], $9::bytea[], $10::text[], $11::text[], $12::text[], $13::text[], $14::bool[], $15::text[], $18::text[],
			$19::text[])
			WITH ORDINALITY AS u(id, node, kind, safe, deadline, created_by, req, scope, sig, a_tenant, a_token, a_role,
				a_proc, audit, ev_type, ev_data, tp, ord)),
	n AS (
		SELECT n.id, n.provision_state, n.revoked_at IS NOT NULL AS revoked, p.owner_tenant_id AS tenant, n.gateway_id
		FROM nodes n JOIN pools p ON p.id = n.pool_id
		WHERE n.id = ANY($16::text[]) ORDER BY n.id FOR KEY SHARE OF n),
	ok AS (
		SELECT u.*, n.tenant, n.gateway_id, n.provision_state, n.revoked FROM u JOIN n ON n.id = u.node
		WHERE u.scope IS NULL OR u.scope = n.tenant),
	prev AS (
		SELECT ok.ord, c.id, c.node_id, c.kind, c.purpose, c.state, c.retry_safe, c.deadline, c.result, c.error,
			c.deliveries, c.request_id, c.created_by, c.created_at, c.updated_at, c.delivered_at, c.finished_at
		FROM ok JOIN commands c ON c.node_id = ok.node AND c.request_id = ok.req WHERE ok.req <> ''),
	cand AS (
		SELECT ok.* FROM ok WHERE NOT ok.revoked AND ok.provision_state = 'adopted'
			AND NOT EXISTS (SELECT 1 FROM prev WHERE prev.ord = ok.ord)),
	ins AS (
		INSERT INTO commands AS c (id, node_id, kind, args, purpose, state, retry_safe, deadline, created_by, created_at,
			updated_at, request_id, signature, traceparent)
		SELECT id, node, kind, '{}', 'user', 'queued', safe, deadline, created_by, $17, $17, NULLIF(req, ''), sig, tp
		FROM cand ORDER BY ord
		ON CONFLICT (node_id, request_id) WHERE request_id IS NOT NULL DO NOTHING
		RETURNING c.id),
	done AS (SELECT cand.* FROM cand JOIN ins ON ins.id = cand.id),
	queued AS (SELECT ord, tenant, ev_type AS type, id AS subject, ev_data::jsonb AS data, $17::timestamptz AS at FROM done),
	` + eventWriterCTE("queued") + `,
	poke AS (
		INSERT INTO outbox (subject, payload, created_at, traceparent)
		SELECT '` + SubjectPokeGatewayPrefix + `' || gateway_id,
			convert_to(jsonb_build_object('nodeIds', array_agg(DISTINCT node ORDER BY node))::text, 'UTF8'), $17,
			(array_agg(tp ORDER BY ord))[1]
		FROM done WHERE gateway_id IS NOT NULL GROUP BY gateway_id ORDER BY gateway_id
		RETURNING id, subject),
	aud AS (
		INSERT INTO audit (at, tenant_id, token_id, role, procedure, target, outcome, detail)
		SELECT $17, NULLIF(ok.a_tenant, ''), NULLIF(ok.a_token, ''), ok.a_role, ok.a_proc, COALESCE(d.id, p.id), 'ok',
			left(CASE WHEN d.id IS NOT NULL THEN format('queued %s on %s', ok.kind, ok.node)
				ELSE format('request_id %s: %s already queued', ok.req, p.id) END, 1024)
		FROM ok LEFT JOIN done d ON d.ord = ok.ord LEFT JOIN prev p ON p.ord = ok.ord
		WHERE ok.audit AND (d.id IS NOT NULL OR p.kind = ok.kind)
		ORDER BY ok.ord
		RETURNING id)
	SELECT u.ord, n.id IS NOT NULL, COALESCE(n.provision_state, ''), COALESCE(n.revoked, false), COALESCE(n.tenant, ''),
		COALESCE(n.gateway_id, ''),
		COALESCE((SELECT pk.id FROM poke pk WHERE pk.subject = '` + SubjectPokeGatewayPrefix + `' || n.gateway_id), 0),
		EXISTS (SELECT 1 FROM done WHERE done.ord = u.ord), ` + eventCountSQL + `, (SELECT count(*) FROM poke),
		p.id, p.node_id, p.kind, p.purpose, p.state, p.retry_safe, p.deadline, p.result, p.error, p.deliveries,
		COALESCE(p.request_id, ''), p.created_by, p.created_at, p.updated_at, p.delivered_at, p.finished_at
	FROM u LEFT JOIN n ON n.id = u.node LEFT JOIN prev p ON p.ord = u.ord
	ORDER BY u.ord`

// queueCommands runs queueSQL for cmds[sent] (known kinds) and fills
// out[sent].
func queueCommands(ctx context.Context, q DBTX, intent *IntentSigner, now time.Time, cmds []NewCommand, sent []int,
	out []QueueResult,
) error {
	k := len(sent)
	id, node, kind, created, req := make([]string, k), make([]string, k), make([]string, k), make([]string, k),
		make([]string, k)
	scope := make([]*string, k)
	aTenant, aToken, aRole, aProc := make([]string, k), make([]string, k), make([]string, k), make([]string, k)
	safe, audit := make([]bool, k), make([]bool, k)
	deadline := make([]time.Time, k)
	sig := make([][]byte, k)
	tp := make([]string, k)
	events := make([]NewEvent, k)
	for x, i := range sent {
		c := cmds[i]
		// Stored to the microsecond: sign and return what is stored.
		d := c.Deadline.UTC().Truncate(time.Microsecond)
		id[x], node[x], kind[x], created[x], req[x], scope[x], deadline[x] = c.ID, c.NodeID, c.Kind, c.CreatedBy,
			c.RequestID, c.Scope.arg(), d
		safe[x], _ = CommandRetrySafe(c.Kind)
		tp[x] = c.Traceparent
		// The tenant is the node's, read by the statement.
		events[x] = NewEvent{Data: CommandQueuedData{CommandID: c.ID, NodeID: c.NodeID, Kind: c.Kind, Deadline: d}}
		if c.Audit != nil {
			audit[x] = true
			aTenant[x], aToken[x], aRole[x], aProc[x] = c.Audit.TenantID, c.Audit.TokenID, c.Audit.Role, c.Audit.Procedure
		}
		if intent != nil {
			s, err := intent.CommandSignature(c.NodeID, CommandMessage(SessionCommand{ID: c.ID, Kind: c.Kind,
				Args: []byte("{}"), Deadline: d, RetrySafe: safe[x]}))
			if err != nil {
				return fmt.Errorf("sign command %s: %w", c.ID, err)
			}
			sig[x] = s
		}
	}
	ev, err := encodeEvents(events)
	if err != nil {
		return err
	}
	nodes := slices.Clone(node)
	slices.Sort(nodes)
	nodes = slices.Compact(nodes)
	rows, err := q.Query(ctx, queueSQL, id, node, kind, safe, deadline, created, req, scope, sig, aTenant, aToken, aRole,
		aProc, audit, ev.types, nodes, now, ev.data, tp)
	if err != nil {
		return queryErr("queue commands", err)
	}
	var written, pokes, queued int64
	var hints []string // the command.queued events' hints, one per tenant
	var raced []int    // request ids an earlier call of the batch, or a concurrent transaction, used first
	for rows.Next() {
		var (
			ord                           int
			found, revoked, inserted      bool
			state, tenant, gateway        string
			pokeID                        int64
			p                             Command
			pid, pnode, pkind, ppurpose   *string
			pstate, perror, pby           *string
			psafe                         *bool
			pdeadline, pcreated, pupdated *time.Time
			pdeliveries                   *int32
		)
		if err := rows.Scan(&ord, &found, &state, &revoked, &tenant, &gateway, &pokeID, &inserted, &written, &pokes,
			&pid, &pnode, &pkind, &ppurpose, &pstate, &psafe, &pdeadline, &p.Result, &perror, &pdeliveries, &p.RequestID,
			&pby, &pcreated, &pupdated, &p.DeliveredAt, &p.FinishedAt); err != nil {
			rows.Close()
			return queryErr("queue commands", err)
		}
		x := ord - 1
		i := sent[x]
		c := cmds[i]
		switch {
		case !found || !c.Scope.Includes(tenant):
			out[i].Err = fmt.Errorf("node %s: %w", c.NodeID, ErrNotFound)
		case pid != nil:
			p.ID, p.NodeID, p.TenantID, p.Kind, p.Purpose, p.State = *pid, *pnode, tenant, *pkind, *ppurpose, *pstate
			p.RetrySafe, p.Deadline, p.Error, p.Deliveries, p.CreatedBy = *psafe, *pdeadline, *perror, *pdeliveries, *pby
			p.CreatedAt, p.UpdatedAt = *pcreated, *pupdated
			out[i].QueuedCommand = QueuedCommand{Command: p, Existing: true}
		case revoked:
			out[i].Err = &NodeNotRunnableError{NodeID: c.NodeID, Reason: "node " + c.NodeID + " is revoked"}
		case state != "adopted":
			out[i].Err = &NodeNotRunnableError{NodeID: c.NodeID,
				Reason: fmt.Sprintf("node %s is not adopted (it is %s)", c.NodeID, state)}
		case inserted:
			out[i].QueuedCommand = QueuedCommand{Command: Command{ID: c.ID, NodeID: c.NodeID, TenantID: tenant, Kind: c.Kind,
				Purpose: "user", State: cmdQueued, RetrySafe: safe[x], Deadline: deadline[x], RequestID: c.RequestID,
				CreatedBy: c.CreatedBy, CreatedAt: now, UpdatedAt: now}}
			out[i].GatewayID, out[i].PokeID = gateway, pokeID
			queued++
			if h := eventHintSubject(tenant, EventCommandQueued); h != "" && !slices.Contains(hints, h) {
				hints = append(hints, h)
			}
		default:
			raced = append(raced, i)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return queryErr("queue commands", err)
	}
	if written != queued {
		return fmt.Errorf("queue commands: %d command.queued events for %d commands", written, queued)
	}
	hintEvents(q, hints)
	if pokes > 0 {
		if err := signalOutbox(ctx, q); err != nil {
			return err
		}
	}
	// A call with the same request id inserted first: earlier in this
	// batch, or in a concurrent call that committed after this statement's
	// snapshot was taken. Answer with its command, read now.
	var audits []AuditEntry
	for _, i := range raced {
		c := cmds[i]
		prev, err := commandByRequest(ctx, q, c.NodeID, c.RequestID)
		if err != nil {
			return err
		}
		out[i].QueuedCommand = QueuedCommand{Command: prev, Existing: true}
		if c.Audit != nil && prev.Kind == c.Kind {
			a := *c.Audit
			a.At, a.Target, a.Outcome = now, prev.ID, "ok"
			a.Detail = fmt.Sprintf("request_id %s: %s already queued", c.RequestID, prev.ID)
			audits = append(audits, a)
		}
	}
	return InsertAudits(ctx, q, audits)
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
			SELECT id FROM commands WHERE finished_at IS NULL AND purpose = 'user'
				AND deadline <= $1 ORDER BY deadline, id LIMIT $2 FOR UPDATE SKIP LOCKED)
		UPDATE commands c SET state = 'expired', error = CASE WHEN c.error = '' THEN $3 ELSE c.error END,
			finished_at = $1, updated_at = $1
		FROM due WHERE c.id = due.id RETURNING c.id`, now, limit, commandErrDeadline)
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
	if err := writeCommandEndedEvents(ctx, q, now, cmds); err != nil {
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

// writeCommandEndedEvents writes the event of the end of each of cmds
// (command.<state>, for the command's tenant) as they are now.
func writeCommandEndedEvents(ctx context.Context, q DBTX, now time.Time, cmds []Command) error {
	events := make([]NewEvent, len(cmds))
	for i, c := range cmds {
		events[i] = NewEvent{TenantID: c.TenantID,
			Data: CommandEndedData{CommandID: c.ID, NodeID: c.NodeID, Kind: c.Kind, State: c.State, Error: c.Error}}
	}
	return WriteEvents(ctx, q, now, events...)
}
