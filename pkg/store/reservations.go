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
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/telemetry"
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

// reservationColumnNames name reservationColumns, for a CTE that selects
// them.
const reservationColumnNames = `id, tenant_id, pool_id, gpus, start_at, end_at, state, reason, node_id, binding,
	device_indexes, spec_generation, request_id, created_by, created_at, updated_at, placed_at, active_at, ended_at`

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
	// Audit, when not nil, is the audit row of the call, which
	// CreateReservation writes with the reservation.
	Audit *ReservationAudit
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

// ReservationAudit is the audit row of the call that makes a reservation
// (the API's Reserve), which CreateReservation writes in its own statement
// when it creates the reservation or returns an existing one, and not when
// it refuses (the caller's audit of refusals writes those).
type ReservationAudit struct {
	// Entry is the row; CreateReservation sets its Target to the
	// reservation's id and its Detail to one of the three below.
	Entry AuditEntry
	// Pending and Failed are the details of a reservation created pending,
	// or failed because no node can ever hold it; Existing is the detail of
	// an existing reservation returned for its request id.
	Pending, Failed, Existing string
}

// maxCreateRuns bounds the runs of CreateReservation's statement: a second
// sees what committed while the first waited for the offer's lock, a third
// the duplicate of the request id the second's insert met.
const maxCreateRuns = 3

// CreateReservation creates reservation n in q's transaction (call it in
// DB.InTx) at now, with its audit row when n.Audit is set, in one statement
// (createReservationSQL) and, when that one waited for another Reserve of
// the tenant in the pool or met a duplicate request id committed after it
// began, one or two more:
//
//   - a tenant's earlier reservation with the same RequestID is returned as
//     it is (Existing), whatever the quota now says, when it asked for the
//     same pool, GPU count and duration (else *RequestConflictError);
//   - the tenant's offer row of the pool is locked (an UPDATE of its
//     reserve_seq), so concurrent reservations of one tenant in one pool are
//     serialised and the quota holds: GPUs of its pending, binding and
//     active reservations of the pool plus n.GPUs must not pass the offer's
//     quota. A statement whose snapshot is older than the lock (it waited
//     for another Reserve's commit: the counter it incremented is not one
//     past the one it read) decides nothing and runs again, now seeing
//     that one's GPUs;
//   - when no node of the pool that is adopted, or still joining or
//     accepting, has n.GPUs GPUs, nothing can ever place it: it is created
//     failed with the reason "no node of pool P has N GPUs (largest: M)" and
//     a reservation.failed event. Otherwise it is created pending and the
//     scheduler is poked (SubjectPokeScheduler, also directly after the
//     commit where the DB has DB.PokeVia); whether free capacity exists now
//     is the scheduler's question, and it fails what it cannot place;
//   - a reservation.created event is written (as WriteEvents writes one).
//
// Errors: ErrNotFound (pool), *NotOfferedError (ErrNotOffered),
// *QuotaError (ErrQuotaExceeded); on any of them nothing was written.
func CreateReservation(ctx context.Context, q DBTX, now time.Time, n NewReservation) (CreatedReservation, error) {
	a := n.Audit
	created, err := json.Marshal(ReservationCreatedData{ReservationID: n.ID, PoolID: n.PoolID, GPUs: n.GPUs,
		StartAt: n.StartAt.UTC(), EndAt: n.EndAt.UTC()})
	if err != nil {
		return CreatedReservation{}, fmt.Errorf("create reservation: encode its event: %w", err)
	}
	var requestID *string
	if n.RequestID != "" {
		requestID = &n.RequestID
	}
	var e AuditEntry
	if a != nil {
		e = a.Entry
	}
	args := []any{n.ID, n.TenantID, n.PoolID, n.GPUs, n.StartAt, n.EndAt, requestID, n.CreatedBy, now,
		string(created), telemetry.Traceparent(ctx),
		a != nil, e.TenantID, e.TokenID, e.Role, e.Procedure, e.Outcome, detailOf(a, ReservationPending),
		detailOf(a, ReservationFailed), detailOf(a, "")}
	for range maxCreateRuns {
		o, err := scanCreateOutcome(q.QueryRow(ctx, createReservationSQL, args...))
		if err != nil {
			return CreatedReservation{}, queryErr("create reservation", err)
		}
		switch {
		case o.existing:
			return existingReservation(o.r, n)
		case o.inserted:
			want := 1
			if o.r.State == ReservationFailed {
				want = 2
			}
			if o.events != want {
				return CreatedReservation{}, fmt.Errorf("create reservation: %d events written of %d", o.events, want)
			}
			hint := []string{eventHintSubject(n.TenantID, EventReservationCreated)}
			if o.r.State == ReservationPending {
				pokeAfterCommit(q, SubjectPokeScheduler, nil, 0)
				if err := signalOutbox(ctx, q); err != nil {
					return CreatedReservation{}, fmt.Errorf("create reservation: signal the outbox: %w", interpretError(err))
				}
			} else {
				hint = append(hint, eventHintSubject(n.TenantID, EventReservationFailed))
			}
			hintEvents(q, hint)
			return CreatedReservation{Reservation: o.r}, nil
		case o.owner == nil:
			return CreatedReservation{}, fmt.Errorf("pool %s: %w", n.PoolID, ErrNotFound)
		case o.quota == nil:
			return CreatedReservation{}, &NotOfferedError{PoolID: n.PoolID, TenantID: n.TenantID, OwnerTenantID: *o.owner}
		case !o.fresh:
			// It waited for another Reserve's commit: run again, holding
			// the lock, with a snapshot that sees it.
			continue
		case int64(o.inUse)+int64(n.GPUs) > int64(*o.quota):
			return CreatedReservation{}, &QuotaError{PoolID: n.PoolID, Quota: *o.quota, InUse: o.inUse, Want: n.GPUs}
		}
		// The insert met a duplicate of the request id committed after the
		// statement began (one of another pool: the offer's lock is per
		// pool); the next run reads it.
	}
	return CreatedReservation{}, fmt.Errorf("create reservation %s: no outcome after %d runs", n.ID, maxCreateRuns)
}

