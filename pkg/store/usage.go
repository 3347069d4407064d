package store

// Usage windows (I8): GPU-seconds of each reservation in each UTC hour,
// written once. A window's GPU-seconds are, summed over the reservation's
// bookings, the seconds of the booking's [lower, upper) within the hour,
// both bounds first truncated to the whole second. Hour boundaries are whole
// seconds, so the windows of a reservation add up exactly to
// Σ (trunc(upper) − trunc(lower)) over its bookings: its GPUs × its booked
// seconds.
//
// A window is written when it is final: the hour has ended (window end ≤
// now; bookings only ever shrink to the time of a release, which is later),
// or the reservation has ended (released or expired). Windows are written in
// order, so the latest stored window of a reservation says how far it is
// done; the primary key (reservation_id, window_start) with ON CONFLICT DO
// NOTHING makes a replay, or two writers racing, count nothing twice.

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

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
	// Scope keeps its tenants' windows (the zero Scope: none).
	Scope Scope
	// Since keeps the windows that end after it (zero: all).
	Since time.Time
	// Limit caps the rows returned; 0: no cap.
	Limit int
}

// args returns f's Since and Limit as statement arguments: NULL when zero.
func (f UsageFilter) args() (since, limit any) {
	if !f.Since.IsZero() {
		since = f.Since
	}
	if f.Limit > 0 {
		limit = f.Limit
	}
	return since, limit
}

// lastWindowUnwrittenSQL holds for a reservation r (the alias) that ended
// released or expired with a booked second whose last usage window (the
// hour of its last booked second) is not written yet: the usage sink still
// owes it windows.
const lastWindowUnwrittenSQL = `r.state IN ('released', 'expired') AND EXISTS (
	SELECT 1 FROM bookings lb
	WHERE lb.reservation_id = r.id
		AND date_trunc('second', upper(lb.during), 'UTC') > date_trunc('second', lower(lb.during), 'UTC')
		AND NOT EXISTS (SELECT 1 FROM usage_windows lw WHERE lw.reservation_id = r.id
			AND lw.window_start = date_trunc('hour', date_trunc('second', upper(lb.during), 'UTC') - interval '1 second', 'UTC')))`

// ListUsage returns the usage windows matching f ordered by window start,
// then reservation id.
func ListUsage(ctx context.Context, q DBTX, f UsageFilter) ([]UsageWindow, error) {
	since, limit := f.args()
	rows, err := q.Query(ctx, `SELECT reservation_id, tenant_id, pool_id, window_start, gpu_seconds FROM usage_windows
		WHERE ($1::text IS NULL OR tenant_id = $1) AND ($2::timestamptz IS NULL OR window_start > $2::timestamptz - interval '1 hour')
		ORDER BY window_start, reservation_id LIMIT $3`, f.Scope.arg(), since, limit)
	if err != nil {
		return nil, queryErr("list usage", err)
	}
	return collectUsageWindows(rows, "list usage")
}

// OpenUsage returns the usage that no window holds yet of the placed
// reservations matching f: for each running one (binding or active), the
// GPU-seconds of each hour after its latest written window up to now, the
// current hour's so far; for each ended one (released or expired) whose last
// window is not written yet, those of each hour after its latest written
// window up to its end. Both are computed as WriteUsageWindows would write
// them once final, so that the written windows and OpenUsage together never
// lose or count twice a second of an ended reservation: the sink writes all
// of an ended reservation's remaining windows in one statement, after which
// OpenUsage returns none of them. They are not stored: a later call, or the
// written windows, count a running reservation's seconds again. Ordered as
// ListUsage; f.Limit caps them.
func OpenUsage(ctx context.Context, q DBTX, f UsageFilter, now time.Time) ([]UsageWindow, error) {
	since, limit := f.args()
	rows, err := q.Query(ctx, `WITH b AS (
			SELECT b.reservation_id AS rid, r.tenant_id, r.pool_id,
				date_trunc('second', lower(b.during), 'UTC') AS lo,
				CASE WHEN r.state IN ('binding', 'active')
					THEN least(date_trunc('second', upper(b.during), 'UTC'), date_trunc('second', $3::timestamptz, 'UTC'))
					ELSE date_trunc('second', upper(b.during), 'UTC') END AS hi
			FROM bookings b JOIN reservations r ON r.id = b.reservation_id
			WHERE r.placed_at IS NOT NULL AND ($1::text IS NULL OR r.tenant_id = $1) AND (
				r.state IN ('binding', 'active')
				OR (`+lastWindowUnwrittenSQL+`))
		), w AS (
			SELECT b.rid, b.tenant_id, b.pool_id, ws,
				extract(epoch FROM least(b.hi, ws + interval '1 hour') - greatest(b.lo, ws))::bigint AS secs
			FROM b, generate_series(date_trunc('hour', b.lo, 'UTC'), b.hi - interval '1 second', interval '1 hour') AS ws
			WHERE b.hi > b.lo
		)
		SELECT w.rid, w.tenant_id, w.pool_id, w.ws, sum(w.secs)::bigint FROM w
		WHERE w.ws > coalesce((SELECT max(u.window_start) FROM usage_windows u WHERE u.reservation_id = w.rid), '-infinity')
			AND ($2::timestamptz IS NULL OR w.ws > $2::timestamptz - interval '1 hour')
		GROUP BY w.rid, w.tenant_id, w.pool_id, w.ws
		ORDER BY w.ws, w.rid LIMIT $4`, f.Scope.arg(), since, now, limit)
	if err != nil {
		return nil, queryErr("open usage", err)
	}
	return collectUsageWindows(rows, "open usage")
}

