// Package store is better-compute's one way into PostgreSQL: a pgx pool with
// OpenTelemetry tracing, transactions that retry serialization failures, the
// embedded migrations, and the queries of every service.
//
// Queries take a DBTX so that the pool and a transaction share code: DB.InTx
// runs a function of several statements in one transaction, DB.AutoCommit
// gives a one-statement function a transaction of its own. Driver errors
// become the sentinels of errors.go in one place (interpretError, queryErr);
// add a constraint name there when a new unique or exclusion constraint needs
// its own sentinel.
//
// The queries live in one file per area; a new query goes into its area's:
//
//   - tenants.go, apitokens.go, audit.go: tenants, their API tokens, the
//     audit log;
//   - pools.go, offers.go: sites and pools, offers of pools to tenants;
//   - jointokens.go, nodes.go, trust.go: join tokens, nodes and their GPUs,
//     node certificates and revocation;
//   - acceptance.go: the acceptance reconciler;
//   - sessions.go, liveness.go, leases.go: the gateways' sessions, liveness
//     and gateway presence, the reconcilers' leases;
//   - commands.go, command_updates.go: user commands, daemons' updates;
//   - reservations.go, placement.go, nodespecs.go, usage.go: reservations,
//     the scheduler's placement, the NodeSpecs that carry them, usage;
//   - events.go, events_watch.go: the event types, the data type of each
//     and their one writer (WriteEvents); the watch's reads;
//   - outbox.go, outbox_signal.go: the outbox and waking its relay;
//   - intent.go: signed intent;
//   - migrate.go and migrations/: the schema;
//   - roles.go, roles.sql: the services' database roles and their grants. A
//     query a service runs on a table its role has no privilege on needs a
//     GRANT in roles.sql; TestRoleGrants fails until it has one.
//
// A function that creates a command or changes a NodeSpec takes an
// *IntentSigner and signs what it wrote in the same transaction
// (signedIntent; see intent.go); one that changes what a tenant may follow
// writes its event with WriteEvents in its transaction (events.go says how
// to add an event type). Tests get a database of their own, and rows in it,
// from storetest.
package store

import (
	"context"
	"fmt"
	"time"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/multitracer"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/better-compute/better-compute/pkg/clock"
)

// DBTX is what both *pgxpool.Pool and pgx.Tx offer.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error)
}

// DB is the connection pool plus the clock that stamps rows.
type DB struct {
	Pool  *pgxpool.Pool
	Clock clock.Clock

	// generic is the pool of AutoCommit: connections whose prepared
	// statements run with generic plans (plan_cache_mode
	// force_generic_plan). Nil in a DB not made by Open: AutoCommit uses
	// Pool then.
	generic *pgxpool.Pool

	// notifier sends the NOTIFYs of the outbox writes InTx committed (see
	// outboxTx).
	notifier outboxNotifier
	// outboxSignal, when set, wakes the relays instead (SignalOutboxVia).
	outboxSignal func() error
	// poke, when set, publishes the scheduler's and the gateways' pokes
	// right after the commits that enqueued them, and the events' hints
	// (PokeVia).
	poke func(subject string, payload []byte, outboxID int64) error
}

// Options tune Open.
type Options struct {
	// MaxConns caps the pool; 0 keeps pgx's default (max(4, CPUs)).
	MaxConns int32
	// QueryTracer, when set, also sees every statement of both pools
	// (beside the OpenTelemetry tracer); storetest counts statements with it.
	QueryTracer pgx.QueryTracer
}

// Open connects to the database at url (a postgres:// URL) with tracing
// (otelpgx, no per-query metrics) and waits until it answers a ping, retrying for up to wait.
func Open(ctx context.Context, url string, clk clock.Clock, wait time.Duration, opts Options) (*DB, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	// Traces only: a per-query histogram would build its attributes at
	// every query; the pools' statistics are RecordPoolStats'.
	cfg.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithMeterProvider(noop.NewMeterProvider()))
	if opts.QueryTracer != nil {
		cfg.ConnConfig.Tracer = multitracer.New(cfg.ConnConfig.Tracer, opts.QueryTracer)
	}
	if opts.MaxConns > 0 {
		cfg.MaxConns = opts.MaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	gcfg := cfg.Copy()
	gcfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
	// A generic plan is made once per connection and statement, maybe while
	// a table is nearly empty, when scanning it looks cheapest; it must not
	// stay a scan of the table once the table has grown.
	gcfg.ConnConfig.RuntimeParams["enable_seqscan"] = "off"
	// With seq scans off, a scan a statement cannot avoid (a small table
	// without a fitting index, such as the events watch's maximum of
	// event_retention) is costed above 10^10, far past jit_above_cost, and
	// Postgres would JIT-compile the statement, with inlining and
	// optimization, at every execution: some 100–250 ms for statements that
	// run in well under a millisecond. These short statements never gain
	// from JIT.
	gcfg.ConnConfig.RuntimeParams["jit"] = "off"
	generic, err := pgxpool.NewWithConfig(ctx, gcfg)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("open database: %w", err)
	}
	db := &DB{Pool: pool, Clock: clk, generic: generic}
	deadline := clk.Now().Add(wait)
	for {
		err = pool.Ping(ctx)
		if err == nil {
			return db, nil
		}
		if clk.Now().After(deadline) {
			db.Close()
			return nil, fmt.Errorf("database not reachable after %s: %w", wait, err)
		}
		if serr := clock.Sleep(ctx, clk, 250*time.Millisecond); serr != nil {
			db.Close()
			return nil, serr
		}
	}
}