// detailOf is a's detail of a reservation created in state, or of an
// existing one for state "".
func detailOf(a *ReservationAudit, state string) string {
	switch {
	case a == nil:
		return ""
	case state == ReservationPending:
		return a.Pending
	case state == ReservationFailed:
		return a.Failed
	}
	return a.Existing
}

// createOutcome is a row of createReservationSQL.
type createOutcome struct {
	// owner is the pool's owner, nil when the pool does not exist.
	owner *string
	// quota is the offer's quota, nil without an offer (or when an
	// existing reservation answered).
	quota *int32
	// fresh is whether the statement's snapshot saw every reservation made
	// under the offer before it took its lock.
	fresh bool
	inUse int32
	// events is how many events it wrote.
	events int
	// existing or inserted: r is the request id's reservation, or the one
	// created.
	existing, inserted bool
	r                  Reservation
}

func scanCreateOutcome(row pgx.Row) (createOutcome, error) {
	var (
		o                                                           createOutcome
		inUse                                                       *int32
		kind                                                        *bool
		id, tenant, pool, state, reason, node, requestID, createdBy *string
		gpus                                                        *int32
		start, end, createdAt, updatedAt                            *time.Time
	)
	r := &o.r
	if err := row.Scan(&o.owner, &o.quota, &o.fresh, &inUse, &o.events, &kind, &id, &tenant, &pool, &gpus, &start, &end,
		&state, &reason, &node, &r.Binding, &r.DeviceIndexes, &r.SpecGeneration, &requestID, &createdBy, &createdAt,
		&updatedAt, &r.PlacedAt, &r.ActiveAt, &r.EndedAt); err != nil {
		return createOutcome{}, err
	}
	if inUse != nil {
		o.inUse = *inUse
	}
	if kind == nil {
		return o, nil
	}
	o.existing, o.inserted = *kind, !*kind
	r.ID, r.TenantID, r.PoolID, r.GPUs, r.StartAt, r.EndAt = *id, *tenant, *pool, *gpus, *start, *end
	r.State, r.Reason, r.NodeID, r.RequestID, r.CreatedBy = *state, *reason, *node, *requestID, *createdBy
	r.CreatedAt, r.UpdatedAt = *createdAt, *updatedAt
	return o, nil
}

