package store

// Events (docs/architecture.md, "Events and the watch"): what a tenant may
// follow of its nodes, commands and reservations. Each event type has a data
// type here (NodeCordonedData for node.cordoned, …): a struct whose JSON is
// the event's data (events.data), built in Go and nowhere else, and whose
// keys a golden test pins. WriteEvents is the one writer: an events row per
// event, in the caller's transaction, in one statement per batch, and after
// the commit a hint on bc.events.<tenant>.<type> that wakes the watches
// (hintEvents; no outbox row). The statements that write events inside a
// statement of their own (QueueCommands, ApplySessionCommandUpdates, whose
// events depend on rows only that statement reads, and a few others) share
// its SQL, eventWriterCTE.
//
// A new event type takes its Event* constant in EventTypes, a data type
// with an event method, and its keys in the golden test.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Event types (events.type), one per thing that happened; the subject
// (events.subject_id) is the node, command or reservation it happened to.
const (
	// EventNodeJoined is written when a machine joins (JoinService).
	EventNodeJoined = "node.joined"
	// EventNodeAdopted is written when a node passes acceptance.
	EventNodeAdopted = "node.adopted"
	// EventNodeAcceptanceFailed is written when a node fails acceptance.
	EventNodeAcceptanceFailed = "node.acceptance_failed"
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
	// EventNodeRevoked is written when an operator revokes a node.
	EventNodeRevoked = "node.revoked"
	// EventNodeSpecRefused is written when a daemon refuses a DesiredState
	// (signedIntent: unsigned or wrongly signed).
	EventNodeSpecRefused = "node.spec_refused"
	// EventNodeSSHRefused is written when a node's SSH server refuses a
	// login (an unknown CA, an expired certificate, another node's, a
	// sandbox certificate whose reservation ended, a plain key).
	EventNodeSSHRefused = "node.ssh_refused"

	// EventCommandQueued is written when a user command is queued.
	EventCommandQueued = "command.queued"
	// EventCommandSucceeded is written when a user command succeeds.
	EventCommandSucceeded = "command.succeeded"
	// EventCommandFailed is written when a user command fails, or its node
	// is revoked before it finished.
	EventCommandFailed = "command.failed"
	// EventCommandExpired is written when a user command reaches its
	// deadline before it finished, or finishes after it.
	EventCommandExpired = "command.expired"

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
	EventNodeSSHRefused,
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

// SubjectEvents is the NATS subject prefix of the events' hints:
// bc.events.<tenant>.<type>, e.g. bc.events.ten_x.reservation.active, with
// no payload, published by the writer right after a commit that wrote
// events of that tenant and type (once per commit, however many it wrote).
// A hint says only "read the events table": the watches read the events
// there (docs/architecture.md, "Events and the watch").
const SubjectEvents = "bc.events"

// eventHintSubject is the hint of the events of typ of tenant
// (SubjectEvents), "" for events without a tenant, which no subject can
// name (a root administrator's watch finds them at its poll).
func eventHintSubject(tenant, typ string) string {
	if tenant == "" {
		return ""
	}
	return SubjectEvents + "." + tenant + "." + typ
}

// eventHints is the hints of the events of tenants and types (one element
// per event), each once, in the order of their first event.
func eventHints(tenants, types []string) []string {
	var out []string
	for i, tenant := range tenants {
		if h := eventHintSubject(tenant, types[i]); h != "" && !slices.Contains(out, h) {
			out = append(out, h)
		}
	}
	return out
}

// eventHintsSQL is the hints of the events the CTE ev of eventWriterCTE
// wrote, as a text[] expression (NULL for none) of a statement that embeds
// it: eventHintSubject in SQL.
const eventHintsSQL = `(SELECT array_agg(DISTINCT '` + SubjectEvents + `.' || tenant_id || '.' || type) FROM ev
	WHERE tenant_id <> '')`

// eventCountSQL is how many events the CTE ev of eventWriterCTE wrote, as
// an expression of a statement that embeds it.
const eventCountSQL = `(SELECT count(*) FROM ev)`

// EventData is the data of one event: one of the *Data types of this
// package, whose JSON object is the event's data and which names the
// event's type and subject.
type EventData interface {
	// event returns the event's type (one of EventTypes) and the id of
	// its subject.
	event() (typ, subject string)
}

// NewEvent is one event for WriteEvents.
type NewEvent struct {
	// TenantID is the tenant the event belongs to (whose watchers receive
	// it): the owner of a node's pool, a reservation's or a command's
	// tenant.
	TenantID string
	// Data is the event's data; it names the event's type and subject.
	Data EventData
}

// WriteEvents writes events: an events row for each, created at now, with
// ids in the order of events, in q's transaction, in one statement whatever
// their number, and their hints (bc.events.<tenant>.<type>, see
// SubjectEvents), which the writer publishes after the commit (hintEvents).
// It is how every event is written; it fails, writing nothing, for an event
// without data.
func WriteEvents(ctx context.Context, q DBTX, now time.Time, events ...NewEvent) error {
	if len(events) == 0 {
		return nil
	}
	cols, err := encodeEvents(events)
	if err != nil {
		return err
	}
	tag, err := q.Exec(ctx, `INSERT INTO events (tenant_id, type, subject_id, data, created_at)
		SELECT u.tenant, u.type, u.subject, u.data::jsonb, $5
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS u(tenant, type, subject, data, ord)
		ORDER BY u.ord`,
		cols.tenants, cols.types, cols.subjects, cols.data, now)
	if err != nil {
		return fmt.Errorf("write events: %w", interpretError(err))
	}
	if n := tag.RowsAffected(); n != int64(len(events)) {
		return fmt.Errorf("write events: %d rows for %d events", n, len(events))
	}
	hintEvents(q, eventHints(cols.tenants, cols.types))
	return nil
}

// eventWriterCTE returns the CTE ev that writes the events of the relation
// src, whose columns are ord (the order of their ids), tenant, type,
// subject, data (jsonb) and at (events.created_at), returning each event's
// tenant_id and type. WriteEvents writes the same rows; the statements that
// embed it read eventCountSQL to know how many events they wrote, and
// eventHintsSQL for their hints, which they pass to hintEvents (or build
// the hints from what they know in Go).
func eventWriterCTE(src string) string {
	return `ev AS (
			INSERT INTO events (tenant_id, type, subject_id, data, created_at)
			SELECT tenant, type, subject, data, at FROM ` + src + ` ORDER BY ord
			RETURNING tenant_id, type)`
}

// eventColumns are events as the columns of the statements that write
// them, one element per event.
type eventColumns struct {
	tenants, types, subjects []string
	// data are the events' data, JSON objects.
	data []string
}

// encodeEvents encodes events as columns, each event's data by its type.
func encodeEvents(events []NewEvent) (eventColumns, error) {
	n := len(events)
	c := eventColumns{tenants: make([]string, n), types: make([]string, n), subjects: make([]string, n), data: make([]string, n)}
	for i, e := range events {
		if e.Data == nil {
			return eventColumns{}, fmt.Errorf("write events: event %d of tenant %q has no data", i, e.TenantID)
		}
		typ, subject := e.Data.event()
		if !slices.Contains(EventTypes, typ) {
			return eventColumns{}, fmt.Errorf("write events: %T of %s names no event type (%q)", e.Data, subject, typ)
		}
		b, err := json.Marshal(e.Data)
		if err != nil {
			return eventColumns{}, fmt.Errorf("write events: encode %s of %s: %w", typ, subject, err)
		}
		c.tenants[i], c.types[i], c.subjects[i], c.data[i] = e.TenantID, typ, subject, string(b)
	}
	return c, nil
}

// writeEventsOfNodes writes one event for each of nodeIDs, ordered by node
// id, for the tenant owning each node's pool, with the data dataOf(node
// id). A node that does not exist gets none.
func writeEventsOfNodes(ctx context.Context, q DBTX, now time.Time, nodeIDs []string, dataOf func(nodeID string) EventData) error {
	if len(nodeIDs) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, `SELECT n.id, p.owner_tenant_id FROM nodes n JOIN pools p ON p.id = n.pool_id
		WHERE n.id = ANY($1) ORDER BY n.id`, nodeIDs)
	if err != nil {
		return fmt.Errorf("owners of nodes: %w", interpretError(err))
	}
	var events []NewEvent
	for rows.Next() {
		var id, owner string
		if err := rows.Scan(&id, &owner); err != nil {
			rows.Close()
			return err
		}
		events = append(events, NewEvent{TenantID: owner, Data: dataOf(id)})
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("owners of nodes: %w", interpretError(err))
	}
	return WriteEvents(ctx, q, now, events...)
}

