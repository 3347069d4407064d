package store

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// EventTypes are the event types the control plane writes (events.type),
// sorted: every Event* constant of this package, and nothing else (a test
// reads the package's source to check it). A watch refuses a type pattern
// that matches none of them (EventPatternKnown), so a new event type needs
// its constant here as well. Do not modify the slice.
var EventTypes = []string{
	EventCommandExpired,
	EventCommandFailed,
	EventCommandQueued,
	EventCommandSucceeded,
	EventNodeAcceptanceFailed,
	EventNodeAdopted,
	EventNodeCordoned,
	EventNodeJoined,
	EventNodeReachable,
	EventNodeRevoked,
	EventNodeSpecRefused,
	EventNodeUncordoned,
	EventNodeUnreachable,
	EventReservationActive,
	EventReservationBound,
	EventReservationCreated,
	EventReservationExpired,
	EventReservationFailed,
	EventReservationReleased,
}

// EventFamilies returns the prefix patterns that cover EventTypes, one per
// first dotted segment, sorted: "command.*", "node.*", "reservation.*".
func EventFamilies() []string {
	var out []string
	for _, t := range EventTypes {
		family, _, _ := strings.Cut(t, ".")
		if p := family + ".*"; !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	slices.Sort(out)
	return out
}

// EventPatternKnown reports whether the type pattern p (EventFilter.Types)
// matches at least one of EventTypes; a pattern that does not can match no
// event the control plane writes.
func EventPatternKnown(p string) bool {
	return slices.ContainsFunc(EventTypes, func(t string) bool { return typeMatches(p, t) })
}

// Event types written by the acceptance reconciler (events.type).
const (
	EventNodeAdopted          = "node.adopted"
	EventNodeAcceptanceFailed = "node.acceptance_failed"
)

// Event types of user commands (events.type).
const (
	EventCommandQueued    = "command.queued"
	EventCommandSucceeded = "command.succeeded"
	EventCommandFailed    = "command.failed"
	EventCommandExpired   = "command.expired"
)

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

// Event types about nodes (events.type), besides EventNodeAdopted,
// EventNodeAcceptanceFailed, EventNodeRevoked and EventNodeSpecRefused.
const (
	// EventNodeJoined is written when a machine joins (JoinService).
	EventNodeJoined = "node.joined"
	// EventNodeCordoned is written when a node is cordoned, or its cordon
	// reason changes.
	EventNodeCordoned = "node.cordoned"
	// EventNodeUncordoned is written when a cordoned node is uncordoned;
	// its data names the reason of the lifted cordon as previousReason.
	EventNodeUncordoned = "node.uncordoned"
	// EventNodeUnreachable is written when the liveness sweeper marks a
	// reachable node unreachable.
	EventNodeUnreachable = "node.unreachable"
	// EventNodeReachable is written when an unreachable node is heard from
	// again (a new session or a message on its live session).
	EventNodeReachable = "node.reachable"
)

// NodeEvent is one node.* event of InsertNodeEvents.
type NodeEvent struct {
	// TenantID is the tenant owning the node's pool.
	TenantID string
	// Type is a node event type, e.g. EventNodeCordoned.
	Type string
	// NodeID is the event's subject.
	NodeID string
	// Data is the event's JSON object; "nodeId" is always set to NodeID.
	Data map[string]any
}

// InsertNodeEvents writes node events: their events rows and their outbox
// messages on bc.events.<tenant>.<type>, in q's transaction and in a fixed
// number of round trips. It is the one way node.* events are written.
func InsertNodeEvents(ctx context.Context, q DBTX, now time.Time, events []NodeEvent) error {
	if len(events) == 0 {
		return nil
	}
	out := make([]ReservationEvent, len(events))
	for i, e := range events {
		data := make(map[string]any, len(e.Data)+1)
		for k, v := range e.Data {
			data[k] = v
		}
		data["nodeId"] = e.NodeID
		b, err := json.Marshal(data)
		if err != nil {
			return fmt.Errorf("encode %s event: %w", e.Type, err)
		}
		out[i] = ReservationEvent{TenantID: e.TenantID, Type: e.Type, SubjectID: e.NodeID, Data: b}
	}
	return InsertReservationEvents(ctx, q, now, out)
}

// insertNodeEventsOf writes one event of type typ for each of nodeIDs, with
// the tenant owning each node's pool and data (shared; nil for none).
func insertNodeEventsOf(ctx context.Context, q DBTX, now time.Time, typ string, nodeIDs []string, data map[string]any) error {
	if len(nodeIDs) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, `SELECT n.id, p.owner_tenant_id FROM nodes n JOIN pools p ON p.id = n.pool_id
		WHERE n.id = ANY($1) ORDER BY n.id`, nodeIDs)
	if err != nil {
		return fmt.Errorf("owners of nodes: %w", interpretError(err))
	}
	var events []NodeEvent
	for rows.Next() {
		var id, owner string
		if err := rows.Scan(&id, &owner); err != nil {
			rows.Close()
			return err
		}
		events = append(events, NodeEvent{TenantID: owner, Type: typ, NodeID: id, Data: data})
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("owners of nodes: %w", interpretError(err))
	}
	return InsertNodeEvents(ctx, q, now, events)
}