// reservationFailedDataSQL is ReservationFailedData, without a node, as SQL
// over a row with the columns id and reason of reservations (a test checks
// that the two agree).
const reservationFailedDataSQL = `jsonb_build_object('reservationId', id, 'reason', reason)`

// createReservationSQL is CreateReservation's statement. $1–$9 are the
// reservation (id, tenant, pool, gpus, start, end, request id or NULL,
// created by, now), $10 the reservation.created data, $11 the poke's
// traceparent; $12 whether to write the audit row and
// $13–$20 its tenant, token, role, procedure, outcome and the details of a
// pending, a failed and an existing reservation. Its CTEs: ex, the request
// id's reservation; seen, the offer's counter in the snapshot; lk, the
// offer's row locked and its counter incremented (unless ex answers); chk,
// the quota, whether the snapshot is fresh, the GPUs in use and whether a
// node can ever hold n; ok, the row to insert when fresh and within quota,
// with the reason of a never-fits failure (the largest node is counted only
// then); ins, the insert (nothing on a duplicate request id); src and ev,
// the events (eventWriterCTE); poke, the scheduler's outbox row; aud, the
// audit row. It returns one row: the pool's owner, the quota, freshness,
// GPUs in use, events written, and the reservation returned (the
// existing one, or the one inserted), all NULL when none.
var createReservationSQL = `WITH ex(` + reservationColumnNames + `) AS (
		SELECT ` + reservationColumns + ` FROM reservations r WHERE r.tenant_id = $2 AND r.request_id = $7::text),
	seen AS (SELECT o.reserve_seq FROM pool_offers o WHERE o.pool_id = $3 AND o.tenant_id = $2),
	lk AS (
		UPDATE pool_offers o SET reserve_seq = o.reserve_seq + 1
		WHERE o.pool_id = $3 AND o.tenant_id = $2 AND NOT EXISTS (SELECT FROM ex)
		RETURNING o.pool_id, o.tenant_id, o.gpu_quota, o.reserve_seq),
	chk AS (
		SELECT o.gpu_quota AS quota, COALESCE(o.reserve_seq = (SELECT s.reserve_seq + 1 FROM seen s), false) AS fresh,
			` + gpusInUseSQL + ` AS in_use,
			EXISTS (SELECT 1 FROM nodes nd
				WHERE nd.pool_id = $3 AND nd.provision_state IN ('joining', 'accepting', 'adopted') AND nd.revoked_at IS NULL
					AND (SELECT count(*) FROM node_devices d WHERE d.node_id = nd.id) >= $4::int) AS fits
		FROM lk o),
	ok AS (
		SELECT c.fits, CASE WHEN c.fits THEN '' ELSE format('no node of pool %s has %s GPUs (largest: %s)', $3::text, $4::int,
				(SELECT COALESCE(max(m.n), 0)::int FROM (SELECT count(d.device_index) AS n
					FROM nodes nd LEFT JOIN node_devices d ON d.node_id = nd.id
					WHERE nd.pool_id = $3 AND nd.provision_state IN ('joining', 'accepting', 'adopted') AND nd.revoked_at IS NULL
					GROUP BY nd.id) m)) END AS reason
		FROM chk c WHERE c.fresh AND c.in_use::bigint + $4::int <= c.quota),
	ins(` + reservationColumnNames + `) AS (
		INSERT INTO reservations AS r (id, tenant_id, pool_id, gpus, start_at, end_at, state, reason, request_id, created_by,
			created_at, updated_at, ended_at)
		SELECT $1, $2, $3, $4::int, $5, $6, CASE WHEN ok.fits THEN 'pending' ELSE 'failed' END, ok.reason, $7::text, $8,
			$9::timestamptz, $9::timestamptz, CASE WHEN ok.fits THEN NULL ELSE $9::timestamptz END
		FROM ok
		ON CONFLICT (tenant_id, request_id) DO NOTHING
		RETURNING ` + reservationColumns + `),
	src AS (
		SELECT 1 AS ord, $2::text AS tenant, '` + EventReservationCreated + `'::text AS type, i.id AS subject,
			$10::jsonb AS data, $9::timestamptz AS at
		FROM ins i
		UNION ALL
		SELECT 2, $2::text, '` + EventReservationFailed + `', i.id, ` + reservationFailedDataSQL + `, $9::timestamptz
		FROM ins i WHERE i.state = 'failed'),
	` + eventWriterCTE("src") + `,
	poke AS (
		INSERT INTO outbox (subject, payload, created_at, traceparent)
		SELECT '` + SubjectPokeScheduler + `', ''::bytea, $9::timestamptz, $11 FROM ins i WHERE i.state = 'pending'),
	aud AS (
		INSERT INTO audit (at, tenant_id, token_id, role, procedure, target, outcome, detail)
		SELECT $9::timestamptz, NULLIF($13::text, ''), NULLIF($14::text, ''), $15, $16, a.target, $17, a.detail
		FROM (SELECT e.id AS target, $20::text AS detail FROM ex e
			UNION ALL
			SELECT i.id, CASE WHEN i.state = 'failed' THEN $19::text ELSE $18::text END FROM ins i) a
		WHERE $12::bool),
	res AS (SELECT true AS existing, e.* FROM ex e UNION ALL SELECT false, i.* FROM ins i)
SELECT (SELECT p.owner_tenant_id FROM pools p WHERE p.id = $3), c.quota, COALESCE(c.fresh, false), c.in_use,
	` + eventCountSQL + `::int, r.*
FROM (VALUES (1)) AS one(x) LEFT JOIN chk c ON true LEFT JOIN res r ON true`