// The data of each event type. Every node event names its node as
// "nodeId", every command event its command as "commandId", every
// reservation event its reservation as "reservationId". Times are UTC.

// NodeJoinedData is the data of node.joined.
type NodeJoinedData struct {
	NodeID string `json:"nodeId"`
}

// NodeAdoptedData is the data of node.adopted.
type NodeAdoptedData struct {
	NodeID string `json:"nodeId"`
	PoolID string `json:"poolId"`
	// GPUs is how many GPUs the node was adopted with.
	GPUs int `json:"gpus"`
}

// NodeAcceptanceFailedData is the data of node.acceptance_failed.
type NodeAcceptanceFailedData struct {
	NodeID string `json:"nodeId"`
	PoolID string `json:"poolId"`
	// Reason says why the node failed acceptance.
	Reason string `json:"reason"`
}

// NodeCordonedData is the data of node.cordoned.
type NodeCordonedData struct {
	NodeID string `json:"nodeId"`
	// Reason is the cordon's reason.
	Reason string `json:"reason"`
}

// NodeUncordonedData is the data of node.uncordoned.
type NodeUncordonedData struct {
	NodeID string `json:"nodeId"`
	// PreviousReason is the reason of the cordon that was lifted (an
	// uncordon has no reason of its own).
	PreviousReason string `json:"previousReason"`
}

