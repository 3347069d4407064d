package store

// The tenant side of reservations (docs/architecture.md, "Reservations"): offers of pools to tenants
// with a GPU quota, creating a reservation (quota, idempotency, fail fast),
// reading reservations and usage windows. Placement, binding and expiry are
// the scheduler's and the controllers'; a reservation ends through
// EndReservation (reservations_core.go).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Offer is a row of pool_offers: a pool offered to a tenant with a quota.
type Offer struct {
	PoolID   string
	TenantID string
	// GPUQuota is how many GPUs the tenant may hold at once in the pool.
	GPUQuota int32
	// GPUsInUse is the sum of the GPUs of the tenant's pending, binding and
	// active reservations of the pool (filled by reads, ignored by writes).
	GPUsInUse int32
	CreatedAt time.Time
	UpdatedAt time.Time
}

// gpusInUseSQL is the GPUs of the reservations of tenant $t in pool $p that
// count against the quota: pending, binding and active ones.
const gpusInUseSQL = `(SELECT COALESCE(sum(r.gpus), 0)::int FROM reservations r
	WHERE r.tenant_id = o.tenant_id AND r.pool_id = o.pool_id AND r.state IN ('pending', 'binding', 'active'))`

const offerColumns = `o.pool_id, o.tenant_id, o.gpu_quota, ` + gpusInUseSQL + `, o.created_at, o.updated_at`

// offerColumnsNullable are offerColumns of an offer LEFT JOINed as o to
// pools p: without an offer they read as empty ids, a zero quota and the
// pool's creation time (tell the two apart with o.pool_id IS NOT NULL).
const offerColumnsNullable = `COALESCE(o.pool_id, ''), COALESCE(o.tenant_id, ''), COALESCE(o.gpu_quota, 0), ` +
	gpusInUseSQL + `, COALESCE(o.created_at, p.created_at), COALESCE(o.updated_at, p.created_at)`

func scanOffer(row pgx.Row) (Offer, error) {
	var o Offer
	err := row.Scan(offerFields(&o)...)
	return o, err
}

// offerFields are the scan destinations of offerColumns (and
// offerColumnsNullable) in o.
func offerFields(o *Offer) []any {
	return []any{&o.PoolID, &o.TenantID, &o.GPUQuota, &o.GPUsInUse, &o.CreatedAt, &o.UpdatedAt}
}

// UpsertOffer offers pool o.PoolID to tenant o.TenantID with o.GPUQuota at
// o.UpdatedAt, or changes the quota of the existing offer (which keeps its
// CreatedAt), and returns the row. Lowering a quota below the GPUs in use
// ends nothing: it only refuses new reservations. Errors: ErrNotFound (pool
// or tenant).
func UpsertOffer(ctx context.Context, q DBTX, o Offer) (Offer, error) {
	if _, err := GetPool(ctx, q, o.PoolID); err != nil {
		return Offer{}, err
	}
	if _, err := GetTenant(ctx, q, o.TenantID); err != nil {
		return Offer{}, err
	}
	_, err := q.Exec(ctx, `INSERT INTO pool_offers (pool_id, tenant_id, gpu_quota, created_at, updated_at)
		VALUES ($1, $2, $3, $4, $4)
		ON CONFLICT (pool_id, tenant_id) DO UPDATE SET gpu_quota = EXCLUDED.gpu_quota, updated_at = EXCLUDED.updated_at`,
		o.PoolID, o.TenantID, o.GPUQuota, o.UpdatedAt)
	if err != nil {
		return Offer{}, queryErr(fmt.Sprintf("offer pool %s to %s", o.PoolID, o.TenantID), err)
	}
	return GetOffer(ctx, q, o.PoolID, o.TenantID)
}

// GetOffer returns the offer of pool to tenant. Errors: ErrNotFound.
func GetOffer(ctx context.Context, q DBTX, poolID, tenantID string) (Offer, error) {
	o, err := scanOffer(q.QueryRow(ctx, `SELECT `+offerColumns+` FROM pool_offers o
		WHERE o.pool_id = $1 AND o.tenant_id = $2`, poolID, tenantID))
	if err != nil {
		return Offer{}, queryErr(fmt.Sprintf("offer of pool %s to tenant %s", poolID, tenantID), err)
	}
	return o, nil
}

