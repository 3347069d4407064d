package store

// Reservations (docs/architecture.md, "Reservations"): creating one
// (quota, idempotency, fail fast), reading them, and every way one changes
// state after placement: the daemon's AllocationBound activates it, release
// or expiry ends it (EndReservation), revoking its node fails it. A
// reservation ends in one transaction with its bookings, its node's spec
// (RebuildNodeSpecs) and its event; one whose end time passes while still
// pending fails with a reason (FailNeverPlaced) instead of expiring silently.
// Placement is placement.go's.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
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

// Reservation is a row of reservations with the device indexes of its
// bookings.
type Reservation struct {
	// ID is "res_…" (ids.Reservation).
	ID       string
	TenantID string
	PoolID   string
	// GPUs is how many GPUs of one node are reserved.
	GPUs int32
	// StartAt and EndAt bound the time the GPUs are held, [StartAt, EndAt).
	StartAt, EndAt time.Time
	// State is one of the Reservation* constants.
	State string
	// Reason says why the reservation failed (or is still pending).
	Reason string
	// NodeID is the node it was placed on, "" before placement.
	NodeID string
	// Binding is the CDI device names the daemon reported bound.
	Binding []string
	// DeviceIndexes are the booked devices of NodeID, ascending.
	DeviceIndexes []int32
	// SpecGeneration is the node spec generation that first carried the
	// allocation (nil before).
	SpecGeneration *int64
	// RequestID is the client's idempotency key, "" without one.
	RequestID string
	// CreatedBy is the API token id that made it.
	CreatedBy string
	CreatedAt time.Time
	UpdatedAt time.Time
	PlacedAt  *time.Time
	ActiveAt  *time.Time
	EndedAt   *time.Time
}

const reservationColumns = `r.id, r.tenant_id, r.pool_id, r.gpus, r.start_at, r.end_at, r.state, r.reason,
	COALESCE(r.node_id, ''), r.binding,
	COALESCE((SELECT array_agg(b.device_index ORDER BY b.device_index) FROM bookings b WHERE b.reservation_id = r.id), '{}'),
	r.spec_generation, COALESCE(r.request_id, ''), r.created_by, r.created_at, r.updated_at, r.placed_at, r.active_at,
	r.ended_at`

func scanReservation(row pgx.Row) (Reservation, error) {
	var r Reservation
	err := row.Scan(&r.ID, &r.TenantID, &r.PoolID, &r.GPUs, &r.StartAt, &r.EndAt, &r.State, &r.Reason, &r.NodeID,
		&r.Binding, &r.DeviceIndexes, &r.SpecGeneration, &r.RequestID, &r.CreatedBy, &r.CreatedAt, &r.UpdatedAt,
		&r.PlacedAt, &r.ActiveAt, &r.EndedAt)
	return r, err
}

// GetReservation returns the reservation with id when scope includes its
// tenant. Errors: ErrNotFound (missing, or outside scope).
func GetReservation(ctx context.Context, q DBTX, scope Scope, id string) (Reservation, error) {
	r, err := scanReservation(q.QueryRow(ctx, `SELECT `+reservationColumns+` FROM reservations r
		WHERE r.id = $1 AND ($2::text IS NULL OR r.tenant_id = $2)`, id, scope.arg()))
	if err != nil {
		return Reservation{}, queryErr(fmt.Sprintf("reservation %s", id), err)
	}
	return r, nil
}

// getReservationByRequest returns tenantID's reservation made with
// requestID. Errors: ErrNotFound.
func getReservationByRequest(ctx context.Context, q DBTX, tenantID, requestID string) (Reservation, error) {
	r, err := scanReservation(q.QueryRow(ctx, `SELECT `+reservationColumns+` FROM reservations r
		WHERE r.tenant_id = $1 AND r.request_id = $2`, tenantID, requestID))
	if err != nil {
		return Reservation{}, queryErr(fmt.Sprintf("reservation of request %q", requestID), err)
	}
	return r, nil
}

