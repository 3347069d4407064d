package store

// Reading events for the watch (docs/architecture.md, "Events and the
// watch"): the rows of the watcher's tenants after a cursor with the
// transactions running at the read, and whether those may still write
// events, which tells it when the ids below what it read are final
// (EventScan, ScanWriters, EventWriters).

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Event is a row of events: something that happened to a node, reservation
// or command, streamed to API clients by the events watch.
type Event struct {
	// ID increases with every event (bigserial). Ids are taken when a row is
	// inserted, after its transaction has a transaction id (migration
	// 000017), but become visible when its transaction commits, so they may
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
	// WriteEvents). The database's own insert time is events.inserted_at,
	// which no reader needs today.
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

// EventScan is one read of ScanEvents: the matching events and the
// transactions running when they were read.
type EventScan struct {
	// Events are the committed events after the cursor that pass the
	// filter, lowest id first.
	Events []Event
	// Running are the transactions in progress at the read's snapshot
	// (their ids modulo 2^32, as pg_locks names them). An event id is
	// taken after its transaction's id (migration 000017), and an id below
	// a committed one was taken before it, so an event with an id below
	// one of Events that was not read belongs to one of Running, to a
	// transaction with an id from Xmax on, or rolled back. ScanWriters
	// tells whether the read is final, and EventWriters when it is.
	Running []int64
	// Xmax is the read's snapshot's xmax (modulo 2^32): a transaction
	// whose id is Xmax or above was running at the read too, yet is not
	// among Running (a snapshot lists only the ids below its xmax, one
	// above the newest id that had ended), and it may have taken an event
	// id below one of Events before a transaction with a lower id took
	// that one and committed. ScanWriters counts those too.
	Xmax int64
	// RemovedThrough is the highest id of the filter's scope that retention
	// deleted as of the read (EventRetention), 0 for none: a watch whose
	// cursor is below it has lost events it did not deliver.
	RemovedThrough int64
}

// scanEventsSQL is ScanEvents' statement for one tenant's events ($1: the
// tenant), which reads that tenant's rows only, through events_tenant_idx
// (tenant_id, id); scanAllEventsSQL reads every row, for AllTenants. Both
// run with generic plans (DB.AutoCommit), hence a statement per scope
// rather than an optional filter. The snapshot is the statement's own
// (pg_current_snapshot() in a query is its snapshot); the LEFT JOIN returns
// it, with no event, when nothing passes, and with it what retention
// removed of the scope's events as of the same snapshot (event_retention).
const (
	scanEventsSQL = `WITH snap AS (SELECT ARRAY(SELECT x::text::bigint % 4294967296 FROM pg_snapshot_xip(s) AS x) AS running,
				pg_snapshot_xmax(s)::text::bigint % 4294967296 AS xmax,
				COALESCE((SELECT removed_through FROM event_retention WHERE tenant_id = $1), 0) AS removed
			FROM pg_current_snapshot() AS s)
		SELECT snap.running, snap.xmax, snap.removed, e.id, COALESCE(e.tenant_id, ''), e.type, e.subject_id, e.data::text, e.created_at
		FROM snap LEFT JOIN LATERAL (SELECT * FROM events
			WHERE tenant_id = $1 AND id > $2 AND ($5 OR type = ANY($3::text[])
				OR EXISTS (SELECT 1 FROM unnest($4::text[]) AS p(prefix) WHERE starts_with(type, p.prefix)))
			ORDER BY tenant_id, id LIMIT $6) AS e ON true
		ORDER BY e.id`
	scanAllEventsSQL = `WITH snap AS (SELECT ARRAY(SELECT x::text::bigint % 4294967296 FROM pg_snapshot_xip(s) AS x) AS running,
				pg_snapshot_xmax(s)::text::bigint % 4294967296 AS xmax,
				COALESCE((SELECT max(removed_through) FROM event_retention), 0) AS removed
			FROM pg_current_snapshot() AS s)
		SELECT snap.running, snap.xmax, snap.removed, e.id, COALESCE(e.tenant_id, ''), e.type, e.subject_id, e.data::text, e.created_at
		FROM snap LEFT JOIN LATERAL (SELECT * FROM events
			WHERE id > $1 AND ($4 OR type = ANY($2::text[])
				OR EXISTS (SELECT 1 FROM unnest($3::text[]) AS p(prefix) WHERE starts_with(type, p.prefix)))
			ORDER BY id LIMIT $5) AS e ON true
		ORDER BY e.id`
)

// ScanEvents returns the committed events with an id above after that pass
// f, lowest id first, at most limit (positive), and the snapshot of the
// read (EventScan says what it tells). For one tenant's scope it reads that
// tenant's rows only (scanEventsSQL), for AllTenants every row; the zero
// Scope reads none.
func ScanEvents(ctx context.Context, q DBTX, after int64, f EventFilter, limit int) (EventScan, error) {
	exact, prefixes := f.split()
	all := len(f.Types) == 0
	var (
		rows pgx.Rows
		err  error
	)
	switch tenant := f.Scope.Tenant(); {
	case f.Scope.All():
		rows, err = q.Query(ctx, scanAllEventsSQL, after, exact, prefixes, all, limit)
	case tenant != "":
		rows, err = q.Query(ctx, scanEventsSQL, tenant, after, exact, prefixes, all, limit)
	default:
		return EventScan{}, nil
	}
	if err != nil {
		return EventScan{}, queryErr("scan events", err)
	}
	var (
		out                          EventScan
		id                           *int64
		tenantID, typ, subject, data *string
		at                           *time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&out.Running, &out.Xmax, &out.RemovedThrough, &id, &tenantID, &typ, &subject, &data, &at},
		func() error {
			if id != nil {
				out.Events = append(out.Events, Event{ID: *id, TenantID: *tenantID, Type: *typ, SubjectID: *subject,
					Data: []byte(*data), CreatedAt: *at})
			}
			return nil
		})
	if err != nil {
		return EventScan{}, queryErr("scan events", err)
	}
	return out, nil
}