// OfferFilter narrows ListOffers; zero fields match everything.
type OfferFilter struct {
	PoolID string
	// VisibleTo keeps the offers made to this tenant and the offers of the
	// pools it owns.
	VisibleTo string
}

// ListOffers returns the offers matching f, by pool id then tenant id, with
// the GPUs in use.
func ListOffers(ctx context.Context, q DBTX, f OfferFilter) ([]Offer, error) {
	rows, err := q.Query(ctx, `SELECT `+offerColumns+` FROM pool_offers o JOIN pools p ON p.id = o.pool_id
		WHERE ($1 = '' OR o.pool_id = $1) AND ($2 = '' OR o.tenant_id = $2 OR p.owner_tenant_id = $2)
		ORDER BY o.pool_id, o.tenant_id`, f.PoolID, f.VisibleTo)
	if err != nil {
		return nil, queryErr("list offers", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Offer, error) { return scanOffer(r) })
	if err != nil {
		return nil, queryErr("list offers", err)
	}
	return out, nil
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

// GetReservation returns the reservation with id. Errors: ErrNotFound.
func GetReservation(ctx context.Context, q DBTX, id string) (Reservation, error) {
	r, err := scanReservation(q.QueryRow(ctx, `SELECT `+reservationColumns+` FROM reservations r WHERE r.id = $1`, id))
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

// ReservationFilter narrows ListReservations; zero fields match everything.
type ReservationFilter struct {
	TenantID string
	PoolID   string
	State    string
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
		WHERE ($1 = '' OR r.tenant_id = $1) AND ($2 = '' OR r.pool_id = $2) AND ($3 = '' OR r.state = $3)
			AND ($4 = '' OR r.id > $4)
		ORDER BY r.id LIMIT $5`, f.TenantID, f.PoolID, f.State, f.After, limit)
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
//   - a reservation.created event is written (InsertReservationEvent).
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
	// Only whether the pool exists and its owner (GetPool would also count
	// its nodes).
	var owner string
	if err := q.QueryRow(ctx, `SELECT owner_tenant_id FROM pools WHERE id = $1`, n.PoolID).Scan(&owner); err != nil {
		return CreatedReservation{}, queryErr(fmt.Sprintf("pool %s", n.PoolID), err)
	}
	var quota int32
	err := q.QueryRow(ctx, `SELECT gpu_quota FROM pool_offers WHERE pool_id = $1 AND tenant_id = $2 FOR UPDATE`,
		n.PoolID, n.TenantID).Scan(&quota)
	if errors.Is(err, pgx.ErrNoRows) {
		return CreatedReservation{}, &NotOfferedError{PoolID: n.PoolID, TenantID: n.TenantID, OwnerTenantID: owner}
	}
	if err != nil {
		return CreatedReservation{}, queryErr("lock offer", err)
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
	var inUse int32
	if err := q.QueryRow(ctx, `SELECT COALESCE(sum(gpus), 0)::int FROM reservations
		WHERE tenant_id = $1 AND pool_id = $2 AND state IN ('pending', 'binding', 'active')`,
		n.TenantID, n.PoolID).Scan(&inUse); err != nil {
		return CreatedReservation{}, queryErr("gpus in use", err)
	}
	if int64(inUse)+int64(n.GPUs) > int64(quota) {
		return CreatedReservation{}, &QuotaError{PoolID: n.PoolID, Quota: quota, InUse: inUse, Want: n.GPUs}
	}
	// Whether some node can ever hold it: this stops at the first node big
	// enough (usually the first), where counting every node's devices cost
	// milliseconds per Reserve on a pool of 1,000 nodes. The largest size is
	// needed only for the reason of a refusal.
	var fits bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM nodes nd
		WHERE nd.pool_id = $1 AND nd.provision_state IN ('joining', 'accepting', 'adopted') AND nd.revoked_at IS NULL
			AND (SELECT count(*) FROM node_devices d WHERE d.node_id = nd.id) >= $2)`, n.PoolID, n.GPUs).Scan(&fits); err != nil {
		return CreatedReservation{}, queryErr("largest node", err)
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
	tag, err := q.Exec(ctx, `INSERT INTO reservations (id, tenant_id, pool_id, gpus, start_at, end_at, state, reason,
			request_id, created_by, created_at, updated_at, ended_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11, $12)
		ON CONFLICT (tenant_id, request_id) DO NOTHING`,
		n.ID, n.TenantID, n.PoolID, n.GPUs, n.StartAt, n.EndAt, state, reason, requestID, n.CreatedBy, now, endedAt)
	if err != nil {
		return CreatedReservation{}, queryErr("create reservation", err)
	}
	if tag.RowsAffected() == 0 {
		// A duplicate of another pool committed first (the offer lock is
		// per pool).
		r, err := getReservationByRequest(ctx, q, n.TenantID, n.RequestID)
		if err != nil {
			return CreatedReservation{}, err
		}
		return existingReservation(r, n)
	}
	data, err := json.Marshal(map[string]any{"reservationId": n.ID, "poolId": n.PoolID, "gpus": n.GPUs,
		"startAt": n.StartAt.UTC(), "endAt": n.EndAt.UTC()})
	if err != nil {
		return CreatedReservation{}, err
	}
	if err := InsertReservationEvent(ctx, q, now, n.TenantID, EventReservationCreated, n.ID, data); err != nil {
		return CreatedReservation{}, err
	}
	if state == ReservationFailed {
		data, err := json.Marshal(map[string]string{"reservationId": n.ID, "reason": reason})
		if err != nil {
			return CreatedReservation{}, err
		}
		if err := InsertReservationEvent(ctx, q, now, n.TenantID, EventReservationFailed, n.ID, data); err != nil {
			return CreatedReservation{}, err
		}
	} else if err := Enqueue(ctx, q, now, SubjectPokeScheduler, nil); err != nil {
		return CreatedReservation{}, err
	}
	r, err := GetReservation(ctx, q, n.ID)
	if err != nil {
		return CreatedReservation{}, err
	}
	return CreatedReservation{Reservation: r}, nil
}

// UsageWindow is a row of usage_windows: the GPU-seconds of one reservation
// within one hour.
type UsageWindow struct {
	ReservationID string
	TenantID      string
	PoolID        string
	// WindowStart is the start of the hour.
	WindowStart time.Time
	// GPUSeconds is GPUs × booked seconds within the hour.
	GPUSeconds int64
}

// UsageFilter narrows ListUsage.
type UsageFilter struct {
	// TenantID keeps one tenant's windows; "" keeps all.
	TenantID string
	// Since keeps the windows that end after it (zero: all).
	Since time.Time
	// Limit caps the rows returned; 0: no cap.
	Limit int
}

// ListUsage returns the usage windows matching f ordered by window start,
// then reservation id.
func ListUsage(ctx context.Context, q DBTX, f UsageFilter) ([]UsageWindow, error) {
	limit := any(nil)
	if f.Limit > 0 {
		limit = f.Limit
	}
	var since any
	if !f.Since.IsZero() {
		since = f.Since
	}
	rows, err := q.Query(ctx, `SELECT reservation_id, tenant_id, pool_id, window_start, gpu_seconds FROM usage_windows
		WHERE ($1 = '' OR tenant_id = $1) AND ($2::timestamptz IS NULL OR window_start > $2::timestamptz - interval '1 hour')
		ORDER BY window_start, reservation_id LIMIT $3`, f.TenantID, since, limit)
	if err != nil {
		return nil, queryErr("list usage", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (UsageWindow, error) {
		var w UsageWindow
		err := r.Scan(&w.ReservationID, &w.TenantID, &w.PoolID, &w.WindowStart, &w.GPUSeconds)
		return w, err
	})
	if err != nil {
		return nil, queryErr("list usage", err)
	}
	return out, nil
}