// ReservationFilter narrows ListReservations; zero fields other than Scope
// match everything.
type ReservationFilter struct {
	// Scope keeps its tenants' reservations (the zero Scope: none).
	Scope  Scope
	PoolID string
	State  string
	// After is the id after which the page starts (the previous page's last).
	After string
	// Limit caps the rows returned; 0: no cap.
	Limit int
}

// ListReservations returns the reservations matching f ordered by id (that
// is, by creation time).
func ListReservations(ctx context.Context, q DBTX, f ReservationFilter) ([]Reservation, error) {
	limit := any(nil)
	if f.Limit > 0 {
		limit = f.Limit
	}
	rows, err := q.Query(ctx, `SELECT `+reservationColumns+` FROM reservations r
		WHERE ($1::text IS NULL OR r.tenant_id = $1) AND ($2 = '' OR r.pool_id = $2) AND ($3 = '' OR r.state = $3)
			AND ($4 = '' OR r.id > $4)
		ORDER BY r.id LIMIT $5`, f.Scope.arg(), f.PoolID, f.State, f.After, limit)
	if err != nil {
		return nil, queryErr("list reservations", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Reservation, error) { return scanReservation(r) })
	if err != nil {
		return nil, queryErr("list reservations", err)
	}
	return out, nil
}

// ErrNotOffered means the pool is not offered to the tenant; errors.As a
// *NotOfferedError for which.
var ErrNotOffered = errors.New("pool not offered")

// NotOfferedError says which pool is not offered to which tenant. It matches
// ErrNotOffered under errors.Is.
type NotOfferedError struct {
	PoolID, TenantID string
	// OwnerTenantID is the tenant owning the pool: a caller that is not of
	// it (nor root) must not learn the pool exists (the API answers
	// NotFound).
	OwnerTenantID string
}

func (e *NotOfferedError) Error() string {
	return fmt.Sprintf("pool %s is not offered to tenant %s", e.PoolID, e.TenantID)
}

// Is makes errors.Is(err, ErrNotOffered) true.
func (e *NotOfferedError) Is(target error) bool { return target == ErrNotOffered }

// ErrQuotaExceeded means a reservation would take a tenant past its quota in
// a pool; errors.As a *QuotaError for the numbers.
var ErrQuotaExceeded = errors.New("quota exceeded")

// QuotaError is a refused reservation: the tenant holds InUse GPUs of the
// pool (pending, binding and active reservations), asked for Want more,
// and may hold Quota. It matches ErrQuotaExceeded under errors.Is.
type QuotaError struct {
	PoolID             string
	Quota, InUse, Want int32
}

func (e *QuotaError) Error() string {
	return fmt.Sprintf("gpus: quota of pool %s is %d GPUs, %d in use, %d requested", e.PoolID, e.Quota, e.InUse, e.Want)
}

// Is makes errors.Is(err, ErrQuotaExceeded) true.
func (e *QuotaError) Is(target error) bool { return target == ErrQuotaExceeded }

// NewReservation is what CreateReservation inserts.
type NewReservation struct {
	// ID is "res_…" (ids.Reservation).
	ID       string
	TenantID string
	PoolID   string
	GPUs     int32
	StartAt  time.Time
	EndAt    time.Time
	// RequestID makes the call idempotent per tenant; "" does not.
	RequestID string
	// CreatedBy is the API token id of the caller.
	CreatedBy string
}

// CreatedReservation is what CreateReservation did.
type CreatedReservation struct {
	Reservation Reservation
	// Existing is true when RequestID named a reservation made before,
	// which is returned unchanged (nothing was written).
	Existing bool
}

// RequestConflictError is the refusal of a request id already used by the
// tenant for a different reservation (another pool, GPU count or duration).
type RequestConflictError struct {
	RequestID string
	Existing  Reservation
}