// NodeUnreachableData is the data of node.unreachable.
type NodeUnreachableData struct {
	NodeID string `json:"nodeId"`
	// TimeoutSeconds is the liveness timeout that passed since the node
	// was last heard, in seconds.
	TimeoutSeconds float64 `json:"timeoutSeconds"`
}

// NodeReachableData is the data of node.reachable.
type NodeReachableData struct {
	NodeID string `json:"nodeId"`
	// SessionID is the session the node was heard on.
	SessionID string `json:"sessionId"`
	// GatewayID is the gateway holding that session, set (and
	// PreviousLastSeen with it) when a new session made the node reachable;
	// omitted when a message on its live session did.
	GatewayID string `json:"gatewayId,omitempty"`
	// PreviousLastSeen is when the node was heard before, omitted when it
	// never was.
	PreviousLastSeen *time.Time `json:"previousLastSeen,omitempty"`
}

// NodeRevokedData is the data of node.revoked.
type NodeRevokedData struct {
	NodeID string `json:"nodeId"`
	// Reason is the revocation's reason.
	Reason string `json:"reason"`
	// CertificatesRevoked is how many of the node's certificates the
	// revocation revoked.
	CertificatesRevoked int `json:"certificatesRevoked"`
}

// NodeSSHRefusedData is the data of node.ssh_refused.
type NodeSSHRefusedData struct {
	NodeID string `json:"nodeId"`
	// Reason is the node's SSH server's.
	Reason string `json:"reason"`
	// KeyID is the refused certificate's key id, "" for a plain key.
	KeyID string `json:"keyId"`
	// User is the user the client asked to log in as.
	User string `json:"user"`
}

// NodeSpecRefusedData is the data of node.spec_refused.
type NodeSpecRefusedData struct {
	NodeID string `json:"nodeId"`
	// Generation is the NodeSpec generation the daemon refused.
	Generation int64 `json:"generation"`
	// Reason is the daemon's.
	Reason string `json:"reason"`
}

// CommandQueuedData is the data of command.queued.
type CommandQueuedData struct {
	CommandID string `json:"commandId"`
	NodeID    string `json:"nodeId"`
	Kind      string `json:"kind"`
	// Deadline is when the command must have finished, to the
	// microsecond.
	Deadline time.Time `json:"deadline"`
}

// CommandEndedData is the data of the end of a command: command.succeeded,
// command.failed or command.expired, as its State says.
// ApplySessionCommandUpdates builds it in SQL (commandEndedDataSQL), a test
// checks that the two agree.
type CommandEndedData struct {
	CommandID string `json:"commandId"`
	NodeID    string `json:"nodeId"`
	Kind      string `json:"kind"`
	// State is succeeded, failed or expired; the event's type is
	// command.<State>.
	State string `json:"state"`
	// Error is the command's error, omitted when it has none.
	Error string `json:"error,omitempty"`
}

