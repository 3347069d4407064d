package store

// Placement (docs/architecture.md, "Reservations"): the scheduler reads what is pending and what is
// free, plans in memory, and writes placements in one transaction per batch.
// The bookings' exclusion constraint (bookings_no_overlap, I1) is what keeps
// two schedulers from double-booking a device: a placement that overlaps a
// booking another transaction committed fails with a ConstraintError on
// BookingsNoOverlap and its transaction rolls back.
//
// A placement books its devices from the time it is made (not from the
// reservation's start_at, which may be long past for a reservation that
// waited): [placed_at, end_at). Booked time, and so usage, starts then.
//
// A pass that cannot place a pending reservation says why in
// reservations.reason (SetPendingReasons); placing it clears the reason.

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// BookingsNoOverlap is the exclusion constraint on bookings (I1).
const BookingsNoOverlap = "bookings_no_overlap"

// PendingReservation is a reservation waiting for placement.
type PendingReservation struct {
	ID, TenantID, PoolID string
	// GPUs is how many devices it needs, all on one node.
	GPUs int
	// StartAt and EndAt bound the time it holds them: [StartAt, EndAt).
	StartAt, EndAt time.Time
	// CreatedAt orders the pool's queue (FIFO, ties by ID).
	CreatedAt time.Time
	// Reason is why it is still pending, as last written by a pass ("" when
	// none has said): SetPendingReasons writes only reasons that differ.
	Reason string
}

// PendingReservations returns up to limit pending reservations whose start
// is due (start_at ≤ now) and whose end is not (end_at > now), by pool, then
// created_at, then id: each pool's FIFO queue.
func PendingReservations(ctx context.Context, q DBTX, now time.Time, limit int) ([]PendingReservation, error) {
	rows, err := q.Query(ctx, `SELECT id, tenant_id, pool_id, gpus, start_at, end_at, created_at, reason FROM reservations
		WHERE state = 'pending' AND start_at <= $1 AND end_at > $1
		ORDER BY pool_id, created_at, id LIMIT $2`, now, limit)
	if err != nil {
		return nil, fmt.Errorf("pending reservations: %w", interpretError(err))
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PendingReservation, error) {
		var r PendingReservation
		err := row.Scan(&r.ID, &r.TenantID, &r.PoolID, &r.GPUs, &r.StartAt, &r.EndAt, &r.CreatedAt, &r.Reason)
		return r, err
	})
	if err != nil {
		return nil, fmt.Errorf("pending reservations: %w", interpretError(err))
	}
	return out, nil
}

// PoolNode is an adopted, non-revoked node of a pool as placement sees it.
type PoolNode struct {
	ID string
	// Schedulable is true when the node is reachable, holds a session (a
	// node whose session closed is not placed on, though liveness may not
	// have marked it unreachable yet) and is not cordoned.
	Schedulable bool
	// Cordoned is true when the node is cordoned.
	Cordoned bool
	// Unreachable is true when the node is not reachable or holds no
	// session.
	Unreachable bool
	// Healthy are its healthy device indexes, ascending.
	Healthy []int32
	// Devices is how many devices it has, healthy or not: the most it could
	// ever hold.
	Devices int
}

// BookedInterval is one booking of a device: [Lower, Upper).
type BookedInterval struct {
	NodeID       string
	DeviceIndex  int32
	Lower, Upper time.Time
}

// PoolCapacity returns the adopted, non-revoked nodes of poolID by id, and
// the bookings of their devices that end after now, in one round trip (a
// pgx.Batch of the two reads).
func PoolCapacity(ctx context.Context, q DBTX, poolID string, now time.Time) ([]PoolNode, []BookedInterval, error) {
	batch := &pgx.Batch{}
	batch.Queue(`SELECT n.id, n.cordoned, NOT (n.reachable AND n.session_id IS NOT NULL),
			coalesce(array_agg(d.device_index ORDER BY d.device_index) FILTER (WHERE d.healthy), '{}'),
			count(d.device_index)
		FROM nodes n LEFT JOIN node_devices d ON d.node_id = n.id
		WHERE n.pool_id = $1 AND n.provision_state = 'adopted' AND n.revoked_at IS NULL
		GROUP BY n.id ORDER BY n.id`, poolID)
	batch.Queue(`SELECT b.node_id, b.device_index, lower(b.during), upper(b.during)
		FROM bookings b JOIN nodes n ON n.id = b.node_id
		WHERE n.pool_id = $1 AND upper(b.during) > $2`, poolID, now)
	br := q.SendBatch(ctx, batch)
	defer func() { _ = br.Close() }()
	rows, err := br.Query()
	if err != nil {
		return nil, nil, fmt.Errorf("pool capacity: %w", interpretError(err))
	}
	nodes, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PoolNode, error) {
		var n PoolNode
		err := row.Scan(&n.ID, &n.Cordoned, &n.Unreachable, &n.Healthy, &n.Devices)
		n.Schedulable = !n.Cordoned && !n.Unreachable
		return n, err
	})
	if err != nil {
		return nil, nil, fmt.Errorf("pool capacity: %w", interpretError(err))
	}
	rows, err = br.Query()
	if err != nil {
		return nil, nil, fmt.Errorf("pool bookings: %w", interpretError(err))
	}
	booked, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (BookedInterval, error) {
		var b BookedInterval
		err := row.Scan(&b.NodeID, &b.DeviceIndex, &b.Lower, &b.Upper)
		return b, err
	})
	if err != nil {
		return nil, nil, fmt.Errorf("pool bookings: %w", interpretError(err))
	}
	if err := br.Close(); err != nil {
		return nil, nil, fmt.Errorf("pool capacity: %w", interpretError(err))
	}
	return nodes, booked, nil
}