// Error names the reservation the request id belongs to.
func (e *RequestConflictError) Error() string {
	r := e.Existing
	return fmt.Sprintf("request_id: %q was used for reservation %s (%d GPUs for %s in pool %s); use another request id",
		e.RequestID, r.ID, r.GPUs, r.EndAt.Sub(r.StartAt), r.PoolID)
}

// existingReservation returns r, the reservation a retried request id named,
// when the retry asks for the same pool, GPU count and duration, and a
// *RequestConflictError otherwise.
func existingReservation(r Reservation, n NewReservation) (CreatedReservation, error) {
	if r.PoolID != n.PoolID || r.GPUs != n.GPUs || r.EndAt.Sub(r.StartAt) != n.EndAt.Sub(n.StartAt) {
		return CreatedReservation{}, &RequestConflictError{RequestID: n.RequestID, Existing: r}
	}
	return CreatedReservation{Reservation: r, Existing: true}, nil
}

// CreateReservation creates reservation n in q's transaction (call it in
// DB.InTx) at now:
//
//   - a tenant's earlier reservation with the same RequestID is returned as
//     it is (Existing), whatever the quota now says, when it asked for the
//     same pool, GPU count and duration (else *RequestConflictError);
//   - the tenant's offer row of the pool is locked (SELECT … FOR UPDATE), so
//     concurrent reservations of one tenant in one pool are serialised and
//     the quota holds: GPUs of its pending, binding and active reservations
//     of the pool plus n.GPUs must not pass the offer's quota;
//   - when no node of the pool that is adopted, or still joining or
//     accepting, has n.GPUs GPUs, nothing can ever place it: it is created
//     failed with the reason "no node of pool P has N GPUs (largest: M)" and
//     a reservation.failed event. Otherwise it is created pending and the
//     scheduler is poked (SubjectPokeScheduler); whether free capacity
//     exists now is the scheduler's question, and it fails what it cannot
//     place;
//   - a reservation.created event is written (WriteEvents).
//
// Errors: ErrNotFound (pool), *NotOfferedError (ErrNotOffered),
// *QuotaError (ErrQuotaExceeded).
func CreateReservation(ctx context.Context, q DBTX, now time.Time, n NewReservation) (CreatedReservation, error) {
	if n.RequestID != "" {
		if r, err := getReservationByRequest(ctx, q, n.TenantID, n.RequestID); err == nil {
			return existingReservation(r, n)
		} else if !errors.Is(err, ErrNotFound) {
			return CreatedReservation{}, err
		}
	}
	// Whether the pool exists, its owner, and the tenant's offer of it,
	// locked (FOR UPDATE in the sub-select: the lock serialises the
	// tenant's Reserves of the pool, so that the quota check below holds).
	var (
		owner string
		quota *int32
	)
	if err := q.QueryRow(ctx, `SELECT p.owner_tenant_id,
			(SELECT o.gpu_quota FROM pool_offers o WHERE o.pool_id = p.id AND o.tenant_id = $2 FOR UPDATE)
		FROM pools p WHERE p.id = $1`, n.PoolID, n.TenantID).Scan(&owner, &quota); err != nil {
		return CreatedReservation{}, queryErr(fmt.Sprintf("pool %s", n.PoolID), err)
	}
	if quota == nil {
		return CreatedReservation{}, &NotOfferedError{PoolID: n.PoolID, TenantID: n.TenantID, OwnerTenantID: owner}
	}
	// A concurrent duplicate may have committed while this waited for the
	// lock; read committed sees it now.
	if n.RequestID != "" {
		if r, err := getReservationByRequest(ctx, q, n.TenantID, n.RequestID); err == nil {
			return existingReservation(r, n)
		} else if !errors.Is(err, ErrNotFound) {
			return CreatedReservation{}, err
		}
	}
	// The GPUs the tenant holds of the pool, and whether some node can ever
	// hold this one: the EXISTS stops at the first node big enough (usually
	// the first), where counting every node's devices cost milliseconds per
	// Reserve on a pool of 1,000 nodes. The largest size is needed only for
	// the reason of a refusal.
	var (
		inUse int32
		fits  bool
	)
	if err := q.QueryRow(ctx, `SELECT
			(SELECT COALESCE(sum(gpus), 0)::int FROM reservations
				WHERE tenant_id = $1 AND pool_id = $2 AND state IN ('pending', 'binding', 'active')),
			EXISTS (SELECT 1 FROM nodes nd
				WHERE nd.pool_id = $2 AND nd.provision_state IN ('joining', 'accepting', 'adopted') AND nd.revoked_at IS NULL
					AND (SELECT count(*) FROM node_devices d WHERE d.node_id = nd.id) >= $3)`,
		n.TenantID, n.PoolID, n.GPUs).Scan(&inUse, &fits); err != nil {
		return CreatedReservation{}, queryErr("gpus in use", err)
	}
	if int64(inUse)+int64(n.GPUs) > int64(*quota) {
		return CreatedReservation{}, &QuotaError{PoolID: n.PoolID, Quota: *quota, InUse: inUse, Want: n.GPUs}
	}
	var largest int32
	if !fits {
		if err := q.QueryRow(ctx, `SELECT COALESCE(max(c.n), 0)::int FROM (SELECT count(d.device_index) AS n
			FROM nodes nd LEFT JOIN node_devices d ON d.node_id = nd.id
			WHERE nd.pool_id = $1 AND nd.provision_state IN ('joining', 'accepting', 'adopted') AND nd.revoked_at IS NULL
			GROUP BY nd.id) c`, n.PoolID).Scan(&largest); err != nil {
			return CreatedReservation{}, queryErr("largest node", err)
		}
	}
	state, reason := ReservationPending, ""
	var endedAt *time.Time
	if !fits {
		state = ReservationFailed
		reason = fmt.Sprintf("no node of pool %s has %d GPUs (largest: %d)", n.PoolID, n.GPUs, largest)
		endedAt = &now
	}
	var requestID *string
	if n.RequestID != "" {
		requestID = &n.RequestID
	}
	// The row as GetReservation reads it, from the insert itself.
	r, err := scanReservation(q.QueryRow(ctx, `INSERT INTO reservations AS r (id, tenant_id, pool_id, gpus, start_at, end_at,
			state, reason, request_id, created_by, created_at, updated_at, ended_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11, $12)
		ON CONFLICT (tenant_id, request_id) DO NOTHING
		RETURNING `+reservationColumns,
		n.ID, n.TenantID, n.PoolID, n.GPUs, n.StartAt, n.EndAt, state, reason, requestID, n.CreatedBy, now, endedAt))
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return CreatedReservation{}, queryErr("create reservation", err)
	}
	if err != nil {
		// A duplicate of another pool committed first (the offer lock is
		// per pool).
		r, err := getReservationByRequest(ctx, q, n.TenantID, n.RequestID)
		if err != nil {
			return CreatedReservation{}, err
		}
		return existingReservation(r, n)
	}
	if err := WriteEvents(ctx, q, now, NewEvent{TenantID: n.TenantID, Data: ReservationCreatedData{ReservationID: n.ID,
		PoolID: n.PoolID, GPUs: n.GPUs, StartAt: n.StartAt.UTC(), EndAt: n.EndAt.UTC()}}); err != nil {
		return CreatedReservation{}, err
	}
	if state == ReservationFailed {
		if err := WriteEvents(ctx, q, now, NewEvent{TenantID: n.TenantID,
			Data: ReservationFailedData{ReservationID: n.ID, Reason: reason}}); err != nil {
			return CreatedReservation{}, err
		}
	} else if err := Enqueue(ctx, q, now, SubjectPokeScheduler, nil); err != nil {
		return CreatedReservation{}, err
	}
	return CreatedReservation{Reservation: r}, nil
}