// Event types of reservations (events.type; subject the reservation id).
const (
	// EventReservationCreated is written when a reservation is made
	// (CreateReservation).
	EventReservationCreated = "reservation.created"
	// EventReservationFailed is written when a reservation fails: refused
	// at once, no longer placeable, or its node was revoked.
	EventReservationFailed = "reservation.failed"
	// EventReservationBound is written when the scheduler books devices
	// for a reservation.
	EventReservationBound = "reservation.bound"
	// EventReservationActive is written when the node reports the
	// reservation's devices bound.
	EventReservationActive = "reservation.active"
	// EventReservationReleased is written when a reservation is released
	// (EndReservation).
	EventReservationReleased = "reservation.released"
	// EventReservationExpired is written when a reservation reaches its end
	// time (EndReservation).
	EventReservationExpired = "reservation.expired"
)

// SubjectEvents is the NATS subject prefix of events:
// bc.events.<tenant>.<type>, e.g. bc.events.ten_x.reservation.active.
const SubjectEvents = "bc.events"

// ReservationEvent is one event of InsertReservationEvents.
type ReservationEvent struct {
	// TenantID is the tenant the event belongs to.
	TenantID string
	// Type is e.g. "reservation.bound".
	Type string
	// SubjectID is the reservation id.
	SubjectID string
	// Data is a JSON object; nil is {}.
	Data []byte
}

// InsertReservationEvent writes an event row of tenantID (type e.g.
// "reservation.active", subject the reservation id) and enqueues it for NATS
// on bc.events.<tenant>.<type>, in q's transaction.
func InsertReservationEvent(ctx context.Context, q DBTX, now time.Time, tenantID, typ, subjectID string, data []byte) error {
	return InsertReservationEvents(ctx, q, now, []ReservationEvent{{TenantID: tenantID, Type: typ, SubjectID: subjectID, Data: data}})
}

// InsertReservationEvents writes the events' rows and their outbox messages
// (bc.events.<tenant>.<type>, payload the JSON object {"id", "tenantId",
// "type", "subjectId", "data", "time"}) in q's transaction, in one
// statement whatever their number. Ids follow the order of events.
func InsertReservationEvents(ctx context.Context, q DBTX, now time.Time, events []ReservationEvent) error {
	if len(events) == 0 {
		return nil
	}
	tenants := make([]string, len(events))
	types := make([]string, len(events))
	subjects := make([]string, len(events))
	datas := make([]string, len(events))
	for i, e := range events {
		tenants[i], types[i], subjects[i] = e.TenantID, e.Type, e.SubjectID
		datas[i] = "{}"
		if e.Data != nil {
			datas[i] = string(e.Data)
		}
	}
	tag, err := q.Exec(ctx, `WITH ev AS (
			INSERT INTO events (tenant_id, type, subject_id, data, created_at)
			SELECT u.tenant, u.typ, u.subject, u.data::jsonb, $5
			FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS u(tenant, typ, subject, data, ord)
			ORDER BY u.ord
			RETURNING id, tenant_id, type, subject_id, data)
		INSERT INTO outbox (subject, payload, created_at)
		SELECT $6 || '.' || COALESCE(ev.tenant_id, '') || '.' || ev.type,
			convert_to(jsonb_build_object('id', ev.id, 'tenantId', COALESCE(ev.tenant_id, ''), 'type', ev.type, 'subjectId', ev.subject_id,
				'data', ev.data, 'time', $7::text)::text, 'UTF8'),
			$5
		FROM ev ORDER BY ev.id`, tenants, types, subjects, datas, now, SubjectEvents, now.UTC().Format(time.RFC3339Nano))
	if err != nil {
		return fmt.Errorf("insert events: %w", interpretError(err))
	}
	if tag.RowsAffected() != int64(len(events)) {
		return fmt.Errorf("insert events: %d outbox rows for %d events", tag.RowsAffected(), len(events))
	}
	if err := signalOutbox(ctx, q); err != nil {
		return fmt.Errorf("enqueue events: %w", interpretError(err))
	}
	return nil
}

// Event types about node trust (events.type).
const (
	// EventNodeRevoked is written when an operator revokes a node.
	EventNodeRevoked = "node.revoked"
	// EventNodeSpecRefused is written when a daemon refuses a DesiredState
	// (signedIntent: unsigned or wrongly signed).
	EventNodeSpecRefused = "node.spec_refused"
)