// RecordPoolStats exports the statistics of db's pools through mp
// (otelpgx.RecordStats of pgxpool.Stat: connections acquired, idle and
// open, acquires and their waits; docs/metrics.md), read at most once a
// second, each pool labeled by db.client.connection.pool.name: main (Pool)
// and generic (AutoCommit's).
func (db *DB) RecordPoolStats(mp metric.MeterProvider) error {
	pools := []struct {
		name string
		pool *pgxpool.Pool
	}{{"main", db.Pool}, {"generic", db.generic}}
	for _, p := range pools {
		if p.pool == nil {
			continue
		}
		if err := otelpgx.RecordStats(p.pool, otelpgx.WithStatsMeterProvider(mp),
			otelpgx.WithStatsAttributes(attribute.String("db.client.connection.pool.name", p.name))); err != nil {
			return fmt.Errorf("record pool stats: %w", err)
		}
	}
	return nil
}

// Close stops the outbox notifier and closes the pools.
func (db *DB) Close() {
	db.notifier.close()
	db.Pool.Close()
	if db.generic != nil {
		db.generic.Close()
	}
}

// Now returns the clock's time truncated to microseconds, the precision of
// timestamptz.
func (db *DB) Now() time.Time { return db.Clock.Now().UTC().Truncate(time.Microsecond) }

// InTx runs fn in a transaction and commits it. A serialization failure or
// deadlock (SQLSTATE 40001, 40P01) reruns fn, up to 10 times; any other error
// rolls back and is returned, interpreted (ErrNotFound, ErrConflict). When
// fn wrote outbox rows (Enqueue, PokeNodes), the relay is signalled after
// the commit, and the direct pokes and the hints of the events fn wrote are
// published then (see outboxTx).
func (db *DB) InTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	return db.inTx(ctx, db.Pool, fn)
}

// InGenericTx is InTx on AutoCommit's connections, whose prepared statements
// run with generic plans (see AutoCommit): for a transaction on a hot path
// whose statements' best plans do not depend on their parameters' values,
// such as the outbox relay's take (an id range and a limit), which Postgres
// otherwise re-planned (~0.5 ms) on every pass.
func (db *DB) InGenericTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	pool := db.generic
	if pool == nil {
		pool = db.Pool
	}
	return db.inTx(ctx, pool, fn)
}

func (db *DB) inTx(ctx context.Context, pool *pgxpool.Pool, fn func(tx pgx.Tx) error) error {
	var err error
	for attempt := 0; attempt < 10; attempt++ {
		err = db.inTxOnce(ctx, pool, fn)
		if !IsRetryable(err) {
			return err
		}
	}
	return err
}

func (db *DB) inTxOnce(ctx context.Context, pool *pgxpool.Pool, fn func(tx pgx.Tx) error) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return interpretError(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	otx := &outboxTx{Tx: tx}
	if err := fn(otx); err != nil {
		return interpretError(err)
	}
	if err := tx.Commit(ctx); err != nil {
		return interpretError(err)
	}
	if len(otx.pokes) > 0 {
		db.publishPokes(otx.pokes)
	}
	if otx.wrote {
		db.signalOutbox()
	}
	return nil
}

// queryIDs runs a query returning one text column and collects it.
func queryIDs(ctx context.Context, q DBTX, what, sql string, args ...any) ([]string, error) {
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, interpretError(err))
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		out = append(out, id)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", what, interpretError(err))
	}
	return out, nil
}

// autoCommit is DB.AutoCommit: the pool, each statement its own
// transaction.
type autoCommit struct {
	*pgxpool.Pool
	db *DB
}

// AutoCommit returns a pool of db as a DBTX on which every statement is a
// transaction of its own, for a store function whose work is one statement
// (QueueCommands) or one pgx.Batch (ClaimSessionDeliveries): the outbox rows
// it writes are signalled to the relay as soon as it returns, as InTx
// signals them after its commit. Functions of several statements belong in
// InTx.
//
// Its connections run prepared statements with generic plans
// (plan_cache_mode = force_generic_plan): the batched statements of the hot
// paths (a command queued, delivered, finished) join arrays of a few to a
// few hundred rows through several CTEs, and Postgres, which otherwise
// re-plans such a statement for every execution when its generic plan looks
// costlier, spent more time planning them (~1 ms each) than running them.
// Their plans do not depend on the parameters' values (primary-key and
// node-id lookups). So do the events watch's reads (ScanEvents: an id
// range of one tenant's index, or of every row, a statement for each, its
// type filters tested row by row). Queries whose best plan does — optional filters such as
// "$1 = ” OR tenant_id = $1" — stay on DB.Pool.
func (db *DB) AutoCommit() DBTX {
	if db.generic != nil {
		return autoCommit{Pool: db.generic, db: db}
	}
	return autoCommit{Pool: db.Pool, db: db}
}

// AutoCommitStat returns the statistics of the pool behind AutoCommit (the
// same as Pool.Stat() in a DB not made by Open).
func (db *DB) AutoCommitStat() *pgxpool.Stat {
	if db.generic != nil {
		return db.generic.Stat()
	}
	return db.Pool.Stat()
}
