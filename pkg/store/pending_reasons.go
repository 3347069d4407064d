package store

// Why a reservation is still pending, and how one that was never placed
// ends (docs/architecture.md, "Reservations"): a scheduler pass that cannot place a pending reservation
// says why in reservations.reason (placing it clears the reason), and a
// reservation whose end time passes while still pending fails with a reason
// instead of expiring silently.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

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
	events := make([]ReservationEvent, 0, len(failed))
	for _, f := range failed {
		data, err := json.Marshal(map[string]string{"reservationId": f.ID, "reason": f.Reason})
		if err != nil {
			return nil, err
		}
		events = append(events, ReservationEvent{TenantID: f.TenantID, Type: EventReservationFailed, SubjectID: f.ID, Data: data})
	}
	if err := InsertReservationEvents(ctx, q, now, events); err != nil {
		return nil, err
	}
	return failed, nil
}
