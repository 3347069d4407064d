package bench

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
)

// BenchmarkIdleFleet measures what BETTER_COMPUTE_BENCH_MACHINES (1,000)
// connected, idle machines cost the control plane, every service a process
// of its own (bin/linux, `make build`) and the machines one fakedaemon
// process. It reads the CPU time of each service (/proc/<pid>/stat) and of
// the Postgres and NATS containers (their cgroups) over
// BETTER_COMPUTE_BENCH_IDLE_BASELINE (20 s) with no machine, then over
// BETTER_COMPUTE_BENCH_IDLE_WINDOW (60 s) once every machine is adopted and
// BETTER_COMPUTE_BENCH_IDLE_SETTLE (15 s) has passed, and prints each as a
// share of one core, and the difference (what the fleet's heartbeats, every
// 10 s, cost) per 1,000 machines. Target: ≤ 1 % of one core per 1,000
// machines. The machines' process is printed apart.
func BenchmarkIdleFleet(b *testing.B) {
	window := envDuration("BETTER_COMPUTE_BENCH_IDLE_WINDOW", time.Minute)
	baseline := envDuration("BETTER_COMPUTE_BENCH_IDLE_BASELINE", 20*time.Second)
	settle := envDuration("BETTER_COMPUTE_BENCH_IDLE_SETTLE", 15*time.Second)
	for range b.N {
		f := startFleet(b, fleetOptions{processes: true})
		n, clk, ctx := f.n, f.clk, b.Context()
		measure := func(d time.Duration) cpuGroups {
			s0 := f.cpu(b)
			require.NoError(b, clock.Sleep(ctx, clk, d))
			return f.cpu(b).sub(s0)
		}
		require.NoError(b, clock.Sleep(ctx, clk, 5*time.Second))
		empty := measure(baseline)
		f.startMachinesProcess(b, "", 0)
		f.waitAdopted(b)
		require.NoError(b, clock.Sleep(ctx, clk, settle))
		waitProfiles := f.profile(b, "", int(window/time.Second))
		idle := measure(window)
		waitProfiles()

		pct := func(cpu, over time.Duration) float64 { return 100 * cpu.Seconds() / over.Seconds() }
		total, base := pct(idle.controlPlane(), window), pct(empty.controlPlane(), baseline)
		perK := (total - base) * 1000 / float64(n)
		record(b, figIdlePerK, perK)
		record(b, figIdleWith, total)
		record(b, figIdleWithout, base)
		fmt.Printf("idle fleet: %d machines connected for %s: control plane %.2f %% of one core: %s\n", n, window, total,
			idle.share(window))
		fmt.Printf("  with no machine, over %s: control plane %.2f %%: %s\n", baseline, base, empty.share(baseline))
		fmt.Printf("  the fleet costs the control plane %.2f %% of one core per 1,000 idle machines (target ≤ 1)\n", perK)
	}
}