// MaxEventID returns the highest event id of scope's tenants that a watch
// may have sent (0 when there is none): the newest committed one, or the
// highest retention deleted (EventRetention) when that is higher, every
// tenant's for AllTenants, the tenant's own (through events_tenant_idx and
// its event_retention row) otherwise, so that it tells a tenant nothing of
// the others. Every id a watch of scope ever sent is at most
// MaxEventID(scope) (it was committed before it was sent, and retention
// records what it deletes), so the API refuses to resume after a higher one.
func MaxEventID(ctx context.Context, q DBTX, scope Scope) (int64, error) {
	var id int64
	sql := `SELECT GREATEST(COALESCE((SELECT max(id) FROM events), 0),
		COALESCE((SELECT max(removed_through) FROM event_retention), 0))`
	args := []any{}
	switch tenant := scope.Tenant(); {
	case tenant != "":
		sql = `SELECT GREATEST(COALESCE((SELECT max(id) FROM events WHERE tenant_id = $1), 0),
			COALESCE((SELECT removed_through FROM event_retention WHERE tenant_id = $1), 0))`
		args = []any{tenant}
	case !scope.All():
		return 0, nil
	}
	if err := q.QueryRow(ctx, sql, args...).Scan(&id); err != nil {
		return 0, queryErr("max event id", err)
	}
	return id, nil
}

// eventWritersSQL is EventWriters' statement: pg_locks read once; a
// transaction's own ExclusiveLock on its id says it is running, and a lock
// on this database's events, held by the same virtual transaction, that it
// may have written events.
const eventWritersSQL = `WITH l AS MATERIALIZED (SELECT locktype, mode, database, relation,
			transactionid::text::bigint AS xid, virtualtransaction FROM pg_locks WHERE granted),
		t AS (SELECT xid, virtualtransaction FROM l
			WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' AND xid = ANY($1::bigint[]))
	SELECT EXISTS (SELECT 1 FROM t JOIN l AS r USING (virtualtransaction)
			WHERE r.locktype = 'relation' AND r.relation = 'events'::regclass
				AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())),
		(SELECT count(DISTINCT xid) FROM t) < cardinality($1::bigint[])`

