package store

// Retention (docs/architecture.md, "Retention"): the statements that delete
// rows older than their retention, one bounded batch each. Every function
// here is one statement, so one short transaction of its own when run on
// the pool: it deletes at most limit rows, found through an index
// (migration 000018) or the table's primary key, and returns how many it
// deleted; a caller deletes everything due by calling it until it returns
// fewer than limit. None holds a lock beyond its statement, and rows locked
// by another transaction are skipped (SKIP LOCKED) or waited for only as
// long as that row's writer holds it.
//
// What each keeps, so that no reader, watch or invariant loses a row it
// needs:
//
//   - DeleteOldEvents deletes in id order and stops at the first event not
//     yet due, so that the events retention removed are, for every tenant,
//     exactly those up to an id it records (event_retention): the watch
//     refuses a resume below it instead of skipping what it lost
//     (EventRetention).
//   - DeleteOldCommands keeps every open command, and the acceptance
//     commands of a node still joining or accepting (they count its
//     attempts).
//   - DeleteOldReservations keeps every reservation not ended, and an ended
//     one whose last usage window is not written yet (UsageCandidates);
//     its bookings and tunnel tickets go with it in the same statement, its
//     usage windows stay (DeleteOldUsageWindows).
//   - DeleteOldNodeCerts deletes only certificates expired before the
//     cutoff, so never one that still authenticates (a revoked one stays
//     until it has expired: deleting it earlier would forget its
//     revocation), and never a node's newest certificate.
//   - DeleteOldJoinTokens deletes tokens expired or revoked before the
//     cutoff; a node that joined with one keeps its row (the reference is
//     cleared, migration 000018). A used-up token that has not expired is
//     kept: a removed stale join gives it a use back.

import (
	"context"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/pkg/ids"
)

// DeleteOldEvents deletes at most limit events, lowest id first, written
// (events.created_at) before before: it reads the limit events above the
// highest id retention deleted so far and deletes those below the first
// that is not due, so it never deletes an event while keeping a lower one.
// In the same statement it raises each tenant's event_retention row to the
// highest id it deleted of that tenant's (the empty tenant id for the events of
// no tenant).
// It returns how many it deleted.
func DeleteOldEvents(ctx context.Context, q DBTX, before time.Time, limit int) (int, error) {
	var n int
	err := q.QueryRow(ctx, `WITH start AS (SELECT COALESCE(max(removed_through), 0) AS id FROM event_retention),
		head AS (SELECT e.id, e.created_at FROM events e WHERE e.id > (SELECT id FROM start) ORDER BY e.id LIMIT $2),
		stop AS (SELECT COALESCE(min(id), 9223372036854775807) AS id FROM head WHERE created_at >= $1),
		gone AS (DELETE FROM events e USING head WHERE e.id = head.id AND head.id < (SELECT id FROM stop)
			RETURNING e.id, COALESCE(e.tenant_id, '') AS tenant),
		mark AS (INSERT INTO event_retention (tenant_id, removed_through)
			SELECT tenant, max(id) FROM gone GROUP BY tenant
			ON CONFLICT (tenant_id) DO UPDATE
				SET removed_through = GREATEST(event_retention.removed_through, EXCLUDED.removed_through))
		SELECT count(*) FROM gone`, before, limit).Scan(&n)
	if err != nil {
		return 0, queryErr("delete old events", err)
	}
	return n, nil
}

// EventRetention returns, for scope's events (a tenant's, or every
// tenant's for AllTenants; the zero Scope: none), the highest event id
// retention deleted (0 when it deleted none: every event of scope with an
// id up to it is gone, none above it) and the lowest id kept (0 when none
// is). Both are ids of scope's own events, so that a tenant learns nothing
// of the others' (issue 17's rule for the watch).
func EventRetention(ctx context.Context, q DBTX, scope Scope) (removedThrough, oldestKept int64, err error) {
	var sql string
	args := []any{}
	switch tenant := scope.Tenant(); {
	case tenant != "":
		sql = `SELECT COALESCE((SELECT removed_through FROM event_retention WHERE tenant_id = $1), 0),
			COALESCE((SELECT min(id) FROM events WHERE tenant_id = $1), 0)`
		args = append(args, tenant)
	case scope.All():
		sql = `SELECT COALESCE((SELECT max(removed_through) FROM event_retention), 0),
			COALESCE((SELECT min(id) FROM events), 0)`
	default:
		return 0, 0, nil
	}
	if err := q.QueryRow(ctx, sql, args...).Scan(&removedThrough, &oldestKept); err != nil {
		return 0, 0, queryErr("event retention", err)
	}
	return removedThrough, oldestKept, nil
}

// DeleteOldAudit deletes at most limit audit rows, lowest id first, written
// (audit.at) before before, stopping at the first that is not due (as
// DeleteOldEvents does, through the primary key: no index on at). It
// returns how many it deleted.
func DeleteOldAudit(ctx context.Context, q DBTX, before time.Time, limit int) (int, error) {
	tag, err := q.Exec(ctx, `WITH head AS (SELECT id, at FROM audit ORDER BY id LIMIT $2),
		stop AS (SELECT COALESCE(min(id), 9223372036854775807) AS id FROM head WHERE at >= $1)
		DELETE FROM audit a USING head WHERE a.id = head.id AND head.id < (SELECT id FROM stop)`, before, limit)
	if err != nil {
		return 0, queryErr("delete old audit", err)
	}
	return int(tag.RowsAffected()), nil
}

