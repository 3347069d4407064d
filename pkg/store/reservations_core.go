package store

// The core of reservations shared by every writer (the API's release, the
// scheduler's placement, the expiry reconciler): a node's NodeSpec carries
// exactly the allocations of its placed reservations, and a reservation ends
// in one transaction with its bookings, its node's spec and its event.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// Reservation states (reservations.state).
const (
	ReservationPending  = "pending"
	ReservationBinding  = "binding"
	ReservationActive   = "active"
	ReservationReleased = "released"
	ReservationExpired  = "expired"
	ReservationFailed   = "failed"
)

// ReservationEnded reports whether state is final.
func ReservationEnded(state string) bool {
	return state == ReservationReleased || state == ReservationExpired || state == ReservationFailed
}

// RebuildNodeSpecs makes each node's NodeSpec allocations exactly its placed
// reservations (state binding or active) with their booked device indexes,
// keeping the spec's labels. A node whose allocations change gets the next
// spec generation, signed (signer; nil: unsigned), and its gateway is poked;
// reservations newly in a spec record that generation. Nodes are locked in
// id order. It returns the new generation of each node that changed. Call it
// in the transaction that placed or ended the reservations. It costs a fixed
// number of round trips whatever the number of nodes. Errors: ErrNotFound
// when a node does not exist.
func RebuildNodeSpecs(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, nodeIDs []string) (map[string]int64, error) {
	ids := slices.Clone(nodeIDs)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	changed := map[string]int64{}
	if len(ids) == 0 {
		return changed, nil
	}
	type current struct {
		gen  int64
		spec []byte
	}
	cur := make(map[string]current, len(ids))
	rows, err := q.Query(ctx, `SELECT id, spec_generation, spec FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE`, ids)
	if err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	for rows.Next() {
		var (
			id string
			c  current
		)
		if err := rows.Scan(&id, &c.gen, &c.spec); err != nil {
			rows.Close()
			return nil, fmt.Errorf("rebuild node specs: %w", err)
		}
		cur[id] = c
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	for _, id := range ids {
		if _, ok := cur[id]; !ok {
			return nil, fmt.Errorf("rebuild spec of %s: %w", id, ErrNotFound)
		}
	}
	allocs, err := placedAllocations(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	var (
		changedIDs []string
		specs      []string
		gens       []int64
	)
	for _, nodeID := range ids {
		c := cur[nodeID]
		ns := &gatewayv1.NodeSpec{}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(c.spec, ns); err != nil {
			return nil, fmt.Errorf("rebuild spec of %s: stored spec: %w", nodeID, err)
		}
		want := allocs[nodeID]
		if slices.EqualFunc(ns.GetAllocations(), want, func(a, b *gatewayv1.Allocation) bool { return proto.Equal(a, b) }) {
			continue
		}
		ns.Allocations = want
		b, err := protojson.Marshal(ns)
		if err != nil {
			return nil, err
		}
		changed[nodeID] = c.gen + 1
		changedIDs = append(changedIDs, nodeID)
		specs = append(specs, string(b))
		gens = append(gens, c.gen+1)
	}
	if len(changedIDs) == 0 {
		return changed, nil
	}
	if _, err := q.Exec(ctx, `UPDATE nodes n SET spec = u.spec::jsonb, spec_generation = u.gen, updated_at = $4
		FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(id, spec, gen) WHERE n.id = u.id`,
		changedIDs, specs, gens, now); err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	if _, err := q.Exec(ctx, `UPDATE reservations r SET spec_generation = u.gen
		FROM unnest($1::text[], $2::bigint[]) AS u(id, gen)
		WHERE r.node_id = u.id AND r.state IN ('binding', 'active') AND r.spec_generation IS NULL`, changedIDs, gens); err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	if err := SignNodeSpecs(ctx, q, signer, changedIDs); err != nil {
		return nil, err
	}
	if err := PokeNodes(ctx, q, now, changedIDs...); err != nil {
		return nil, err
	}
	return changed, nil
}

// placedAllocations returns the allocations of the nodes' binding and active
// reservations, by node id, each by reservation id with device indexes
// ascending.
func placedAllocations(ctx context.Context, q DBTX, nodeIDs []string) (map[string][]*gatewayv1.Allocation, error) {
	rows, err := q.Query(ctx, `SELECT r.node_id, r.id, array_agg(b.device_index ORDER BY b.device_index)
		FROM reservations r JOIN bookings b ON b.reservation_id = r.id
		WHERE r.node_id = ANY($1) AND r.state IN ('binding', 'active')
		GROUP BY r.node_id, r.id ORDER BY r.node_id, r.id`, nodeIDs)
	if err != nil {
		return nil, fmt.Errorf("allocations of nodes: %w", interpretError(err))
	}
	defer rows.Close()
	out := map[string][]*gatewayv1.Allocation{}
	for rows.Next() {
		var nodeID string
		a := &gatewayv1.Allocation{}
		if err := rows.Scan(&nodeID, &a.ReservationId, &a.DeviceIndexes); err != nil {
			return nil, err
		}
		out[nodeID] = append(out[nodeID], a)
	}
	return out, rows.Err()
}

// EndedReservation is what EndReservation did.
type EndedReservation struct {
	// State is the reservation's state after the call.
	State string
	// Changed is false when the reservation had already ended.
	Changed bool
	// TenantID and NodeID are the reservation's ("" when never placed).
	TenantID, NodeID string
}

// EndReservation ends reservation id at now with state (released or
// expired): its bookings end at now (bookings that had not started are
// deleted), its node's spec drops the allocation (RebuildNodeSpecs, signed by
// signer), the scheduler is poked when devices were freed, and a
// reservation.<state> event is written; all in q's transaction. An already ended reservation is left as it is (Changed
// false). Errors: ErrNotFound.
func EndReservation(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, id, state string) (EndedReservation, error) {
	if state != ReservationReleased && state != ReservationExpired {
		return EndedReservation{}, fmt.Errorf("end reservation: state %q is not released or expired", state)
	}
	var (
		cur    string
		tenant string
		node   *string
	)
	err := q.QueryRow(ctx, `SELECT state, tenant_id, node_id FROM reservations WHERE id = $1 FOR UPDATE`, id).Scan(&cur, &tenant, &node)
	if errors.Is(err, pgx.ErrNoRows) {
		return EndedReservation{}, ErrNotFound
	}
	if err != nil {
		return EndedReservation{}, fmt.Errorf("end reservation: %w", interpretError(err))
	}
	res := EndedReservation{State: cur, TenantID: tenant}
	if node != nil {
		res.NodeID = *node
	}
	if ReservationEnded(cur) {
		return res, nil
	}
	if _, err := q.Exec(ctx, `UPDATE reservations SET state = $2, ended_at = $3, updated_at = $3 WHERE id = $1`, id, state, now); err != nil {
		return EndedReservation{}, fmt.Errorf("end reservation: %w", interpretError(err))
	}
	if err := endBookings(ctx, q, now, []string{id}); err != nil {
		return EndedReservation{}, err
	}
	if res.NodeID != "" {
		if _, err := RebuildNodeSpecs(ctx, q, signer, now, []string{res.NodeID}); err != nil {
			return EndedReservation{}, err
		}
		// The devices are free again: pending reservations may fit now.
		if err := Enqueue(ctx, q, now, SubjectPokeScheduler, nil); err != nil {
			return EndedReservation{}, err
		}
	}
	data, err := json.Marshal(map[string]string{"reservationId": id, "nodeId": res.NodeID, "from": cur})
	if err != nil {
		return EndedReservation{}, err
	}
	typ := EventReservationReleased
	if state == ReservationExpired {
		typ = EventReservationExpired
	}
	if err := InsertReservationEvent(ctx, q, now, tenant, typ, id, data); err != nil {
		return EndedReservation{}, err
	}
	res.State, res.Changed = state, true
	return res, nil
}

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

// endBookings ends the bookings of reservations ids at now: bookings that
// had not started are deleted (an empty range is not a booking), the others
// end at now. Usage then counts up to now and the devices are free after it.
func endBookings(ctx context.Context, q DBTX, now time.Time, ids []string) error {
	if _, err := q.Exec(ctx, `DELETE FROM bookings WHERE reservation_id = ANY($1) AND lower(during) >= $2`, ids, now); err != nil {
		return fmt.Errorf("end bookings: %w", interpretError(err))
	}
	if _, err := q.Exec(ctx, `UPDATE bookings SET during = tstzrange(lower(during), $2, '[)')
		WHERE reservation_id = ANY($1) AND upper(during) > $2`, ids, now); err != nil {
		return fmt.Errorf("end bookings: %w", interpretError(err))
	}
	return nil
}
