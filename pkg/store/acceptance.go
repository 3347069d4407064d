package store

// Queries of the controllers' acceptance reconciler: joining nodes get a
// diag.nvml command with purpose 'acceptance' and become accepting; accepting
// nodes whose acceptance command is terminal (or past its deadline) are
// adopted, failed or given a fresh command. Every function works on a batch
// of nodes with a constant number of statements, so that a thousand joining
// nodes cost a handful of round trips.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/telemetry"
)

// ClaimJoiningNodes locks up to limit nodes in state joining, oldest first,
// skipping nodes another transaction holds, and returns their ids. Call it
// in a transaction that moves them on.
func ClaimJoiningNodes(ctx context.Context, q DBTX, limit int) ([]string, error) {
	return queryIDs(ctx, q, "claim joining nodes", `SELECT id FROM nodes WHERE provision_state = 'joining'
		ORDER BY created_at, id LIMIT $1 FOR UPDATE SKIP LOCKED`, limit)
}

// AcceptanceWork is what AnyAcceptanceWork found.
type AcceptanceWork struct {
	// Joining is true when a node is in state joining (ClaimJoiningNodes
	// could claim it).
	Joining bool
	// Due is true when ClaimDueAcceptances at now could claim a node.
	Due bool
}

// AnyAcceptanceWork reports, in one read that locks nothing, whether a node
// is joining and whether an acceptance is due at now: a pass that finds
// neither needs no transaction. ClaimJoiningNodes's claim then finds none
// either, or only nodes committed after this read, whose JoinService poke
// wakes another pass; nodes another transaction holds count (their claim
// then skips them).
func AnyAcceptanceWork(ctx context.Context, q DBTX, now time.Time) (AcceptanceWork, error) {
	var w AcceptanceWork
	// OFFSET 0 keeps the NOT EXISTS a subplan run per accepting node, an
	// index lookup of its open commands (commands_open_idx by node_id):
	// made into an anti join, its plan on a table analyzed while small
	// filtered every open command for every accepting node instead.
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM nodes WHERE provision_state = 'joining'),
		EXISTS (SELECT 1 FROM nodes n
			WHERE n.provision_state = 'accepting' AND NOT EXISTS (
				SELECT 1 FROM commands c WHERE c.node_id = n.id AND c.purpose = 'acceptance'
					AND c.finished_at IS NULL AND c.deadline > $1 OFFSET 0))`, now).Scan(&w.Joining, &w.Due)
	if err != nil {
		return AcceptanceWork{}, fmt.Errorf("any acceptance work: %w", interpretError(err))
	}
	return w, nil
}

// NewAcceptanceCommand is one diag.nvml acceptance command to queue.
type NewAcceptanceCommand struct {
	// ID is "cmd_…" (ids.Command).
	ID     string
	NodeID string
}

// QueueAcceptanceCommands inserts cmds as queued, retry-safe diag.nvml
// commands with purpose 'acceptance', created by "controllers" at now with
// deadline, and signs them with intent (nil: unsigned; see SignCommands).
func QueueAcceptanceCommands(ctx context.Context, q DBTX, intent *IntentSigner, now, deadline time.Time, cmds []NewAcceptanceCommand) error {
	if len(cmds) == 0 {
		return nil
	}
	ids := make([]string, len(cmds))
	nodes := make([]string, len(cmds))
	for i, c := range cmds {
		ids[i], nodes[i] = c.ID, c.NodeID
	}
	_, err := q.Exec(ctx, `INSERT INTO commands (id, node_id, kind, args, purpose, state, retry_safe, deadline,
			created_by, created_at, updated_at)
		SELECT u.id, u.node_id, 'diag.nvml', '{}', 'acceptance', 'queued', true, $3, 'controllers', $4, $4
		FROM unnest($1::text[], $2::text[]) AS u(id, node_id)`, ids, nodes, deadline, now)
	if err != nil {
		return fmt.Errorf("queue acceptance commands: %w", interpretError(err))
	}
	return SignCommands(ctx, q, intent, ids)
}

// StartAcceptance starts the acceptance of joining nodes claimed by
// ClaimJoiningNodes in q's transaction, in one statement: it inserts cmds as
// QueueAcceptanceCommands does (deadline truncated to the microsecond, as
// stored), signed with intent (nil: unsigned) over what the gateway will
// read back (kind diag.nvml, args {}, the deadline, retry-safe; see
// CommandMessage), moves their nodes to accepting as MarkNodesAccepting does,
// and enqueues the poke of each gateway holding a session of one of them as
// PokeNodes does. It returns the ids of the nodes it moved: a node no longer
// joining or accepting gets no command either.
func StartAcceptance(ctx context.Context, q DBTX, intent *IntentSigner, now, deadline time.Time, cmds []NewAcceptanceCommand) ([]string, error) {
	if len(cmds) == 0 {
		return nil, nil
	}
	deadline = deadline.Truncate(time.Microsecond)
	ids := make([]string, len(cmds))
	nodes := make([]string, len(cmds))
	sigs := make([][]byte, len(cmds))
	for i, c := range cmds {
		ids[i], nodes[i] = c.ID, c.NodeID
		if intent == nil {
			continue
		}
		sig, err := intent.CommandSignature(c.NodeID, CommandMessage(SessionCommand{ID: c.ID, Kind: "diag.nvml",
			Args: []byte("{}"), Deadline: deadline, RetrySafe: true}))
		if err != nil {
			return nil, fmt.Errorf("sign command %s: %w", c.ID, err)
		}
		sigs[i] = sig
	}
	rows, err := q.Query(ctx, `WITH mark AS (
			UPDATE nodes SET provision_state = 'accepting', provision_reason = '', updated_at = $4
			WHERE id = ANY($2) AND provision_state IN ('joining', 'accepting') RETURNING id, gateway_id),
		cmd AS (
			INSERT INTO commands (id, node_id, kind, args, purpose, state, retry_safe, deadline, signature,
				created_by, created_at, updated_at)
			SELECT u.id, u.node_id, 'diag.nvml', '{}', 'acceptance', 'queued', true, $3, u.sig, 'controllers', $4, $4
			FROM unnest($1::text[], $2::text[], $5::bytea[]) AS u(id, node_id, sig) JOIN mark ON mark.id = u.node_id
			RETURNING id),
		pk AS (
			INSERT INTO outbox (subject, payload, created_at, traceparent)
			SELECT $6 || gateway_id, convert_to(jsonb_build_object('nodeIds', array_agg(id ORDER BY id))::text, 'UTF8'), $4, $7
			FROM mark WHERE gateway_id IS NOT NULL GROUP BY gateway_id
			RETURNING id)
		SELECT id, (SELECT count(*) FROM cmd), (SELECT count(*) FROM pk) FROM mark ORDER BY id`,
		ids, nodes, deadline, now, sigs, SubjectPokeGatewayPrefix, telemetry.Traceparent(ctx))
	if err != nil {
		return nil, fmt.Errorf("start acceptance: %w", interpretError(err))
	}
	defer rows.Close()
	var (
		started       []string
		queued, poked int
	)
	for rows.Next() {
		var id string
		if err := rows.Scan(&id, &queued, &poked); err != nil {
			return nil, fmt.Errorf("start acceptance: %w", err)
		}
		started = append(started, id)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("start acceptance: %w", interpretError(err))
	}
	if queued != len(started) {
		return nil, fmt.Errorf("start acceptance: %d commands for %d nodes", queued, len(started))
	}
	if poked > 0 {
		if err := signalOutbox(ctx, q); err != nil {
			return nil, err
		}
	}
	return started, nil
}

// MarkNodesAccepting moves nodes that are joining or accepting to accepting
// (stamping updated_at) and returns the ids it changed.
func MarkNodesAccepting(ctx context.Context, q DBTX, now time.Time, nodeIDs []string) ([]string, error) {
	if len(nodeIDs) == 0 {
		return nil, nil
	}
	return queryIDs(ctx, q, "mark nodes accepting", `UPDATE nodes SET provision_state = 'accepting', provision_reason = '',
		updated_at = $2 WHERE id = ANY($1) AND provision_state IN ('joining', 'accepting') RETURNING id`, nodeIDs, now)
}

// ClaimDueAcceptances locks up to limit accepting nodes that have no open
// acceptance command before its deadline (their command finished, expired,
// ran out of time, or is missing), skipping nodes another transaction holds,
// and returns their ids. Read what to do with them with AcceptanceChecks in
// the same transaction: its snapshot is taken after the locks.
func ClaimDueAcceptances(ctx context.Context, q DBTX, now time.Time, limit int) ([]string, error) {
	// OFFSET 0: a subplan per node, as in AnyAcceptanceWork.
	return queryIDs(ctx, q, "claim due acceptances", `SELECT n.id FROM nodes n
		WHERE n.provision_state = 'accepting' AND NOT EXISTS (
			SELECT 1 FROM commands c WHERE c.node_id = n.id AND c.purpose = 'acceptance'
				AND c.finished_at IS NULL AND c.deadline > $1 OFFSET 0)
		ORDER BY n.id LIMIT $2 FOR UPDATE OF n SKIP LOCKED`, now, limit)
}

// AcceptanceCheck is what the reconciler needs to decide about one accepting
// node: its pool's rules and its latest acceptance command.
type AcceptanceCheck struct {
	NodeID        string
	PoolID        string
	SiteID        string
	OwnerTenantID string
	// GPUModel and ExpectGPUCount are the pool's acceptance rules.
	GPUModel       string
	ExpectGPUCount int32
	// CommandID is the latest acceptance command, "" when there is none;
	// the Command fields below are then zero.
	CommandID    string
	CommandState string
	// CommandResult is the command's result (protojson of
	// gatewayv1.CommandResult), nil when it has none.
	CommandResult []byte
	CommandError  string
	// CommandDeadline is when the node must have answered.
	CommandDeadline time.Time
	// Attempts is how many acceptance commands reached the node (were
	// delivered at least once). A command that expired undelivered, while the
	// node had no session, does not count: a machine that joined during a
	// gateway outage is tried again once it connects.
	Attempts int
}

// AcceptanceChecks returns, for those of nodeIDs still accepting, their
// pool's rules and latest acceptance command, ordered by node id.
func AcceptanceChecks(ctx context.Context, q DBTX, nodeIDs []string) ([]AcceptanceCheck, error) {
	if len(nodeIDs) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `SELECT n.id, n.pool_id, p.site_id, p.owner_tenant_id, p.gpu_model, p.expect_gpu_count,
			COALESCE(c.id, ''), COALESCE(c.state, ''), c.result, COALESCE(c.error, ''), c.deadline,
			(SELECT count(*) FROM commands a WHERE a.node_id = n.id AND a.purpose = 'acceptance' AND a.deliveries > 0)
		FROM nodes n JOIN pools p ON p.id = n.pool_id
		LEFT JOIN LATERAL (SELECT id, state, result, error, deadline FROM commands
			WHERE node_id = n.id AND purpose = 'acceptance' ORDER BY created_at DESC, id DESC LIMIT 1) c ON true
		WHERE n.id = ANY($1) AND n.provision_state = 'accepting'
		ORDER BY n.id`, nodeIDs)
	if err != nil {
		return nil, fmt.Errorf("read acceptance checks: %w", interpretError(err))
	}
	defer rows.Close()
	var out []AcceptanceCheck
	for rows.Next() {
		var c AcceptanceCheck
		var deadline *time.Time
		if err := rows.Scan(&c.NodeID, &c.PoolID, &c.SiteID, &c.OwnerTenantID, &c.GPUModel, &c.ExpectGPUCount,
			&c.CommandID, &c.CommandState, &c.CommandResult, &c.CommandError, &deadline, &c.Attempts); err != nil {
			return nil, fmt.Errorf("read acceptance checks: %w", err)
		}
		if deadline != nil {
			c.CommandDeadline = *deadline
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read acceptance checks: %w", interpretError(err))
	}
	return out, nil
}

// ExpiryReasons are the errors ExpireCommands records, chosen by the state
// a command is in when it expires, so that the error says what happened.
type ExpiryReasons struct {
	// Queued is the error of a command never delivered (the node had no
	// session).
	Queued string
	// Delivered is the error of a command delivered but never started.
	Delivered string
	// Running is the error of a command started but not finished.
	Running string
}

// ExpiredCommand is one command ExpireCommands expired.
type ExpiredCommand struct {
	ID string
	// State is the state it expired in: queued, delivered or running.
	State string
}

// ExpireCommands moves those of cmdIDs that are still open (queued,
// delivered, running) to expired, with the error of reasons for the state
// each is in then (read under the row's lock, so a gateway's concurrent
// update is seen) unless it already has one, and returns the commands it
// expired, ordered by id; a command that reached a terminal state meanwhile
// is left alone.
func ExpireCommands(ctx context.Context, q DBTX, now time.Time, cmdIDs []string, reasons ExpiryReasons) ([]ExpiredCommand, error) {
	if len(cmdIDs) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `WITH old AS (
			SELECT id, state FROM commands WHERE id = ANY($1) AND state IN ('queued', 'delivered', 'running')
			ORDER BY id FOR UPDATE)
		UPDATE commands c SET state = 'expired',
			error = CASE WHEN c.error <> '' THEN c.error
				WHEN old.state = 'queued' THEN $3 WHEN old.state = 'delivered' THEN $4 ELSE $5 END,
			finished_at = $2, updated_at = $2
		FROM old WHERE c.id = old.id RETURNING c.id, old.state`,
		cmdIDs, now, reasons.Queued, reasons.Delivered, reasons.Running)
	if err != nil {
		return nil, fmt.Errorf("expire commands: %w", interpretError(err))
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ExpiredCommand, error) {
		var e ExpiredCommand
		err := r.Scan(&e.ID, &e.State)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("expire commands: %w", interpretError(err))
	}
	slices.SortFunc(out, func(a, b ExpiredCommand) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// Adoption is one accepting node to adopt.
type Adoption struct {
	NodeID        string
	PoolID        string
	OwnerTenantID string
	// Spec is the node's first NodeSpec (protojson of gatewayv1.NodeSpec),
	// stored as generation 1.
	Spec []byte
	// Inventory is what diag.nvml reported (protojson of
	// gatewayv1.Inventory).
	Inventory []byte
	// Devices become the node's node_devices rows.
	Devices []NodeDevice
}

// AdoptNodes moves accepting nodes to adopted at now with spec generation 1,
// their spec carrying the SSH user CAs (SSHUserCAs; signed with intent in the
// same statement, as SignNodeSpecs signs a stored spec; nil: unsigned),
// inventory and devices (replacing any), and writes a node.adopted event for
// each (tenant: the pool's owner; in the statement that adopts them, in the
// order of adoptions) and, when it adopted any, the scheduler's poke
// (SubjectPokeScheduler, as Enqueue writes it: the nodes are new capacity),
// in that statement too. It returns the ids it adopted: a node no longer
// accepting is skipped.
func AdoptNodes(ctx context.Context, q DBTX, intent *IntentSigner, now time.Time, adoptions []Adoption) ([]string, error) {
	if len(adoptions) == 0 {
		return nil, nil
	}
	cas, err := SSHUserCAs(ctx, q)
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(adoptions))
	specs := make([]string, len(adoptions))
	invs := make([]string, len(adoptions))
	sigs := make([][]byte, len(adoptions))
	for i, a := range adoptions {
		spec, err := withSSHUserCAs(a.Spec, cas)
		if err != nil {
			return nil, fmt.Errorf("adopt node %s: %w", a.NodeID, err)
		}
		ids[i], specs[i], invs[i] = a.NodeID, string(spec), string(a.Inventory)
		if intent == nil {
			continue
		}
		// Signed as SignNodeSpecs signs the stored spec: DesiredStateMessage
		// parses it, so jsonb's rewriting of the text changes nothing.
		m, err := DesiredStateMessage(1, spec, nil)
		if err == nil {
			sigs[i], err = intent.SpecSignature(a.NodeID, m)
		}
		if err != nil {
			return nil, fmt.Errorf("sign the spec of node %s: %w", a.NodeID, err)
		}
	}
	// The devices first, while the nodes are accepting: the trigger of
	// node_devices moves only adopted nodes' capacity generations (migration
	// 000021), so the adoption below writes each node's row once, and its
	// generation moves there. The nodes stay accepting until the adoption:
	// replaceNodeDevices locks those it finds so.
	devices := make(map[string][]NodeDevice, len(adoptions))
	for _, a := range adoptions {
		devices[a.NodeID] = a.Devices
	}
	accepting, err := replaceNodeDevices(ctx, q, "adopt nodes", NodeAccepting, ids, devices)
	if err != nil {
		return nil, err
	}
	if len(accepting) == 0 {
		return nil, nil
	}
	// The node.adopted events, written by the statement for the nodes it
	// adopted, in the order of adoptions.
	events := make([]NewEvent, len(adoptions))
	for i, a := range adoptions {
		events[i] = NewEvent{TenantID: a.OwnerTenantID,
			Data: NodeAdoptedData{NodeID: a.NodeID, PoolID: a.PoolID, GPUs: len(a.Devices)}}
	}
	cols, err := encodeEvents(events)
	if err != nil {
		return nil, err
	}
	rows, err := q.Query(ctx, `WITH u AS (
			SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $5::bytea[], $6::text[], $7::text[])
				WITH ORDINALITY AS u(id, spec, inv, sig, tenant, data, ord)),
		upd AS (
			UPDATE nodes n SET provision_state = 'adopted', provision_reason = '',
				adopted_at = $4, spec_generation = 1, spec = u.spec::jsonb, spec_signature = u.sig, inventory = u.inv::jsonb,
				updated_at = $4
			FROM u WHERE n.id = u.id AND n.provision_state = 'accepting' RETURNING n.id),
		src AS (
			SELECT u.ord, u.tenant, '`+EventNodeAdopted+`' AS type, u.id AS subject, u.data::jsonb AS data, $4::timestamptz AS at
			FROM u JOIN upd ON upd.id = u.id),
		`+eventWriterCTE("src")+`,
		sched AS (
			INSERT INTO outbox (subject, payload, created_at, traceparent)
			SELECT $8, '', $4, $9 WHERE EXISTS (SELECT 1 FROM upd))
		SELECT id, `+eventCountSQL+` FROM upd`, ids, specs, invs, now, sigs, cols.tenants, cols.data,
		SubjectPokeScheduler, telemetry.Traceparent(ctx))
	if err != nil {
		return nil, fmt.Errorf("adopt nodes: %w", interpretError(err))
	}
	var (
		adopted []string
		written int
	)
	for rows.Next() {
		var id string
		if err := rows.Scan(&id, &written); err != nil {
			rows.Close()
			return nil, fmt.Errorf("adopt nodes: %w", err)
		}
		adopted = append(adopted, id)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("adopt nodes: %w", interpretError(err))
	}
	if len(adopted) == 0 {
		return nil, nil
	}
	if written != len(adopted) {
		return nil, fmt.Errorf("adopt nodes: %d events for %d adoptions", written, len(adopted))
	}
	// Only the adopted nodes have events: their tenants and type.
	tenants, types := make([]string, 0, len(adopted)), make([]string, 0, len(adopted))
	for _, a := range adoptions {
		if slices.Contains(adopted, a.NodeID) {
			tenants, types = append(tenants, a.OwnerTenantID), append(types, EventNodeAdopted)
		}
	}
	hintEvents(q, eventHints(tenants, types))
	pokeAfterCommit(q, SubjectPokeScheduler, nil, 0)
	if err := signalOutbox(ctx, q); err != nil {
		return nil, fmt.Errorf("adopt nodes: signal the outbox: %w", interpretError(err))
	}
	return adopted, nil
}

// AcceptanceFailure is one accepting node that failed acceptance.
type AcceptanceFailure struct {
	NodeID        string
	PoolID        string
	OwnerTenantID string
	// Reason is a human sentence, stored as provision_reason.
	Reason string
	// Inventory, when not nil, replaces the node's inventory (protojson of
	// gatewayv1.Inventory), so operators see what was found.
	Inventory []byte
	// Devices, with Inventory, replace the node's node_devices rows: the
	// GPUs the machine reported, so that operators see them (nodes get).
	// They are never placed on: placement takes adopted nodes only
	// (PoolCapacity), and CreateReservation does not count them. Ignored
	// when Inventory is nil (nothing was reported: the rows are kept).
	Devices []NodeDevice
}

// FailAcceptance moves accepting nodes to acceptance_failed with their
// reasons, their inventory and devices when reported, and writes a
// node.acceptance_failed event for each (tenant: the pool's owner). It
// returns the ids it changed: a node no longer accepting is skipped.
func FailAcceptance(ctx context.Context, q DBTX, now time.Time, failures []AcceptanceFailure) ([]string, error) {
	if len(failures) == 0 {
		return nil, nil
	}
	ids := make([]string, len(failures))
	reasons := make([]string, len(failures))
	invs := make([]*string, len(failures))
	for i, f := range failures {
		ids[i], reasons[i] = f.NodeID, f.Reason
		if f.Inventory != nil {
			s := string(f.Inventory)
			invs[i] = &s
		}
	}
	failed, err := queryIDs(ctx, q, "fail acceptance", `UPDATE nodes n SET provision_state = 'acceptance_failed',
			provision_reason = u.reason, inventory = COALESCE(u.inv::jsonb, n.inventory), updated_at = $4
		FROM unnest($1::text[], $2::text[], $3::text[]) AS u(id, reason, inv)
		WHERE n.id = u.id AND n.provision_state = 'accepting' RETURNING n.id`, ids, reasons, invs, now)
	if err != nil {
		return nil, err
	}
	done := make(map[string]bool, len(failed))
	for _, id := range failed {
		done[id] = true
	}
	var (
		events   []NewEvent
		reported []string
	)
	devices := make(map[string][]NodeDevice)
	for _, f := range failures {
		if !done[f.NodeID] {
			continue
		}
		events = append(events, NewEvent{TenantID: f.OwnerTenantID,
			Data: NodeAcceptanceFailedData{NodeID: f.NodeID, PoolID: f.PoolID, Reason: f.Reason}})
		if f.Inventory != nil {
			reported = append(reported, f.NodeID)
			devices[f.NodeID] = f.Devices
		}
	}
	if _, err := replaceNodeDevices(ctx, q, "fail acceptance", "", reported, devices); err != nil {
		return nil, err
	}
	if err := WriteEvents(ctx, q, now, events...); err != nil {
		return nil, err
	}
	return failed, nil
}
