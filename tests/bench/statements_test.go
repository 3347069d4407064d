package bench

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// pgStatements reads what Postgres's statements cost over a phase from
// pg_stat_statements, when the benchmark's Postgres loads it
// (BETTER_COMPUTE_TEST_POSTGRES_STATEMENTS=1, storetest.StatementsPreload):
// counts a loaded machine does not blur, unlike CPU time. Nil otherwise.
// It also splits the container's CPU time over the phase by its processes:
// each service's backends (their application_name, set by the benchmark's
// database URLs), autovacuum, the background processes.
type pgStatements struct {
	conn *pgx.Conn
	// container is the Postgres container's id; before the CPU time of its
	// processes at the phase's start.
	container string
	before    map[int]backendCPU
	// tables is pg_stat_user_tables' row counts at the phase's start.
	tables map[string]tableRows
	// walStart is the WAL's insert position at the phase's start, and
	// walFile the name of its segment.
	walStart, walFile string
}

// tableRows is a table's rows inserted, updated (of which HOT: no index
// entry written) and deleted, from pg_stat_user_tables.
type tableRows struct {
	ins, upd, hot, del int64
}

// backendCPU is a Postgres process's name (its backend's application_name,
// or its backend_type) and CPU time.
type backendCPU struct {
	name string
	cpu  time.Duration
}

// startStatements resets pg_stat_statements for the benchmark's database
// (dbURL) and returns the reader of the phase that begins; nil when the
// server does not load it. container is Postgres's container id.
func startStatements(b *testing.B, dbURL, container string) *pgStatements {
	b.Helper()
	if !storetest.StatementsPreload() {
		return nil
	}
	conn, err := pgx.Connect(b.Context(), dbURL)
	require.NoError(b, err)
	b.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(b.Context(), `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`)
	require.NoError(b, err)
	p := &pgStatements{conn: conn, container: container}
	p.before = p.processes(b)
	p.tables = p.tableRows(b)
	require.NoError(b, conn.QueryRow(b.Context(), `SELECT pg_current_wal_insert_lsn()::text,
		pg_walfile_name(pg_current_wal_insert_lsn())`).Scan(&p.walStart, &p.walFile))
	_, err = conn.Exec(b.Context(), `SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)`)
	require.NoError(b, err)
	return p
}

// tableRows returns pg_stat_user_tables' counts of the database's tables
// by name. A backend reports its counts when its transaction ends at most
// once a second, and an idle one up to 10 s later (PostgreSQL 15's
// pgstat), so a reading right after a phase lacks some of its rows: the
// ratios (HOT of updated) read better than the totals.
func (p *pgStatements) tableRows(b *testing.B) map[string]tableRows {
	b.Helper()
	rows, err := p.conn.Query(b.Context(), `SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
		FROM pg_stat_user_tables`)
	require.NoError(b, err)
	defer rows.Close()
	out := map[string]tableRows{}
	for rows.Next() {
		var (
			name string
			t    tableRows
		)
		require.NoError(b, rows.Scan(&name, &t.ins, &t.upd, &t.hot, &t.del))
		out[name] = t
	}
	require.NoError(b, rows.Err())
	return out
}

// tablesLine is, per operation, each table's rows inserted, updated (HOT of
// them) and deleted since startStatements, the tables with none left out.
func (p *pgStatements) tablesLine(b *testing.B, op string, ops int) string {
	b.Helper()
	after := p.tableRows(b)
	n := float64(ops)
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(after)) {
		a, o := after[name], p.tables[name]
		d := tableRows{ins: a.ins - o.ins, upd: a.upd - o.upd, hot: a.hot - o.hot, del: a.del - o.del}
		if d == (tableRows{}) {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %.2f/%.2f (%.2f HOT)/%.2f", name, float64(d.ins)/n, float64(d.upd)/n,
			float64(d.hot)/n, float64(d.del)/n))
	}
	return "  rows per " + op + " inserted/updated (HOT)/deleted (pg_stat_user_tables): " + strings.Join(parts, ", ")
}

// walLine is, per operation, the WAL records written since
// startStatements by kind (pg_waldump --stats=record in the container,
// over the database cluster's whole WAL: every database, the background
// processes' records too), the kinds with the most first: which writes the
// records per command are (index entries, row locks, HOT updates, prunes).
func (p *pgStatements) walLine(b *testing.B, op string, ops int) string {
	b.Helper()
	var end, endFile string
	require.NoError(b, p.conn.QueryRow(b.Context(), `SELECT pg_current_wal_insert_lsn()::text,
		pg_walfile_name(pg_current_wal_insert_lsn())`).Scan(&end, &endFile))
	// The segments named: pg_waldump reads the segment size from the first
	// file it opens, and a segment made ahead of use is zeros.
	out, err := exec.Command("docker", "exec", "-u", "postgres", p.container, "sh", "-c",
		`pg_waldump --stats=record -p "$PGDATA/pg_wal" -s "$1" -e "$2" "$3" "$4"`, "sh", p.walStart, end, p.walFile,
		endFile).CombinedOutput()
	if err != nil {
		return fmt.Sprintf("  WAL records by kind: not readable here (%v: %s)", err, strings.TrimSpace(string(out)))
	}
	type kind struct {
		name string
		n    int64
	}
	var kinds []kind
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || !strings.Contains(f[0], "/") {
			continue
		}
		if n, err := strconv.ParseInt(f[1], 10, 64); err == nil && n > 0 {
			kinds = append(kinds, kind{f[0], n})
		}
	}
	slices.SortStableFunc(kinds, func(x, y kind) int { return cmp.Compare(y.n, x.n) })
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		if float64(k.n)/float64(ops) < 0.01 {
			break
		}
		parts = append(parts, fmt.Sprintf("%s %.2f", k.name, float64(k.n)/float64(ops)))
	}
	return "  WAL records per " + op + " by kind (pg_waldump, the whole cluster): " + strings.Join(parts, ", ")
}

