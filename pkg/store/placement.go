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
// the bookings of their devices that end after now, in one round trip: the
// whole pool as PoolCapacitySince reads it for a caller that knows nothing.
func PoolCapacity(ctx context.Context, q DBTX, poolID string, now time.Time) ([]PoolNode, []BookedInterval, error) {
	read, err := PoolCapacitySince(ctx, q, poolID, now, nil)
	if err != nil {
		return nil, nil, err
	}
	nodes := make([]PoolNode, len(read))
	var booked []BookedInterval
	for i, c := range read {
		nodes[i] = c.Node
		booked = append(booked, c.Booked...)
	}
	return nodes, booked, nil
}

// NodeCapacity is one adopted, non-revoked node of a pool as
// PoolCapacitySince read it.
type NodeCapacity struct {
	// ID is the node's id.
	ID string
	// Generation is the node's capacity generation (nodes.capacity_generation,
	// migration 000021): it moves in every transaction that changes what
	// placement reads of the node (its state, devices or bookings).
	Generation int64
	// Changed is true when Generation is not the one the caller knew (or the
	// caller knew none): only then are Node and Booked read.
	Changed bool
	// Node is the node as PoolCapacity returns it (when Changed).
	Node PoolNode
	// Booked are the node's bookings that end after now (when Changed), in
	// no order.
	Booked []BookedInterval
}

// PoolCapacitySince returns every adopted, non-revoked node of poolID by id
// with its capacity generation; for each node whose generation differs from
// known[node id] (absent: unknown; known nil: every node) it also reads what
// PoolCapacity reads of it: its state, devices and the bookings that end
// after now. A caller that keeps the pool's capacity in memory passes the
// generations it holds and reads back only what changed since: one round
// trip when nothing did, two otherwise. A node missing from the result has
// left the pool (or its adoption).
//
// A changed node's generation is read with its state and devices, and its
// bookings after them: what is returned of it is as new as its generation
// says, or newer (a change committed in between moves the generation again,
// which the next read or a placement at the returned one sees).
func PoolCapacitySince(ctx context.Context, q DBTX, poolID string, now time.Time, known map[string]int64) ([]NodeCapacity, error) {
	var (
		out     []NodeCapacity
		changed []string
	)
	if known != nil {
		rows, err := q.Query(ctx, `SELECT id, capacity_generation FROM nodes
			WHERE pool_id = $1 AND provision_state = 'adopted' AND revoked_at IS NULL ORDER BY id`, poolID)
		if err != nil {
			return nil, fmt.Errorf("pool capacity generations: %w", interpretError(err))
		}
		out, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (NodeCapacity, error) {
			var c NodeCapacity
			err := row.Scan(&c.ID, &c.Generation)
			gen, ok := known[c.ID]
			c.Changed = !ok || gen != c.Generation
			return c, err
		})
		if err != nil {
			return nil, fmt.Errorf("pool capacity generations: %w", interpretError(err))
		}
		for _, c := range out {
			if c.Changed {
				changed = append(changed, c.ID)
			}
		}
		if len(changed) == 0 {
			return out, nil
		}
	}
	// The whole pool by pool id (hash joins), a few nodes by id (their
	// indexes).
	var (
		nodeFilter, bookingFilter = `n.pool_id = $1`, `n.pool_id = $1`
		args                      = []any{poolID}
	)
	if known != nil && 2*len(changed) < len(out) {
		nodeFilter, bookingFilter = `n.pool_id = $1 AND n.id = ANY($2)`, `n.pool_id = $1 AND b.node_id = ANY($2)`
		args = append(args, changed)
	}
	batch := &pgx.Batch{}
	batch.Queue(`SELECT n.id, n.capacity_generation, n.cordoned, NOT (n.reachable AND n.session_id IS NOT NULL),
			coalesce(array_agg(d.device_index ORDER BY d.device_index) FILTER (WHERE d.healthy), '{}'),
			count(d.device_index)
		FROM nodes n LEFT JOIN node_devices d ON d.node_id = n.id
		WHERE `+nodeFilter+` AND n.provision_state = 'adopted' AND n.revoked_at IS NULL
		GROUP BY n.id ORDER BY n.id`, args...)
	batch.Queue(`SELECT b.node_id, b.device_index, lower(b.during), upper(b.during)
		FROM bookings b JOIN nodes n ON n.id = b.node_id
		WHERE `+bookingFilter+` AND upper(b.during) > $`+fmt.Sprint(len(args)+1), append(args, now)...)
	br := q.SendBatch(ctx, batch)
	defer func() { _ = br.Close() }()
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("pool capacity: %w", interpretError(err))
	}
	read, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (NodeCapacity, error) {
		c := NodeCapacity{Changed: true}
		n := &c.Node
		err := row.Scan(&n.ID, &c.Generation, &n.Cordoned, &n.Unreachable, &n.Healthy, &n.Devices)
		c.ID, n.Schedulable = n.ID, !n.Cordoned && !n.Unreachable
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("pool capacity: %w", interpretError(err))
	}
	rows, err = br.Query()
	if err != nil {
		return nil, fmt.Errorf("pool bookings: %w", interpretError(err))
	}
	booked, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (BookedInterval, error) {
		var b BookedInterval
		err := row.Scan(&b.NodeID, &b.DeviceIndex, &b.Lower, &b.Upper)
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("pool bookings: %w", interpretError(err))
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("pool capacity: %w", interpretError(err))
	}
	byID := make(map[string]int, len(read))
	for i := range read {
		byID[read[i].ID] = i
	}
	for _, b := range booked {
		if i, ok := byID[b.NodeID]; ok {
			read[i].Booked = append(read[i].Booked, b)
		}
	}
	if known == nil {
		return read, nil
	}
	// Merge what was read into the generations; a node read whole that
	// was unchanged stays so (the same generation), one gone meanwhile is
	// dropped.
	whole := len(args) == 1
	merged := out[:0]
	for _, c := range out {
		i, ok := byID[c.ID]
		switch {
		case ok && (c.Changed || read[i].Generation != c.Generation):
			merged = append(merged, read[i])
		case ok || (!c.Changed && !whole):
			merged = append(merged, c)
		}
	}
	return merged, nil
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
	res, err := PlaceReservationsAt(ctx, q, signer, now, ps, nil)
	return res.Placed, err
}

