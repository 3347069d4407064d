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
// in the transaction that placed or ended the reservations.
func RebuildNodeSpecs(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, nodeIDs []string) (map[string]int64, error) {
	ids := slices.Clone(nodeIDs)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	changed := map[string]int64{}
	var changedIDs []string
	for _, nodeID := range ids {
		var (
			gen  int64
			spec []byte
		)
		err := q.QueryRow(ctx, `SELECT spec_generation, spec FROM nodes WHERE id = $1 FOR UPDATE`, nodeID).Scan(&gen, &spec)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("rebuild spec of %s: %w", nodeID, ErrNotFound)
		}
		if err != nil {
			return nil, fmt.Errorf("rebuild spec of %s: %w", nodeID, interpretError(err))
		}
		ns := &gatewayv1.NodeSpec{}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(spec, ns); err != nil {
			return nil, fmt.Errorf("rebuild spec of %s: stored spec: %w", nodeID, err)
		}
		allocs, err := placedAllocations(ctx, q, nodeID)
		if err != nil {
			return nil, err
		}
		if slices.EqualFunc(ns.GetAllocations(), allocs, func(a, b *gatewayv1.Allocation) bool { return proto.Equal(a, b) }) {
			continue
		}
		ns.Allocations = allocs
		b, err := protojson.Marshal(ns)
		if err != nil {
			return nil, err
		}
		gen++
		if _, err := q.Exec(ctx, `UPDATE nodes SET spec = $2::jsonb, spec_generation = $3, updated_at = $4 WHERE id = $1`,
			nodeID, string(b), gen, now); err != nil {
			return nil, fmt.Errorf("rebuild spec of %s: %w", nodeID, interpretError(err))
		}
		if _, err := q.Exec(ctx, `UPDATE reservations SET spec_generation = $2
			WHERE node_id = $1 AND state IN ('binding', 'active') AND spec_generation IS NULL`, nodeID, gen); err != nil {
			return nil, fmt.Errorf("rebuild spec of %s: %w", nodeID, interpretError(err))
		}
		changed[nodeID] = gen
		changedIDs = append(changedIDs, nodeID)
	}
	if err := SignNodeSpecs(ctx, q, signer, changedIDs); err != nil {
		return nil, err
	}
	if err := PokeNodes(ctx, q, now, changedIDs...); err != nil {
		return nil, err
	}
	return changed, nil
}

// placedAllocations returns the allocations of a node's binding and active
// reservations, by reservation id, device indexes ascending.
func placedAllocations(ctx context.Context, q DBTX, nodeID string) ([]*gatewayv1.Allocation, error) {
	rows, err := q.Query(ctx, `SELECT r.id, array_agg(b.device_index ORDER BY b.device_index)
		FROM reservations r JOIN bookings b ON b.reservation_id = r.id
		WHERE r.node_id = $1 AND r.state IN ('binding', 'active')
		GROUP BY r.id ORDER BY r.id`, nodeID)
	if err != nil {
		return nil, fmt.Errorf("allocations of %s: %w", nodeID, interpretError(err))
	}
	defer rows.Close()
	var out []*gatewayv1.Allocation
	for rows.Next() {
		a := &gatewayv1.Allocation{}
		if err := rows.Scan(&a.ReservationId, &a.DeviceIndexes); err != nil {
			return nil, err
		}
		out = append(out, a)
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
// signer), and a reservation.<state> event is written; all in q's
// transaction. An already ended reservation is left as it is (Changed
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
	if _, err := q.Exec(ctx, `DELETE FROM bookings WHERE reservation_id = $1 AND lower(during) >= $2`, id, now); err != nil {
		return EndedReservation{}, fmt.Errorf("end reservation bookings: %w", interpretError(err))
	}
	if _, err := q.Exec(ctx, `UPDATE bookings SET during = tstzrange(lower(during), $2, '[)')
		WHERE reservation_id = $1 AND upper(during) > $2`, id, now); err != nil {
		return EndedReservation{}, fmt.Errorf("end reservation bookings: %w", interpretError(err))
	}
	if res.NodeID != "" {
		if _, err := RebuildNodeSpecs(ctx, q, signer, now, []string{res.NodeID}); err != nil {
			return EndedReservation{}, err
		}
	}
	data, err := json.Marshal(map[string]string{"reservationId": id, "nodeId": res.NodeID, "from": cur})
	if err != nil {
		return EndedReservation{}, err
	}
	if err := InsertReservationEvent(ctx, q, now, tenant, "reservation."+state, id, data); err != nil {
		return EndedReservation{}, err
	}
	res.State, res.Changed = state, true
	return res, nil
}

// SubjectEvents is the NATS subject prefix of events:
// bc.events.<tenant>.<type>, e.g. bc.events.ten_x.reservation.active.
const SubjectEvents = "bc.events"

// InsertReservationEvent writes an event row of tenantID (type e.g.
// "reservation.active", subject the reservation id) and enqueues it for NATS
// on bc.events.<tenant>.<type>, in q's transaction.
func InsertReservationEvent(ctx context.Context, q DBTX, now time.Time, tenantID, typ, subjectID string, data []byte) error {
	if data == nil {
		data = []byte("{}")
	}
	var id int64
	if err := q.QueryRow(ctx, `INSERT INTO events (tenant_id, type, subject_id, data, created_at)
		VALUES ($1, $2, $3, $4::jsonb, $5) RETURNING id`, tenantID, typ, subjectID, string(data), now).Scan(&id); err != nil {
		return fmt.Errorf("insert event %s: %w", typ, interpretError(err))
	}
	payload, err := json.Marshal(map[string]any{"id": id, "tenantId": tenantID, "type": typ, "subjectId": subjectID,
		"data": json.RawMessage(data), "time": now.UTC()})
	if err != nil {
		return err
	}
	return Enqueue(ctx, q, now, SubjectEvents+"."+tenantID+"."+typ, payload)
}