// processes returns the container's Postgres processes by host pid, each
// named after its backend (pg_stat_activity, whose pids are the
// container's: /proc/<pid>/status NSpid maps them), with its CPU time so
// far (/proc/<pid>/stat utime + stime); nil when they cannot be read.
func (p *pgStatements) processes(b *testing.B) map[int]backendCPU {
	b.Helper()
	out, err := exec.Command("docker", "inspect", "-f", "{{.State.Pid}}", p.container).Output()
	if err != nil {
		return nil
	}
	postmaster, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		return nil
	}
	rows, err := p.conn.Query(b.Context(), `SELECT pid, COALESCE(NULLIF(application_name, ''), backend_type, '')
		FROM pg_stat_activity`)
	require.NoError(b, err)
	names := map[int]string{}
	for rows.Next() {
		var (
			pid  int
			name string
		)
		require.NoError(b, rows.Scan(&pid, &name))
		names[pid] = name
	}
	require.NoError(b, rows.Err())
	procs := map[int]backendCPU{}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		var ppid, nspid int
		for _, line := range strings.Split(string(status), "\n") {
			if v, ok := strings.CutPrefix(line, "PPid:"); ok {
				ppid, _ = strconv.Atoi(strings.TrimSpace(v))
			}
			if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
				f := strings.Fields(v)
				nspid, _ = strconv.Atoi(f[len(f)-1])
			}
		}
		if pid != postmaster && ppid != postmaster {
			continue
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		_, rest, _ := strings.Cut(string(stat), ") ")
		f := strings.Fields(rest)
		utime, _ := strconv.ParseInt(f[11], 10, 64)
		stime, _ := strconv.ParseInt(f[12], 10, 64)
		name := names[nspid]
		if pid == postmaster {
			name = "postmaster"
		} else if name == "" {
			name = "other"
		}
		procs[pid] = backendCPU{name: name, cpu: time.Duration(utime+stime) * time.Second / clockTicks}
	}
	return procs
}

// clockTicks is the kernel's USER_HZ, the unit of /proc/<pid>/stat's times.
const clockTicks = 100

// summary returns, per operation (ops of them in the phase, each an op:
// "command", "machine"), the
// statements the benchmark's database ran since startStatements (top level,
// BEGIN and COMMIT included), their WAL records and bytes, buffer hits and
// reads, and execution time, then the top statements by execution time,
// each with its calls and WAL records per operation, each table's rows
// inserted, updated (HOT of them) and deleted (tablesLine), the WAL records
// by kind (walLine), and the container's
// CPU time over the phase, total, by process (cpuLine); "" without
// pg_stat_statements.
func (p *pgStatements) summary(b *testing.B, op string, ops, top int, total time.Duration) string {
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
	return fmt.Sprintf("  Postgres per %s (pg_stat_statements): %.2f statements, %.1f WAL records, %.0f WAL bytes, "+
		"%.0f buffer hits and reads, %.3f ms of execution; the top %d by execution time, per %s:\n%s\n%s\n%s\n%s",
		op, float64(calls)/n, float64(walRecords)/n, walBytes/n, float64(blocks)/n, execMS/n, len(lines), op,
		strings.Join(lines, "\n"), p.tablesLine(b, op, ops), p.walLine(b, op, ops), p.cpuLine(b, op, ops, total))
}

// cpuLine splits total, the container's CPU time over the phase, by its
// processes (processes), per operation (op, as summary's): "exited" is what
// processes that ended during the phase used (total less what the others
// did).
func (p *pgStatements) cpuLine(b *testing.B, op string, ops int, total time.Duration) string {
	b.Helper()
	after := p.processes(b)
	if p.before == nil || after == nil {
		return "  Postgres's CPU by process: not readable here"
	}
	by := map[string]time.Duration{}
	var seen time.Duration
	for pid, a := range after {
		d := a.cpu - p.before[pid].cpu
		by[a.name] += d
		seen += d
	}
	by["exited"] = total - seen
	names := slices.Sorted(maps.Keys(by))
	slices.SortStableFunc(names, func(x, y string) int { return cmp.Compare(by[y], by[x]) })
	parts := make([]string, 0, len(names))
	for _, name := range names {
		parts = append(parts, fmt.Sprintf("%s %s", name, (by[name]/time.Duration(ops)).Round(time.Microsecond)))
	}
	return "  Postgres's CPU per " + op + " by process (its backend's application_name, or its type): " + strings.Join(parts, ", ")
}