// UsageCandidates returns, by id, up to limit reservations after the id
// after ("" from the start) that may have usage windows to write: the
// placed ones still open, and the ended ones whose last window (the hour of
// their last booked second) is not written yet.
func UsageCandidates(ctx context.Context, q DBTX, after string, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT r.id FROM reservations r
		WHERE r.id > $1 AND r.placed_at IS NOT NULL AND (
			r.state IN ('binding', 'active')
			OR (`+lastWindowUnwrittenSQL+`))
		ORDER BY r.id LIMIT $2`, after, limit)
	if err != nil {
		return nil, fmt.Errorf("usage candidates: %w", interpretError(err))
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("usage candidates: %w", interpretError(err))
	}
	return out, nil
}

// WriteUsageWindows writes the final usage windows of the reservations ids
// that are not written yet (see the package comment on usage) and returns
// how many it wrote. It is one statement: atomic without a transaction.
func WriteUsageWindows(ctx context.Context, q DBTX, now time.Time, ids []string) (int64, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	tag, err := q.Exec(ctx, `WITH b AS (
			SELECT b.reservation_id AS rid,
				date_trunc('second', lower(b.during), 'UTC') AS lo,
				date_trunc('second', upper(b.during), 'UTC') AS hi
			FROM bookings b WHERE b.reservation_id = ANY($1)
		), w AS (
			SELECT b.rid, ws,
				extract(epoch FROM least(b.hi, ws + interval '1 hour') - greatest(b.lo, ws))::bigint AS secs
			FROM b, generate_series(date_trunc('hour', b.lo, 'UTC'), b.hi - interval '1 second', interval '1 hour') AS ws
			WHERE b.hi > b.lo
		)
		INSERT INTO usage_windows (reservation_id, window_start, tenant_id, pool_id, gpu_seconds, created_at)
		SELECT w.rid, w.ws, r.tenant_id, r.pool_id, sum(w.secs), $2
		FROM w JOIN reservations r ON r.id = w.rid
		WHERE (w.ws + interval '1 hour' <= $2 OR r.state IN ('released', 'expired'))
			AND w.ws > coalesce((SELECT max(u.window_start) FROM usage_windows u WHERE u.reservation_id = w.rid), '-infinity')
		GROUP BY w.rid, w.ws, r.tenant_id, r.pool_id
		ON CONFLICT (reservation_id, window_start) DO NOTHING`, ids, now)
	if err != nil {
		return 0, fmt.Errorf("write usage windows: %w", interpretError(err))
	}
	return tag.RowsAffected(), nil
}

// collectUsageWindows reads rows of (reservation_id, tenant_id, pool_id,
// window_start, gpu_seconds); what names the read in its error.
func collectUsageWindows(rows pgx.Rows, what string) ([]UsageWindow, error) {
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (UsageWindow, error) {
		var w UsageWindow
		err := r.Scan(&w.ReservationID, &w.TenantID, &w.PoolID, &w.WindowStart, &w.GPUSeconds)
		return w, err
	})
	if err != nil {
		return nil, queryErr(what, err)
	}
	return out, nil
}
