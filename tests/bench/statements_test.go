package bench

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// pgStatements reads what Postgres's statements cost over a phase from
// pg_stat_statements, when the benchmark's Postgres loads it
// (BETTER_COMPUTE_TEST_POSTGRES_STATEMENTS=1, storetest.StatementsPreload):
// counts a loaded machine does not blur, unlike CPU time. Nil otherwise.
type pgStatements struct {
	conn *pgx.Conn
}

// startStatements resets pg_stat_statements for the benchmark's database
// (dbURL) and returns the reader of the phase that begins; nil when the
// server does not load it.
func startStatements(b *testing.B, dbURL string) *pgStatements {
	b.Helper()
	if !storetest.StatementsPreload() {
		return nil
	}
	conn, err := pgx.Connect(b.Context(), dbURL)
	require.NoError(b, err)
	b.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(b.Context(), `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`)
	require.NoError(b, err)
	_, err = conn.Exec(b.Context(), `SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)`)
	require.NoError(b, err)
	return &pgStatements{conn: conn}
}

// summary returns, per operation (ops of them in the phase), the
// statements the benchmark's database ran since startStatements (top level,
// BEGIN and COMMIT included), their WAL records and bytes, buffer hits and
// reads, and execution time, then the top statements by execution time,
// each with its calls and WAL records per operation; "" without
// pg_stat_statements.
func (p *pgStatements) summary(b *testing.B, ops int, top int) string {
	b.Helper()
	if p == nil {
		return ""
	}
	ctx := b.Context()
	rows, err := p.conn.Query(ctx, `SELECT calls, wal_records, wal_bytes, shared_blks_hit + shared_blks_read, total_exec_time,
			regexp_replace(left(query, 200), '\s+', ' ', 'g')
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND query NOT LIKE '%pg_stat_statements%'
		ORDER BY total_exec_time DESC`)
	require.NoError(b, err)
	defer rows.Close()
	var (
		calls, walRecords, blocks int64
		walBytes                  float64
		execMS                    float64
		lines                     []string
	)
	n := float64(ops)
	for rows.Next() {
		var (
			c, wr, blks int64
			wb          float64
			ms          float64
			q           string
		)
		require.NoError(b, rows.Scan(&c, &wr, &wb, &blks, &ms, &q))
		calls, walRecords, walBytes, blocks, execMS = calls+c, walRecords+wr, walBytes+wb, blocks+blks, execMS+ms
		if len(lines) < top {
			lines = append(lines, fmt.Sprintf("    %.3f calls, %.2f WAL records, %.1f hits, %.3f ms: %s",
				float64(c)/n, float64(wr)/n, float64(blks)/n, ms/n, q))
		}
	}
	require.NoError(b, rows.Err())
	return fmt.Sprintf("  Postgres per command (pg_stat_statements): %.2f statements, %.1f WAL records, %.0f WAL bytes, "+
		"%.0f buffer hits and reads, %.3f ms of execution; the top %d by execution time, per command:\n%s",
		float64(calls)/n, float64(walRecords)/n, walBytes/n, float64(blocks)/n, execMS/n, len(lines),
		strings.Join(lines, "\n"))
}