// EventWriters tells what became of the transactions running (ids modulo
// 2^32, ScanWriters' held) at an earlier read of the events: writing is
// whether one of them is still running and holds a lock on this database's
// events table, which it took before it took any event id and keeps until
// it ends; ended is whether any of them has ended. When writing is false,
// none of them can still commit an event with an id below those the read
// returned (one that takes an id from now on takes a higher one), so a
// read from now on of the ids up to them is final; when ended is false too,
// the earlier read was final already. Transactions of other databases, and
// those that never touched events, never hold a watch back. A prepared
// transaction (two-phase commit) keeps its locks, so it counts as running.
func EventWriters(ctx context.Context, q DBTX, running []int64) (writing, ended bool, err error) {
	if len(running) == 0 {
		return false, false, nil
	}
	if err := q.QueryRow(ctx, eventWritersSQL, running).Scan(&writing, &ended); err != nil {
		return false, false, queryErr("event writers", err)
	}
	return writing, ended, nil
}

// scanWritersSQL is ScanWriters' first statement ($1: EventScan.Running,
// $2: EventScan.Xmax): pg_locks read once, as in eventWritersSQL, and
// besides whether those listed may write events or have ended, the running
// transactions with ids from $2 on (modulo 2^32) that hold a lock on this
// database's events.
const scanWritersSQL = `WITH l AS MATERIALIZED (SELECT locktype, mode, database, relation,
			transactionid::text::bigint AS xid, virtualtransaction FROM pg_locks WHERE granted),
		t AS (SELECT xid, virtualtransaction FROM l WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock'),
		ev AS (SELECT virtualtransaction FROM l WHERE locktype = 'relation' AND relation = 'events'::regclass
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
	SELECT EXISTS (SELECT 1 FROM t JOIN ev USING (virtualtransaction) WHERE xid = ANY($1::bigint[])),
		(SELECT count(DISTINCT xid) FROM t WHERE xid = ANY($1::bigint[])) < cardinality($1::bigint[]),
		ARRAY(SELECT DISTINCT xid FROM t JOIN ev USING (virtualtransaction)
			WHERE (xid - $2 + 4294967296) % 4294967296 < 2147483648 AND NOT xid = ANY($1::bigint[]))`

// ScanWriters is EventWriters for the read scan: it tells, of the
// transactions that may hold event ids below those scan returned (those
// running at it: scan.Running, and those whose ids are scan.Xmax or above),
// whether one of them may still write events (writing) and whether one has
// ended since (ended), and returns held, every one of them still running
// that a later EventWriters must wait for: scan.Running and those with ids
// from scan.Xmax on that hold a lock on events now. A transaction with an
// id from scan.Xmax on that has ended since cannot be named; the snapshot's
// xmax having moved past scan.Xmax when it is read, after pg_locks, says
// that one may have, and counts as ended. When writing and ended are both
// false the read was final; otherwise, once EventWriters(held) says none
// of held may write events, a read from then on of the ids up to those
// scan returned is.
func ScanWriters(ctx context.Context, q DBTX, scan EventScan) (writing, ended bool, held []int64, err error) {
	running := scan.Running
	if running == nil {
		running = []int64{}
	}
	var later []int64
	if err := q.QueryRow(ctx, scanWritersSQL, running, scan.Xmax).Scan(&writing, &ended, &later); err != nil {
		return false, false, nil, queryErr("scan writers", err)
	}
	var moved bool
	if err := q.QueryRow(ctx, `SELECT (pg_snapshot_xmax(pg_current_snapshot())::text::bigint % 4294967296 - $1
			+ 4294967296) % 4294967296 BETWEEN 1 AND 2147483647`, scan.Xmax).Scan(&moved); err != nil {
		return false, false, nil, queryErr("scan writers", err)
	}
	held = append(slices.Clip(scan.Running), later...)
	return writing || len(later) > 0, ended || moved, held, nil
}