// DeleteOldCommands deletes at most limit commands that finished
// (commands.finished_at: succeeded, failed, expired, canceled) before
// before, lowest id first, skipping rows locked by another transaction and
// the acceptance commands of a node still joining or accepting (the
// acceptance reconciler counts its attempts by them). It returns how many
// it deleted.
//
// It walks the primary key, not an index of its own (migration 000023): ids
// sort by creation time (pkg/ids) and a command finishes after it was
// created, so every command due has an id below ids.Floor of before, where
// the walk ends. It reads the commands created before before that are kept
// (and the deleted ones' index entries until the vacuum removes them), as
// the walk of an index on finished_at would. A command whose id sorts above
// its creation time is deleted late, never early: only finished_at decides
// what is due.
func DeleteOldCommands(ctx context.Context, q DBTX, before time.Time, limit int) (int, error) {
	// = ANY (ARRAY(…)) deletes the rows found by their primary key
	// whatever the plan's estimate of their number (IN (…) may be planned
	// as a hash join over every row of commands).
	tag, err := q.Exec(ctx, `DELETE FROM commands WHERE id = ANY (ARRAY(
		SELECT c.id FROM commands c WHERE c.id < $3 AND c.finished_at < $1
			AND NOT (c.purpose = 'acceptance' AND EXISTS (SELECT 1 FROM nodes n WHERE n.id = c.node_id
				AND n.provision_state IN ('joining', 'accepting')))
		ORDER BY c.id LIMIT $2 FOR UPDATE SKIP LOCKED))`, before, limit, ids.Floor(ids.Command, before))
	if err != nil {
		return 0, queryErr("delete old commands", err)
	}
	return int(tag.RowsAffected()), nil
}

// DeleteOldReservations deletes at most limit reservations that ended
// (released, expired or failed; reservations.ended_at) before before,
// oldest first, with their bookings and their tunnel tickets, in one
// statement; it skips rows locked by another transaction and a reservation
// whose last usage window is not written yet (UsageCandidates would still
// return it). Its usage windows are kept (DeleteOldUsageWindows). It
// returns how many it deleted.
func DeleteOldReservations(ctx context.Context, q DBTX, before time.Time, limit int) (int, error) {
	var n int
	err := q.QueryRow(ctx, `WITH r AS (
			SELECT r.id FROM reservations r
			WHERE r.ended_at < $1 AND r.state IN ('released', 'expired', 'failed')
				AND NOT (r.placed_at IS NOT NULL AND `+lastWindowUnwrittenSQL+`)
			ORDER BY r.ended_at LIMIT $2 FOR UPDATE SKIP LOCKED),
		b AS (DELETE FROM bookings WHERE reservation_id IN (SELECT id FROM r)),
		t AS (DELETE FROM tunnel_tickets WHERE reservation_id IN (SELECT id FROM r)),
		gone AS (DELETE FROM reservations WHERE id IN (SELECT id FROM r) RETURNING id)
		SELECT count(*) FROM gone`, before, limit).Scan(&n)
	if err != nil {
		return 0, queryErr("delete old reservations", err)
	}
	return n, nil
}

// DeleteOldUsageWindows deletes at most limit usage windows of hours that
// started before before, oldest first. It returns how many it deleted.
func DeleteOldUsageWindows(ctx context.Context, q DBTX, before time.Time, limit int) (int, error) {
	tag, err := q.Exec(ctx, `DELETE FROM usage_windows WHERE (reservation_id, window_start) IN (
		SELECT reservation_id, window_start FROM usage_windows WHERE window_start < $1
		ORDER BY window_start LIMIT $2 FOR UPDATE SKIP LOCKED)`, before, limit)
	if err != nil {
		return 0, queryErr("delete old usage windows", err)
	}
	return int(tag.RowsAffected()), nil
}

// DeleteOldNodeCerts deletes at most limit node certificates that expired
// (node_certs.not_after) before before, revoked or not, oldest first, but
// never a node's newest certificate (the latest not_after of the node, which
// the node's rows and the renewal rate limit read). A revoked
// certificate that has not expired by before is kept, so that its
// revocation is never forgotten while it could still authenticate. It
// returns how many it deleted.
func DeleteOldNodeCerts(ctx context.Context, q DBTX, before time.Time, limit int) (int, error) {
	tag, err := q.Exec(ctx, `DELETE FROM node_certs WHERE serial IN (
		SELECT c.serial FROM node_certs c WHERE c.not_after < $1
			AND EXISTS (SELECT 1 FROM node_certs newer WHERE newer.node_id = c.node_id
				AND (newer.not_after, newer.serial) > (c.not_after, c.serial))
		ORDER BY c.not_after LIMIT $2 FOR UPDATE SKIP LOCKED)`, before, limit)
	if err != nil {
		return 0, queryErr("delete old node certificates", err)
	}
	return int(tag.RowsAffected()), nil
}

// DeleteOldJoinTokens deletes at most limit join tokens that expired or
// were revoked before before, whichever came first, stalest first; the
// nodes that joined with one keep their rows, their join_token_id cleared
// (ON DELETE SET NULL). It returns how many it deleted.
func DeleteOldJoinTokens(ctx context.Context, q DBTX, before time.Time, limit int) (int, error) {
	tag, err := q.Exec(ctx, `DELETE FROM join_tokens WHERE id IN (
		SELECT id FROM join_tokens WHERE LEAST(expires_at, revoked_at) < $1
		ORDER BY LEAST(expires_at, revoked_at) LIMIT $2 FOR UPDATE SKIP LOCKED)`, before, limit)
	if err != nil {
		return 0, fmt.Errorf("delete old join tokens: %w", interpretError(err))
	}
	return int(tag.RowsAffected()), nil
}
