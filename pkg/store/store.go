// Package store is better-compute's one way into PostgreSQL: a pgx pool with
// OpenTelemetry tracing, transactions that retry serialization failures, the
// embedded migrations, and the queries of every service.
//
// Queries take a DBTX so that the pool and a transaction share code. Driver
// errors become the sentinels below in one place (interpretError); add a
// constraint name there when a new unique or exclusion constraint needs its
// own sentinel. Each area keeps its queries in a file of its own
// (jointokens.go, nodes.go, commands.go, outbox.go, …). A function that
// creates a command or changes a NodeSpec takes an *IntentSigner and signs
// what it wrote in the same transaction (signedIntent; see intent.go).
package store

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/better-compute/better-compute/pkg/clock"
)

// Sentinel errors returned by store functions; wrap-compare with errors.Is.
var (
	// ErrNotFound means the row does not exist (or is not visible).
	ErrNotFound = errors.New("not found")
	// ErrConflict means a unique or exclusion constraint refused the change.
	ErrConflict = errors.New("conflict")
	// ErrStale means the row changed under an optimistic update.
	ErrStale = errors.New("stale")
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
}

// Options tune Open.
type Options struct {
	// MaxConns caps the pool; 0 keeps pgx's default (max(4, CPUs)).
	MaxConns int32
}

// Open connects to the database at url (a postgres:// URL) with tracing and
// waits until it answers a ping, retrying for up to wait.
func Open(ctx context.Context, url string, clk clock.Clock, wait time.Duration, opts Options) (*DB, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	cfg.ConnConfig.Tracer = otelpgx.NewTracer()
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
// fn wrote outbox rows (Enqueue, InsertReservationEvents), the relay is
// signalled after the commit (see outboxTx).
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
	if otx.wrote {
		db.signalOutbox()
	}
	return nil
}

// IsRetryable reports whether err is a serialization failure or a deadlock
// (SQLSTATE 40001, 40P01): the transaction was rolled back and may simply
// run again, as InTx does.
func IsRetryable(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code == "40001" || pe.Code == "40P01"
	}
	return false
}

// interpretError turns driver errors into sentinels; other errors pass
// through unchanged.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch pe.Code {
		case "23505", "23P01": // unique_violation, exclusion_violation
			return &ConstraintError{Constraint: pe.ConstraintName, err: err}
		}
	}
	return err
}

// ConstraintError is a unique or exclusion violation of a named constraint.
// It matches ErrConflict under errors.Is.
type ConstraintError struct {
	// Constraint is the constraint's name in the schema.
	Constraint string
	err        error
}

func (e *ConstraintError) Error() string {
	return "conflict on " + e.Constraint + ": " + e.err.Error()
}

// Is makes errors.Is(err, ErrConflict) true.
func (e *ConstraintError) Is(target error) bool { return target == ErrConflict }

// Unwrap returns the driver error.
func (e *ConstraintError) Unwrap() error { return e.err }

// IsUnavailable reports whether err is a failure to reach the database
// rather than an answer from it, so that the call may succeed when retried
// (callers map it to Unavailable): a failed connect, including one that
// timed out or found no host (*pgconn.ConnectError, also as a pool's
// failed acquire), a network error on an open connection (net.Error, not
// the caller's own context ending), or a server that refuses work while
// shutting down or starting (SQLSTATE class 08, 57P01–57P03).
func IsUnavailable(err error) bool {
	if err == nil {
		return false
	}
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case strings.HasPrefix(pe.Code, "08"), // connection_exception
			pe.Code == "57P01", // admin_shutdown
			pe.Code == "57P02", // crash_shutdown
			pe.Code == "57P03": // cannot_connect_now
			return true
		}
		return false
	}
	// The context errors are net.Errors too (Timeout): a call whose own
	// deadline passed is DeadlineExceeded, not Unavailable.
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ne net.Error
	return errors.As(err, &ne)
}

// IsConstraint reports whether err is a violation of the named constraint.
func IsConstraint(err error, name string) bool {
	var ce *ConstraintError
	return errors.As(err, &ce) && ce.Constraint == name
}
