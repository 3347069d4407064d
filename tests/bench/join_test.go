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

// BenchmarkJoinToAdoption joins BETTER_COMPUTE_BENCH_MACHINES (default 1,000)
// simulated H100 machines (fakedaemon's multi-machine mode, in this process)
// to the real services (in process, the gateway in its own process) on
// Postgres and NATS containers, and prints machines adopted per second, the
// p50/p99 time from join to adoption, and the gateway's resident memory per
// connected machine. Targets on a 2-core machine: ≥ 167 adopted/s, ≤ 20 KiB
// per idle session.
func BenchmarkJoinToAdoption(b *testing.B) {
	for range b.N {
		f := startFleet(b, fleetOptions{externalGateway: true})
		n, clk, ctx := f.n, f.clk, b.Context()
		rssBefore := rssKiB(b, f.gatewayPID)
		start := f.startMachines(b, nil)
		f.waitAdopted(b)
		wall := clk.Now().Sub(start)
		st := f.stack

		rows, err := st.DB.Pool.Query(ctx, `SELECT extract(epoch FROM adopted_at - created_at) FROM nodes`)
		require.NoError(b, err)
		lat, err := pgx.CollectRows(rows, pgx.RowTo[float64])
		require.NoError(b, err)
		slices.Sort(lat)
		p := func(q float64) time.Duration {
			return time.Duration(lat[int(q*float64(len(lat)-1))] * float64(time.Second))
		}

		var joinSpan float64
		require.NoError(b, st.DB.Pool.QueryRow(ctx,
			`SELECT extract(epoch FROM max(created_at) - min(created_at)) FROM nodes`).Scan(&joinSpan))
		fmt.Printf("joins: %d in %.1fs (%.0f/s, first to last join commit)\n", n, joinSpan, float64(n)/joinSpan)

		// Let the sessions go idle (past Welcome and the first heartbeat).
		require.NoError(b, clock.Sleep(ctx, clk, 3*time.Second))
		rssAfter := rssKiB(b, f.gatewayPID)
		perSession := float64(rssAfter-rssBefore) / float64(n)
		rate := float64(n) / wall.Seconds()

		b.ReportMetric(rate, "adopted/s")
		b.ReportMetric(float64(p(0.5).Milliseconds()), "p50-ms")
		b.ReportMetric(float64(p(0.99).Milliseconds()), "p99-ms")
		b.ReportMetric(perSession, "gw-KiB/session")
		fmt.Printf("join→adoption: %d machines in %s: %.0f adopted/s (target ≥ 167); join→adopted p50 %s, p99 %s\n",
			n, wall.Round(time.Millisecond), rate, p(0.5).Round(time.Millisecond), p(0.99).Round(time.Millisecond))
		fmt.Printf("gateway resident memory: %d KiB before, %d KiB with %d sessions: %.1f KiB per session (target ≤ 20)\n",
			rssBefore, rssAfter, n, perSession)
	}
}
