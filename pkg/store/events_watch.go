package store

// Reading events for the watch (docs/architecture.md, "Events and the
// watch"): the rows after a cursor, every tenant's, so that a watcher can tell
// a gap in the ids from another tenant's event, and the transaction horizon that
// tells it when a gap will never fill.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Event is a row of events: something that happened to a node, reservation
// or command, streamed to API clients by the events watch.
type Event struct {
	// ID increases with every event (bigserial). Ids are taken when a row is
	// inserted but become visible when its transaction commits, so they may
	// appear out of order, and a rolled-back insert leaves a gap for ever.
	ID int64
	// TenantID is the tenant the event belongs to; empty for none.
	TenantID string
	// Type is e.g. "node.cordoned", "reservation.active".
	Type string
	// SubjectID is the id of the node, reservation or command.
	SubjectID string
	// Data is a JSON object.
	Data []byte
	// CreatedAt is when it was written, by the writer's clock (the now of
	// WriteEvents). The database's own insert time is
	// events.inserted_at (ScannedEvent.Old).
	CreatedAt time.Time
}

// EventFilter selects the events a watcher receives.
type EventFilter struct {
	// Scope selects its tenants' events; AllTenants selects every event,
	// those of no tenant included (the zero Scope: none).
	Scope Scope
	// Types are patterns: an exact type ("node.cordoned") or a prefix
	// ending in ".*" ("node.*" matches "node.cordoned", not "node" or
	// "nodes.x"). Empty (nil or no element) matches every type; the
	// patterns themselves are never empty (the API drops the empty
	// entries of a comma-separated list).
	Types []string
}

// Matches reports whether e passes f; it is the Go twin of ScanEvents' SQL.
func (f EventFilter) Matches(e Event) bool {
	if !f.Scope.Includes(e.TenantID) {
		return false
	}
	if len(f.Types) == 0 {
		return true
	}
	return slices.ContainsFunc(f.Types, func(p string) bool { return typeMatches(p, e.Type) })
}

// typeMatches reports whether the event type typ matches the pattern p
// (EventFilter.Types).
func typeMatches(p, typ string) bool {
	if prefix, ok := strings.CutSuffix(p, "*"); ok {
		return strings.HasPrefix(typ, prefix)
	}
	return typ == p
}

// split returns f's exact types and prefixes ("node.*" → "node.").
func (f EventFilter) split() (exact, prefixes []string) {
	exact, prefixes = []string{}, []string{}
	for _, p := range f.Types {
		if prefix, ok := strings.CutSuffix(p, "*"); ok {
			prefixes = append(prefixes, prefix)
		} else {
			exact = append(exact, p)
		}
	}
	return exact, prefixes
}

// ScannedEvent is one committed events row after a cursor: its id, and the
// event when it passes the filter.
type ScannedEvent struct {
	ID int64
	// Match is whether the event passes the filter; Event is set only then.
	Match bool
	// Old is whether the row was inserted at least ScanEvents' oldAge
	// before the read, by the database's own clock (events.inserted_at;
	// rows written before that column existed count as old, migration
	// 000011 says why). Its id was taken no later than its insert, so any
	// id missing below an old row was taken at least oldAge ago.
	Old   bool
	Event Event
}

// ScanEvents returns the committed events with an id above after, every
// tenant's, lowest id first, at most limit (positive) rows; only those
// passing f carry their content (Match). The rows that do not match are
// returned too, as bare ids, so that a watcher can tell a gap in the ids
// (an insert not yet committed, or rolled back) from another tenant's event.
// Every row says whether it was inserted at least oldAge ago (Old).
func ScanEvents(ctx context.Context, q DBTX, after int64, f EventFilter, limit int, oldAge time.Duration) ([]ScannedEvent, error) {
	exact, prefixes := f.split()
	// clock_timestamp(), not now(): the time of the read, not of the
	// start of its transaction.
	rows, err := q.Query(ctx, `SELECT id, m, old, CASE WHEN m THEN COALESCE(tenant_id, '') END, CASE WHEN m THEN type END,
			CASE WHEN m THEN subject_id END, CASE WHEN m THEN data::text END, CASE WHEN m THEN created_at END
		FROM (SELECT e.*, ($2::text IS NULL OR e.tenant_id IS NOT DISTINCT FROM $2)
				AND ($5 OR e.type = ANY($3::text[]) OR EXISTS (SELECT 1 FROM unnest($4::text[]) AS p(prefix)
					WHERE starts_with(e.type, p.prefix))) AS m,
				COALESCE(e.inserted_at <= clock_timestamp() - $7::bigint * interval '1 microsecond', true) AS old
			FROM events e WHERE e.id > $1 ORDER BY e.id LIMIT $6) AS s
		ORDER BY id`, after, f.Scope.arg(), exact, prefixes, len(f.Types) == 0, limit, oldAge.Microseconds())
	if err != nil {
		return nil, queryErr("scan events", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ScannedEvent, error) {
		var (
			s                          ScannedEvent
			tenant, typ, subject, data *string
			at                         *time.Time
		)
		if err := r.Scan(&s.ID, &s.Match, &s.Old, &tenant, &typ, &subject, &data, &at); err != nil {
			return s, err
		}
		if s.Match {
			s.Event = Event{ID: s.ID, TenantID: *tenant, Type: *typ, SubjectID: *subject, Data: []byte(*data), CreatedAt: *at}
		}
		return s, nil
	})
	if err != nil {
		return nil, queryErr("scan events", err)
	}
	return out, nil
}

// MaxEventID returns the highest committed event id, 0 when there is none.
// Every id a watch ever sent is at most MaxEventID (it was committed before
// it was sent), so the API refuses to resume after a higher one; that holds
// as long as the newest event row is never deleted (retention must keep it).
func MaxEventID(ctx context.Context, q DBTX) (int64, error) {
	var id int64
	if err := q.QueryRow(ctx, `SELECT COALESCE(max(id), 0) FROM events`).Scan(&id); err != nil {
		return 0, queryErr("max event id", err)
	}
	return id, nil
}

// TxHorizon is a view of the transactions running in the database
// (pg_current_snapshot, PostgreSQL 13+), as 64-bit transaction ids.
type TxHorizon struct {
	// Xmin is the oldest transaction still running: every transaction with
	// a smaller id has ended (committed or rolled back).
	Xmin int64
	// Xmax is one past the newest transaction id assigned: every
	// transaction running now has a smaller id.
	Xmax int64
}

// CurrentTxHorizon returns the database's TxHorizon now. A watcher that sees
// a gap in the event ids records Xmax; once a later Xmin reaches it, every
// transaction that was running when the gap was seen has ended, so an id
// still missing will never commit (pkg/store Event).
func CurrentTxHorizon(ctx context.Context, q DBTX) (TxHorizon, error) {
	var h TxHorizon
	if err := q.QueryRow(ctx, `SELECT pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint
		FROM pg_current_snapshot() AS s`).Scan(&h.Xmin, &h.Xmax); err != nil {
		return TxHorizon{}, fmt.Errorf("transaction horizon: %w", interpretError(err))
	}
	return h, nil
}