// Activation is what ActivateReservation did.
type Activation struct {
	// Activated is true when the reservation turned active now.
	Activated bool
	// TenantID is the reservation's tenant ("" when it does not exist).
	TenantID string
	// State is the reservation's state after the call.
	State string
	// CreatedAt is when the reservation was made (for its created→active
	// latency, bc.reservations.activation).
	CreatedAt time.Time
}

// ActivateReservation records a daemon's AllocationBound: reservation id
// turns active with binding (CDI device names) and active_at now, and a
// reservation.active event is written, in q's transaction — only when it is
// binding on nodeID and generation is at least the spec generation that
// first carried it. Anything else (a stale report, another node's
// reservation, one already active or ended) changes nothing (Activated
// false). Errors: ErrNotFound when the reservation does not exist.
func ActivateReservation(ctx context.Context, q DBTX, now time.Time, nodeID, id string, binding []string, generation int64) (Activation, error) {
	var (
		a       Activation
		node    *string
		specGen *int64
	)
	err := q.QueryRow(ctx, `SELECT tenant_id, state, node_id, spec_generation, created_at FROM reservations WHERE id = $1 FOR UPDATE`, id).
		Scan(&a.TenantID, &a.State, &node, &specGen, &a.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return Activation{}, fmt.Errorf("activate reservation %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Activation{}, fmt.Errorf("activate reservation %s: %w", id, interpretError(err))
	}
	if a.State != ReservationBinding || node == nil || *node != nodeID || specGen == nil || generation < *specGen {
		return a, nil
	}
	if binding == nil {
		binding = []string{}
	}
	if _, err := q.Exec(ctx, `UPDATE reservations SET state = 'active', binding = $2, active_at = $3, updated_at = $3 WHERE id = $1`,
		id, binding, now); err != nil {
		return Activation{}, fmt.Errorf("activate reservation %s: %w", id, interpretError(err))
	}
	if err := WriteEvents(ctx, q, now, NewEvent{TenantID: a.TenantID, Data: ReservationActiveData{ReservationID: id,
		NodeID: nodeID, Binding: binding, Generation: generation}}); err != nil {
		return Activation{}, err
	}
	a.Activated, a.State = true, ReservationActive
	return a, nil
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
// reservation.<state> event is written; all in q's transaction. An already
// ended reservation is left as it is (Changed false). Errors: ErrNotFound
// (missing, or its tenant outside scope).
func EndReservation(ctx context.Context, q DBTX, signer *IntentSigner, scope Scope, now time.Time, id, state string) (EndedReservation, error) {
	if state != ReservationReleased && state != ReservationExpired {
		return EndedReservation{}, fmt.Errorf("end reservation: state %q is not released or expired", state)
	}
	var (
		cur    string
		tenant string
		node   *string
	)
	err := q.QueryRow(ctx, `SELECT state, tenant_id, node_id FROM reservations
		WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2) FOR UPDATE`, id, scope.arg()).Scan(&cur, &tenant, &node)
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
	if err := WriteEvents(ctx, q, now, NewEvent{TenantID: tenant,
		Data: ReservationEndedData{ReservationID: id, NodeID: res.NodeID, From: cur, State: state}}); err != nil {
		return EndedReservation{}, err
	}
	res.State, res.Changed = state, true
	return res, nil
}

// FailNodeReservations ends the placed reservations (binding or active) of
// node nodeID at now as failed with reason: their bookings end at now
// (bookings that had not started are deleted), so usage stops there and the
// GPUs stop counting against quota; the node's spec drops the allocations
// (signed by signer) and a reservation.failed event is written for each. It
// is for an operator's revocation of the node, never for a loss of
// connectivity (I5). It returns the ids of the reservations it ended. Call
// it in the revocation's transaction.
func FailNodeReservations(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, nodeID, reason string) ([]string, error) {
	rows, err := q.Query(ctx, `UPDATE reservations SET state = 'failed', reason = $3, ended_at = $2, updated_at = $2
		WHERE node_id = $1 AND state IN ('binding', 'active') RETURNING id, tenant_id, state`, nodeID, now, reason)
	if err != nil {
		return nil, fmt.Errorf("fail reservations of node %s: %w", nodeID, interpretError(err))
	}
	var (
		ids    []string
		events []NewEvent
	)
	for rows.Next() {
		var id, tenant, state string
		if err := rows.Scan(&id, &tenant, &state); err != nil {
			rows.Close()
			return nil, err
		}
		ids = append(ids, id)
		events = append(events, NewEvent{TenantID: tenant,
			Data: ReservationFailedData{ReservationID: id, NodeID: nodeID, Reason: reason}})
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("fail reservations of node %s: %w", nodeID, interpretError(err))
	}
	if len(ids) == 0 {
		return nil, nil
	}
	if err := endBookings(ctx, q, now, ids); err != nil {
		return nil, err
	}
	if _, err := RebuildNodeSpecs(ctx, q, signer, now, []string{nodeID}); err != nil {
		return nil, err
	}
	if err := WriteEvents(ctx, q, now, events...); err != nil {
		return nil, err
	}
	return ids, nil
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

// ClaimDueReservations locks (FOR UPDATE SKIP LOCKED) and returns the ids of
// up to limit reservations not yet ended whose end_at ≤ now, earliest end
// first: those the expiry reconciler ends.
func ClaimDueReservations(ctx context.Context, q DBTX, now time.Time, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT id FROM reservations
		WHERE state IN ('pending', 'binding', 'active') AND end_at <= $1
		ORDER BY end_at, id LIMIT $2 FOR UPDATE SKIP LOCKED`, now, limit)
	if err != nil {
		return nil, fmt.Errorf("due reservations: %w", interpretError(err))
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("due reservations: %w", interpretError(err))
	}
	return out, nil
}

// NeverPlacedReason is the reason of a reservation of gpus GPUs whose end
// time passed while it was still pending.
func NeverPlacedReason(gpus int) string {
	return fmt.Sprintf("never placed: no node had %d free GPUs before its end time", gpus)
}

// FailNeverPlaced turns those of ids that are still pending failed with
// NeverPlacedReason (ended_at now) and writes a reservation.failed event for
// each, in q's transaction. Call it on reservations whose end_at ≤ now
// (ClaimDueReservations), before ending the others with EndReservation. It
// returns the failures by id.
func FailNeverPlaced(ctx context.Context, q DBTX, now time.Time, ids []string) ([]ReservationFailure, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `UPDATE reservations SET state = 'failed',
			reason = format('never placed: no node had %s free GPUs before its end time', gpus),
			ended_at = $2, updated_at = $2
		WHERE id = ANY($1) AND state = 'pending' RETURNING id, tenant_id, reason`, ids, now)
	if err != nil {
		return nil, fmt.Errorf("fail never placed: %w", interpretError(err))
	}
	failed, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ReservationFailure, error) {
		var f ReservationFailure
		err := row.Scan(&f.ID, &f.TenantID, &f.Reason)
		return f, err
	})
	if err != nil {
		return nil, fmt.Errorf("fail never placed: %w", interpretError(err))
	}
	slices.SortFunc(failed, func(a, b ReservationFailure) int { return strings.Compare(a.ID, b.ID) })
	events := make([]NewEvent, len(failed))
	for i, f := range failed {
		events[i] = NewEvent{TenantID: f.TenantID, Data: ReservationFailedData{ReservationID: f.ID, Reason: f.Reason}}
	}
	if err := WriteEvents(ctx, q, now, events...); err != nil {
		return nil, err
	}
	return failed, nil
}