// Activation is what ActivateReservations did with one report.
type Activation struct {
	// Found is false when the reservation does not exist (and then the
	// other fields are zero).
	Found bool
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

// AllocationBound is a daemon's report that the devices of a reservation
// are bound (gateway.proto AllocationBound), for ActivateReservations.
type AllocationBound struct {
	// NodeID is the reporting node.
	NodeID string
	// ReservationID is the reservation whose devices it bound.
	ReservationID string
	// Binding is the CDI device names it bound.
	Binding []string
	// Generation is the NodeSpec generation it applied.
	Generation int64
}

// ActivateReservation is ActivateReservations of one report. Errors:
// ErrNotFound when the reservation does not exist.
func ActivateReservation(ctx context.Context, q DBTX, now time.Time, nodeID, id string, binding []string, generation int64) (Activation, error) {
	out, err := ActivateReservations(ctx, q, now, []AllocationBound{{NodeID: nodeID, ReservationID: id, Binding: binding,
		Generation: generation}})
	if err != nil {
		return Activation{}, err
	}
	if !out[0].Found {
		return Activation{}, fmt.Errorf("activate reservation %s: %w", id, ErrNotFound)
	}
	return out[0], nil
}

// ActivateReservations records daemons' AllocationBound reports, in one
// statement (run it in DB.AutoCommit or a transaction): the reservation of
// each turns active with its binding (CDI device names; none is an empty
// list) and active_at now, and a reservation.active event is written
// (ReservationActiveData) — only when it is binding on the reporting node
// and the report's generation is at least the spec generation that first
// carried it. Anything else (a stale report, another node's reservation,
// one already active or ended, or a second report of a reservation another
// report of the batch activates) changes nothing (Activated false). The
// reservations are locked in id order, so that concurrent batches do not
// deadlock on each other. It returns one Activation per report, in their
// order.
func ActivateReservations(ctx context.Context, q DBTX, now time.Time, reports []AllocationBound) ([]Activation, error) {
	if len(reports) == 0 {
		return nil, nil
	}
	n := len(reports)
	nodes, resIDs, data := make([]string, n), make([]string, n), make([]string, n)
	gens := make([]int64, n)
	for i, r := range reports {
		binding := r.Binding
		if binding == nil {
			binding = []string{}
		}
		b, err := json.Marshal(ReservationActiveData{ReservationID: r.ReservationID, NodeID: r.NodeID, Binding: binding,
			Generation: r.Generation})
		if err != nil {
			return nil, fmt.Errorf("activate reservations: encode the event of %s: %w", r.ReservationID, err)
		}
		nodes[i], resIDs[i], gens[i], data[i] = r.NodeID, r.ReservationID, r.Generation, string(b)
	}
	rows, err := q.Query(ctx, activateReservationsSQL, nodes, resIDs, gens, data, now)
	if err != nil {
		return nil, fmt.Errorf("activate reservations: %w", interpretError(err))
	}
	out := make([]Activation, 0, n)
	var activated, written int
	var tenants, types []string
	for rows.Next() {
		var (
			a         Activation
			createdAt *time.Time
		)
		if err := rows.Scan(&a.Found, &a.Activated, &a.TenantID, &a.State, &createdAt, &written); err != nil {
			rows.Close()
			return nil, fmt.Errorf("activate reservations: %w", err)
		}
		if createdAt != nil {
			a.CreatedAt = *createdAt
		}
		if a.Activated {
			activated++
			tenants, types = append(tenants, a.TenantID), append(types, EventReservationActive)
		}
		out = append(out, a)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("activate reservations: %w", interpretError(err))
	}
	if len(out) != n {
		return nil, fmt.Errorf("activate reservations: %d answers for %d reports", len(out), n)
	}
	if activated == 0 {
		return out, nil
	}
	if written != activated {
		return nil, fmt.Errorf("activate reservations: %d events for %d activations", written, activated)
	}
	hintEvents(q, eventHints(tenants, types))
	return out, nil
}

// activateReservationsSQL is ActivateReservations' statement: $1–$4 the
// reports (node, reservation, generation, reservation.active data, whose
// "binding" is the binding written), $5 now.
// l locks the reservations in id order and reads them as they are once
// locked; w picks, of each reservation's reports that activate it, the
// first; act writes them (checking the row again), src and ev the
// events. One row per report, in their order: found, activated, tenant,
// state after, created_at, and the events written.
var activateReservationsSQL = `WITH u AS (
		SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) WITH ORDINALITY AS u(node, id, gen, data, ord)),
	l AS (
		SELECT r.id, r.tenant_id, r.state, r.node_id, r.spec_generation, r.created_at FROM reservations r
		WHERE r.id = ANY($2) ORDER BY r.id FOR NO KEY UPDATE),
	w AS (
		SELECT DISTINCT ON (l.id) l.id, u.ord FROM l JOIN u ON u.id = l.id
		WHERE l.state = 'binding' AND l.node_id = u.node AND u.gen >= l.spec_generation
		ORDER BY l.id, u.ord),
	act AS (
		UPDATE reservations r SET state = 'active', binding = ARRAY(SELECT jsonb_array_elements_text(u.data::jsonb -> 'binding')),
			active_at = $5, updated_at = $5
		FROM w JOIN u ON u.ord = w.ord
		WHERE r.id = w.id AND r.state = 'binding' AND r.node_id = u.node AND u.gen >= r.spec_generation
		RETURNING r.id, r.tenant_id, u.ord, u.data),
	src AS (
		SELECT a.ord, a.tenant_id AS tenant, '` + EventReservationActive + `'::text AS type, a.id AS subject,
			a.data::jsonb AS data, $5::timestamptz AS at
		FROM act a),
	` + eventWriterCTE("src") + `
SELECT l.id IS NOT NULL, a.ord IS NOT NULL, COALESCE(l.tenant_id, ''),
	CASE WHEN EXISTS (SELECT FROM act x WHERE x.id = u.id) THEN '` + ReservationActive + `' ELSE COALESCE(l.state, '') END,
	l.created_at, ` + eventCountSQL + `::int
FROM u LEFT JOIN l ON l.id = u.id LEFT JOIN act a ON a.ord = u.ord
ORDER BY u.ord`

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
	// The rows are locked in id order, as ActivateReservations locks
	// them, so the two cannot deadlock.
	rows, err := q.Query(ctx, `WITH l AS (
			SELECT id FROM reservations WHERE node_id = $1 AND state IN ('binding', 'active') ORDER BY id FOR NO KEY UPDATE)
		UPDATE reservations r SET state = 'failed', reason = $3, ended_at = $2, updated_at = $2
		FROM l WHERE r.id = l.id AND r.state IN ('binding', 'active') RETURNING r.id, r.tenant_id, r.state`, nodeID, now, reason)
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