// Placement puts one pending reservation on devices of one node for
// [Lower, Upper).
type Placement struct {
	ReservationID, TenantID, NodeID string
	Devices                         []int32
	Lower, Upper                    time.Time
}

// PlaceReservations writes placements in q's transaction: each reservation
// still pending turns binding on its node (placed_at now) with one booking
// per device, the nodes' specs are rebuilt (RebuildNodeSpecs, signed by
// signer), the reason it waited is cleared and a reservation.bound event is
// written for each; each placed reservation records the spec generation
// that first carries it. It first locks the placements' nodes and checks again
// that each may take a placement (adopted, reachable, not cordoned, not
// revoked: what PoolCapacity read outside this transaction may no longer
// hold); a revocation or cordon waits for the placement's commit, and one
// that committed first makes the placement skipped. Reservations no longer
// pending (another scheduler placed them, the tenant released them) are
// skipped too, and a skipped one stays as it is (pending, for the next
// pass). It returns the ids placed. Errors: a ConstraintError on
// BookingsNoOverlap (errors.Is ErrConflict) when a booking overlaps one
// already committed; the caller must roll back.
func PlaceReservations(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, ps []Placement) ([]string, error) {
	if len(ps) == 0 {
		return nil, nil
	}
	nodes := make([]string, 0, len(ps))
	for _, p := range ps {
		nodes = append(nodes, p.NodeID)
	}
	slices.Sort(nodes)
	// The nodes stay locked to the commit, so the spec generation each will
	// get (RebuildNodeSpecs: the next one, since a new allocation always
	// changes the spec) is known here and written with the placement, not
	// by a second update of the same rows.
	rows, err := q.Query(ctx, `SELECT id, spec_generation FROM nodes
		WHERE id = ANY($1) AND provision_state = 'adopted' AND reachable AND NOT cordoned AND revoked_at IS NULL
		ORDER BY id FOR NO KEY UPDATE`, slices.Compact(nodes))
	if err != nil {
		return nil, fmt.Errorf("lock the placements' nodes: %w", interpretError(err))
	}
	nextGen := map[string]int64{}
	for rows.Next() {
		var (
			id  string
			gen int64
		)
		if err := rows.Scan(&id, &gen); err != nil {
			rows.Close()
			return nil, fmt.Errorf("lock the placements' nodes: %w", err)
		}
		nextGen[id] = gen + 1
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("lock the placements' nodes: %w", interpretError(err))
	}
	ps = slices.DeleteFunc(slices.Clone(ps), func(p Placement) bool { _, ok := nextGen[p.NodeID]; return !ok })
	if len(ps) == 0 {
		return nil, nil
	}
	resIDs := make([]string, len(ps))
	nodeIDs := make([]string, len(ps))
	gens := make([]int64, len(ps))
	for i, p := range ps {
		resIDs[i], nodeIDs[i], gens[i] = p.ReservationID, p.NodeID, nextGen[p.NodeID]
	}
	rows, err = q.Query(ctx, `UPDATE reservations r SET state = 'binding', node_id = u.node, placed_at = $3, updated_at = $3,
			reason = '', spec_generation = u.gen
		FROM unnest($1::text[], $2::text[], $4::bigint[]) AS u(id, node, gen)
		WHERE r.id = u.id AND r.state = 'pending' RETURNING r.id`, resIDs, nodeIDs, now, gens)
	if err != nil {
		return nil, fmt.Errorf("place reservations: %w", interpretError(err))
	}
	updated, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("place reservations: %w", interpretError(err))
	}
	got := make(map[string]bool, len(updated))
	for _, id := range updated {
		got[id] = true
	}
	var (
		bRes, bNode         []string
		bDev                []int32
		bLower, bUpper      []time.Time
		placed, placedNodes []string
		events              []NewEvent
	)
	for _, p := range ps {
		if !got[p.ReservationID] {
			continue
		}
		for _, d := range p.Devices {
			bRes, bNode, bDev = append(bRes, p.ReservationID), append(bNode, p.NodeID), append(bDev, d)
			bLower, bUpper = append(bLower, p.Lower), append(bUpper, p.Upper)
		}
		placed, placedNodes = append(placed, p.ReservationID), append(placedNodes, p.NodeID)
		events = append(events, NewEvent{TenantID: p.TenantID,
			Data: ReservationBoundData{ReservationID: p.ReservationID, NodeID: p.NodeID, DeviceIndexes: p.Devices}})
	}
	if len(placed) == 0 {
		return nil, nil
	}
	if _, err := q.Exec(ctx, `INSERT INTO bookings (reservation_id, node_id, device_index, during)
		SELECT u.res, u.node, u.dev, tstzrange(u.lo, u.hi, '[)')
		FROM unnest($1::text[], $2::text[], $3::int[], $4::timestamptz[], $5::timestamptz[]) AS u(res, node, dev, lo, hi)`,
		bRes, bNode, bDev, bLower, bUpper); err != nil {
		return nil, fmt.Errorf("book devices: %w", interpretError(err))
	}
	changed, err := RebuildNodeSpecs(ctx, q, signer, now, placedNodes)
	if err != nil {
		return nil, err
	}
	for _, n := range placedNodes {
		if changed[n] != nextGen[n] {
			return nil, fmt.Errorf("place reservations: node %s got spec generation %d, not the %d its placements carry",
				n, changed[n], nextGen[n])
		}
	}
	if err := WriteEvents(ctx, q, now, events...); err != nil {
		return nil, err
	}
	return placed, nil
}

