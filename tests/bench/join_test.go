// Package bench holds the scale benchmarks of `make bench`. Each prints its
// figures (and reports them as benchmark metrics); none asserts a time.
package bench

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
)

// joinBenchConcurrency is the fakedaemon's --join-concurrency in
// BenchmarkJoinToAdoption: enough Joins in flight that the machines' side
// (16 by default) does not bound the rate the control plane is measured at.
const joinBenchConcurrency = 256

// BenchmarkJoinToAdoption joins BETTER_COMPUTE_BENCH_MACHINES (default 1,000)
// simulated H100 machines (one fakedaemon process, --nodes) to the control
// plane, every service a process of its own (bin/linux), on Postgres and
// NATS containers, and prints machines adopted per second (from the
// fakedaemon's launch to the last adoption), the p50/p99 time from join to
// adoption (adopted_at − created_at), the CPU time per machine of each
// process group over the whole phase, and the gateway's resident memory
// (/proc) and heap and stacks (its GET /metrics: go_memstats_heap_inuse_bytes
// and go_memstats_stack_inuse_bytes) per connected machine 3 s after the
// last adoption, with what the joins left (BenchmarkIdleFleet records the
// table's figure in the idle steady state). With
// BETTER_COMPUTE_TEST_POSTGRES_STATEMENTS=1 it also prints what Postgres's
// statements did per machine over the phase (pgStatements). Targets on a
// 2-core machine: ≥ 250 adopted/s, ≤ 2 ms of control-plane CPU per machine.
func BenchmarkJoinToAdoption(b *testing.B) {
	for range b.N {
		f := startFleet(b, fleetOptions{processes: true})
		n, clk, ctx := f.n, f.clk, b.Context()
		gwMetrics := func() float64 {
			m := f.metrics(b)[svcGateway]
			return m["go_memstats_heap_inuse_bytes"] + m["go_memstats_stack_inuse_bytes"]
		}
		rssBefore, heapBefore := rssKiB(b, f.gatewayPID), gwMetrics()
		cpu0 := f.cpu(b)
		stmts := startStatements(b, f.dbURL, f.pgID)
		waitProfiles := f.profile(b, "", n/50+1)
		start := clk.Now()
		f.startMachinesProcess(b, "", joinBenchConcurrency)
		f.waitAdopted(b)
		wall := clk.Now().Sub(start)
		cpu1 := f.cpu(b)
		joinCPU := cpu1.sub(cpu0)
		statements := stmts.summary(b, "machine", n, 25, cpu1[groupPostgres]-cpu0[groupPostgres])
		waitProfiles()

		rows, err := f.db.Pool.Query(ctx, `SELECT extract(epoch FROM adopted_at - created_at) FROM nodes`)
		require.NoError(b, err)
		lat, err := pgx.CollectRows(rows, pgx.RowTo[float64])
		require.NoError(b, err)
		slices.Sort(lat)
		p := func(q float64) time.Duration {
			return time.Duration(lat[int(q*float64(len(lat)-1))] * float64(time.Second))
		}

		var joinSpan, adoptSpan float64
		require.NoError(b, f.db.Pool.QueryRow(ctx, `SELECT extract(epoch FROM max(created_at) - min(created_at)),
			extract(epoch FROM max(adopted_at) - min(created_at)) FROM nodes`).Scan(&joinSpan, &adoptSpan))
		fmt.Printf("joins: %d in %.1fs (%.0f/s, first to last join commit); first join commit → last adoption %.1fs\n",
			n, joinSpan, float64(n)/max(joinSpan, 1e-3), adoptSpan)

		// Let the sessions go idle (past Welcome and the first heartbeat).
		require.NoError(b, clock.Sleep(ctx, clk, 3*time.Second))
		rssAfter, heapAfter := rssKiB(b, f.gatewayPID), gwMetrics()
		perSession := float64(rssAfter-rssBefore) / float64(n)
		heapPerSession := (heapAfter - heapBefore) / 1024 / float64(n)
		rate := float64(n) / wall.Seconds()
		cpMachine := joinCPU.controlPlane() / time.Duration(n)

		record(b, figAdopted, rate)
		record(b, figAdoptedP99, ms(p(0.99)))
		record(b, figCPUPerJoin, ms(cpMachine))
		fmt.Printf("join→adoption: %d machines in %s: %.0f adopted/s (target ≥ 250); join→adopted p50 %s, p99 %s\n",
			n, wall.Round(time.Millisecond), rate, p(0.5).Round(time.Millisecond), p(0.99).Round(time.Millisecond))
		fmt.Printf("  CPU per machine: %s (target control plane ≤ 2ms)\n", joinCPU.perOp(n))
		if statements != "" {
			fmt.Println(statements)
		}
		fmt.Printf("gateway memory 3 s after the last adoption: %d KiB resident before, %d KiB with %d sessions: %.1f KiB per "+
			"session; heap and stacks %.1f KiB per session\n", rssBefore, rssAfter, n, perSession, heapPerSession)
	}
}