// commandEndedDataSQL is CommandEndedData as SQL over a row with the
// columns id, node_id, kind, state and error of commands: the one event
// data built in SQL, because ApplySessionCommandUpdates reads the kind and
// decides the state and error in the statement that writes the event.
const commandEndedDataSQL = `jsonb_build_object('commandId', id, 'nodeId', node_id, 'kind', kind, 'state', state)
	|| CASE WHEN error <> '' THEN jsonb_build_object('error', error) ELSE '{}'::jsonb END`

// commandEndedEventType is the event type of CommandEndedData by its State.
var commandEndedEventType = map[string]string{
	cmdSucceeded: EventCommandSucceeded,
	cmdFailed:    EventCommandFailed,
	cmdExpired:   EventCommandExpired,
}

// reservationEndedEventType is the event type of ReservationEndedData by its
// State.
var reservationEndedEventType = map[string]string{
	ReservationReleased: EventReservationReleased,
	ReservationExpired:  EventReservationExpired,
}

// ReservationCreatedData is the data of reservation.created.
type ReservationCreatedData struct {
	ReservationID string    `json:"reservationId"`
	PoolID        string    `json:"poolId"`
	GPUs          int32     `json:"gpus"`
	StartAt       time.Time `json:"startAt"`
	EndAt         time.Time `json:"endAt"`
}

// ReservationFailedData is the data of reservation.failed.
type ReservationFailedData struct {
	ReservationID string `json:"reservationId"`
	// NodeID is the node whose revocation failed the reservation, omitted
	// for a reservation that failed unplaced.
	NodeID string `json:"nodeId,omitempty"`
	// Reason says why it failed.
	Reason string `json:"reason"`
}

// ReservationBoundData is the data of reservation.bound.
type ReservationBoundData struct {
	ReservationID string `json:"reservationId"`
	NodeID        string `json:"nodeId"`
	// DeviceIndexes are the booked devices of the node.
	DeviceIndexes []int32 `json:"deviceIndexes"`
}

// ReservationActiveData is the data of reservation.active.
type ReservationActiveData struct {
	ReservationID string `json:"reservationId"`
	NodeID        string `json:"nodeId"`
	// Binding is the CDI device names the daemon reported bound.
	Binding []string `json:"binding"`
	// Generation is the NodeSpec generation the daemon applied.
	Generation int64 `json:"generation"`
}

// ReservationEndedData is the data of the end of a reservation:
// reservation.released or reservation.expired, as its State says.
type ReservationEndedData struct {
	ReservationID string `json:"reservationId"`
	// NodeID is the node it was placed on, "" when it never was.
	NodeID string `json:"nodeId"`
	// From is the state it ended in.
	From string `json:"from"`
	// State is released or expired; the event's type is
	// reservation.<State>. It is not in the data.
	State string `json:"-"`
}

func (d NodeJoinedData) event() (string, string)  { return EventNodeJoined, d.NodeID }
func (d NodeAdoptedData) event() (string, string) { return EventNodeAdopted, d.NodeID }
func (d NodeAcceptanceFailedData) event() (string, string) {
	return EventNodeAcceptanceFailed, d.NodeID
}
func (d NodeCordonedData) event() (string, string)    { return EventNodeCordoned, d.NodeID }
func (d NodeUncordonedData) event() (string, string)  { return EventNodeUncordoned, d.NodeID }
func (d NodeUnreachableData) event() (string, string) { return EventNodeUnreachable, d.NodeID }
func (d NodeReachableData) event() (string, string)   { return EventNodeReachable, d.NodeID }
func (d NodeRevokedData) event() (string, string)     { return EventNodeRevoked, d.NodeID }
func (d NodeSpecRefusedData) event() (string, string) { return EventNodeSpecRefused, d.NodeID }
func (d NodeSSHRefusedData) event() (string, string)  { return EventNodeSSHRefused, d.NodeID }
func (d CommandQueuedData) event() (string, string)   { return EventCommandQueued, d.CommandID }
func (d CommandEndedData) event() (string, string) {
	return commandEndedEventType[d.State], d.CommandID
}
func (d ReservationCreatedData) event() (string, string) {
	return EventReservationCreated, d.ReservationID
}
func (d ReservationFailedData) event() (string, string) {
	return EventReservationFailed, d.ReservationID
}
func (d ReservationBoundData) event() (string, string) { return EventReservationBound, d.ReservationID }
func (d ReservationActiveData) event() (string, string) {
	return EventReservationActive, d.ReservationID
}
func (d ReservationEndedData) event() (string, string) {
	return reservationEndedEventType[d.State], d.ReservationID
}