// ReservationFailure fails one pending reservation with a reason.
type ReservationFailure struct {
	ID, TenantID, Reason string
}

// FailReservations turns the reservations that are still pending failed
// with their reasons (ended_at now) and writes a reservation.failed event
// for each, in q's transaction. It returns the ids failed.
func FailReservations(ctx context.Context, q DBTX, now time.Time, fs []ReservationFailure) ([]string, error) {
	if len(fs) == 0 {
		return nil, nil
	}
	ids := make([]string, len(fs))
	reasons := make([]string, len(fs))
	for i, f := range fs {
		ids[i], reasons[i] = f.ID, f.Reason
	}
	rows, err := q.Query(ctx, `UPDATE reservations r SET state = 'failed', reason = u.reason, ended_at = $3, updated_at = $3
		FROM unnest($1::text[], $2::text[]) AS u(id, reason)
		WHERE r.id = u.id AND r.state = 'pending' RETURNING r.id`, ids, reasons, now)
	if err != nil {
		return nil, fmt.Errorf("fail reservations: %w", interpretError(err))
	}
	failed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("fail reservations: %w", interpretError(err))
	}
	done := make(map[string]bool, len(failed))
	for _, id := range failed {
		done[id] = true
	}
	var events []NewEvent
	for _, f := range fs {
		if done[f.ID] {
			events = append(events, NewEvent{TenantID: f.TenantID, Data: ReservationFailedData{ReservationID: f.ID, Reason: f.Reason}})
		}
	}
	if err := WriteEvents(ctx, q, now, events...); err != nil {
		return nil, err
	}
	return failed, nil
}

// PendingReason is the reason one pending reservation waits.
type PendingReason struct {
	ID, Reason string
}

// SetPendingReasons writes each reservation's reason when it is still
// pending and its stored reason differs (updated_at now), in one statement;
// it returns how many rows changed. Reservations no longer pending (placed,
// released, failed meanwhile) are left alone.
func SetPendingReasons(ctx context.Context, q DBTX, now time.Time, rs []PendingReason) (int64, error) {
	if len(rs) == 0 {
		return 0, nil
	}
	ids := make([]string, len(rs))
	reasons := make([]string, len(rs))
	for i, r := range rs {
		ids[i], reasons[i] = r.ID, r.Reason
	}
	tag, err := q.Exec(ctx, `UPDATE reservations r SET reason = u.reason, updated_at = $3
		FROM unnest($1::text[], $2::text[]) AS u(id, reason)
		WHERE r.id = u.id AND r.state = 'pending' AND r.reason <> u.reason`, ids, reasons, now)
	if err != nil {
		return 0, fmt.Errorf("set pending reasons: %w", interpretError(err))
	}
	return tag.RowsAffected(), nil
}