// PlaceResult is what PlaceReservationsAt did.
type PlaceResult struct {
	// Placed are the ids of the reservations placed, in the order given.
	Placed []string
	// Skipped are the nodes, by id, whose placements were all skipped: not
	// adopted, reachable, uncordoned and unrevoked any more, or (with
	// generations) at another capacity generation than the plan's. Their
	// reservations stay pending.
	Skipped []string
	// Generations is the capacity generation, once committed, of each node
	// placed on (the next one: the spec rebuild moves it).
	Generations map[string]int64
}

// PlaceReservationsAt is PlaceReservations for a plan made on known
// capacity generations (NodeCapacity.Generation; nil: any): under the node's
// lock, a node whose generation is not generations[node] has changed since
// the plan read it, and its placements are skipped (PlaceResult.Skipped), so
// that a plan made on a stale copy of a node is never written. It costs a
// fixed number of statements whatever the number of placements. Errors: as
// PlaceReservations.
func PlaceReservationsAt(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, ps []Placement,
	generations map[string]int64) (PlaceResult, error) {
	var res PlaceResult
	if len(ps) == 0 {
		return res, nil
	}
	nodes := make([]string, 0, len(ps))
	for _, p := range ps {
		nodes = append(nodes, p.NodeID)
	}
	slices.Sort(nodes)
	nodes = slices.Compact(nodes)
	// The nodes stay locked to the commit, so the spec generation each will
	// get (the next one, since a new allocation always changes the spec) is
	// known here and written with the placement, not by a second update of
	// the same rows; the specs read here are the ones the rebuild starts
	// from.
	rows, err := q.Query(ctx, `SELECT id, spec_generation, spec, capacity_generation,
			provision_state = 'adopted' AND reachable AND NOT cordoned AND revoked_at IS NULL
		FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE`, nodes)
	if err != nil {
		return res, fmt.Errorf("lock the placements' nodes: %w", interpretError(err))
	}
	locked := make(map[string]lockedSpec, len(nodes))
	capGen := make(map[string]int64, len(nodes))
	for rows.Next() {
		var (
			id        string
			c         lockedSpec
			gen       int64
			placeable bool
		)
		if err := rows.Scan(&id, &c.gen, &c.spec, &gen, &placeable); err != nil {
			rows.Close()
			return res, fmt.Errorf("lock the placements' nodes: %w", err)
		}
		if want, ok := generations[id]; !placeable || (generations != nil && (!ok || want != gen)) {
			continue
		}
		locked[id], capGen[id] = c, gen
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return res, fmt.Errorf("lock the placements' nodes: %w", interpretError(err))
	}
	for _, n := range nodes {
		if _, ok := locked[n]; !ok {
			res.Skipped = append(res.Skipped, n)
		}
	}
	ps = slices.DeleteFunc(slices.Clone(ps), func(p Placement) bool { _, ok := locked[p.NodeID]; return !ok })
	if len(ps) == 0 {
		return res, nil
	}
	resIDs := make([]string, len(ps))
	nodeIDs := make([]string, len(ps))
	gens := make([]int64, len(ps))
	var (
		bRes, bNode    []string
		bDev           []int32
		bLower, bUpper []time.Time
	)
	for i, p := range ps {
		resIDs[i], nodeIDs[i], gens[i] = p.ReservationID, p.NodeID, locked[p.NodeID].gen+1
		for _, d := range p.Devices {
			bRes, bNode, bDev = append(bRes, p.ReservationID), append(bNode, p.NodeID), append(bDev, d)
			bLower, bUpper = append(bLower, p.Lower), append(bUpper, p.Upper)
		}
	}
	// One statement turns the reservations still pending binding and books
	// the devices of those it turned (and only those).
	rows, err = q.Query(ctx, `WITH placed AS (
			UPDATE reservations r SET state = 'binding', node_id = u.node, placed_at = $3, updated_at = $3,
				reason = '', spec_generation = u.gen
			FROM unnest($1::text[], $2::text[], $4::bigint[]) AS u(id, node, gen)
			WHERE r.id = u.id AND r.state = 'pending' RETURNING r.id),
		booked AS (
			INSERT INTO bookings (reservation_id, node_id, device_index, during)
			SELECT b.res, b.node, b.dev, tstzrange(b.lo, b.hi, '[)')
			FROM unnest($5::text[], $6::text[], $7::int[], $8::timestamptz[], $9::timestamptz[]) AS b(res, node, dev, lo, hi)
			WHERE b.res IN (SELECT id FROM placed))
		SELECT id FROM placed`, resIDs, nodeIDs, now, gens, bRes, bNode, bDev, bLower, bUpper)
	if err != nil {
		return res, fmt.Errorf("place reservations: %w", interpretError(err))
	}
	updated, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return res, fmt.Errorf("place reservations: %w", interpretError(err))
	}
	got := make(map[string]bool, len(updated))
	for _, id := range updated {
		got[id] = true
	}
	var (
		placed, placedNodes []string
		events              []NewEvent
	)
	for _, p := range ps {
		if !got[p.ReservationID] {
			continue
		}
		placed, placedNodes = append(placed, p.ReservationID), append(placedNodes, p.NodeID)
		events = append(events, NewEvent{TenantID: p.TenantID,
			Data: ReservationBoundData{ReservationID: p.ReservationID, NodeID: p.NodeID, DeviceIndexes: p.Devices}})
	}
	if len(placed) == 0 {
		return res, nil
	}
	slices.Sort(placedNodes)
	placedNodes = slices.Compact(placedNodes)
	changed, err := rebuildLockedSpecs(ctx, q, signer, now, placedNodes, locked)
	if err != nil {
		return res, err
	}
	res.Generations = make(map[string]int64, len(placedNodes))
	for _, n := range placedNodes {
		if changed[n] != locked[n].gen+1 {
			return res, fmt.Errorf("place reservations: node %s got spec generation %d, not the %d its placements carry",
				n, changed[n], locked[n].gen+1)
		}
		// The spec generation's move is the capacity generation's
		// (nodes_capacity_generation, migration 000021).
		res.Generations[n] = capGen[n] + 1
	}
	if err := WriteEvents(ctx, q, now, events...); err != nil {
		return res, err
	}
	res.Placed = placed
	return res, nil
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
