package storetest

import (
	"context"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/pkg/store"
)

// Statements counts the SQL statements (BEGIN and COMMIT among them) that
// the DBs of New send, as a pgx query tracer (store.Options.QueryTracer), so
// that a benchmark reads how many statements and round trips an operation
// costs, which a loaded machine's timings hide. A pgx batch counts as one
// statement (one round trip) per query it holds. It sees every goroutine's
// statements, so it is for benchmarks and tests that do not run in parallel
// with others of their package; it leaves out the outbox notifier's
// coalesced NOTIFY (store.OutboxNotifySQL), which its own goroutine sends on
// a connection of its own after some commit, outside any caller's round
// trips, so that it would land in whichever count runs then.
type Statements struct {
	mu  sync.Mutex
	on  bool
	sql []string
}

// statements is the counter of every DB New opens.
var statements = &Statements{}

// CountStatements returns the process's statement counter, counting from
// zero.
func CountStatements() *Statements {
	statements.Reset()
	return statements
}

// Reset forgets the statements counted so far and counts from now on.
func (s *Statements) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.on, s.sql = true, nil
}

// Stop stops counting; Count and SQL keep what was counted.
func (s *Statements) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.on = false
}

// Count returns how many statements were sent since Reset.
func (s *Statements) Count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sql)
}

// SQL returns the text of the statements sent since Reset, in the order
// they started.
func (s *Statements) SQL() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.sql...)
}

func (s *Statements) record(sql string) {
	if sql == store.OutboxNotifySQL {
		return
	}
	s.mu.Lock()
	if s.on {
		s.sql = append(s.sql, sql)
	}
	s.mu.Unlock()
}

// TraceQueryStart records the statement (pgx.QueryTracer).
func (s *Statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	s.record(data.SQL)
	return ctx
}

// TraceQueryEnd does nothing (pgx.QueryTracer).
func (*Statements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart does nothing (pgx.BatchTracer).
func (*Statements) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

// TraceBatchQuery records one query of a batch (pgx.BatchTracer).
func (s *Statements) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	s.record(data.SQL)
}

// TraceBatchEnd does nothing (pgx.BatchTracer).
func (*Statements) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
