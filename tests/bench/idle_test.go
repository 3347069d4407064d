package bench

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
)

// cpuSample is the CPU time used so far by each part of the stack.
type cpuSample struct {
	gateway, controllers, postgres, nats, self time.Duration
}

func (s cpuSample) sub(o cpuSample) cpuSample {
	return cpuSample{s.gateway - o.gateway, s.controllers - o.controllers, s.postgres - o.postgres, s.nats - o.nats,
		s.self - o.self}
}

// controlPlane is the CPU time of the gateway, the controllers, Postgres and
// NATS.
func (s cpuSample) controlPlane() time.Duration {
	return s.gateway + s.controllers + s.postgres + s.nats
}

// BenchmarkIdleFleet measures what BETTER_COMPUTE_BENCH_MACHINES (1,000)
// connected, idle machines cost the control plane: the gateway and the
// controllers each run as their own process (bin/linux, `make build`), the
// api and joinservice in this process with the machines. It reads the CPU
// time of the gateway, the controllers (/proc/<pid>/stat) and the Postgres
// and NATS containers (their cgroups) over BETTER_COMPUTE_BENCH_IDLE_BASELINE
// (20 s) with no machine, then over BETTER_COMPUTE_BENCH_IDLE_WINDOW (60 s)
// once every machine is adopted and BETTER_COMPUTE_BENCH_IDLE_SETTLE (15 s)
// has passed, and prints each as a share of one core, and the difference
// (what the fleet's heartbeats, every 10 s, cost) per 1,000 machines. Target:
// < 5 % of one core per 1,000 machines. This process's CPU (machines, api,
// joinservice) is printed apart.
func BenchmarkIdleFleet(b *testing.B) {
	window := envDuration("BETTER_COMPUTE_BENCH_IDLE_WINDOW", time.Minute)
	baseline := envDuration("BETTER_COMPUTE_BENCH_IDLE_BASELINE", 20*time.Second)
	settle := envDuration("BETTER_COMPUTE_BENCH_IDLE_SETTLE", 15*time.Second)
	for range b.N {
		f := startFleet(b, fleetOptions{externalGateway: true, externalControllers: true, noScheduler: true})
		n, clk, ctx := f.n, f.clk, b.Context()
		pg, nc := containerOf(b, f.dbURL), containerOf(b, f.natsURL)
		sample := func() cpuSample {
			return cpuSample{gateway: procCPU(b, f.gatewayPID), controllers: procCPU(b, f.controllersPID),
				postgres: containerCPU(b, pg), nats: containerCPU(b, nc), self: procCPU(b, os.Getpid())}
		}
		measure := func(d time.Duration) cpuSample {
			s0 := sample()
			require.NoError(b, clock.Sleep(ctx, clk, d))
			return sample().sub(s0)
		}
		require.NoError(b, clock.Sleep(ctx, clk, 5*time.Second))
		empty := measure(baseline)
		f.startMachines(b, nil)
		f.waitAdopted(b)
		require.NoError(b, clock.Sleep(ctx, clk, settle))
		idle := measure(window)

		pct := func(cpu, over time.Duration) float64 { return 100 * cpu.Seconds() / over.Seconds() }
		total, base := pct(idle.controlPlane(), window), pct(empty.controlPlane(), baseline)
		perK := (total - base) * 1000 / float64(n)
		b.ReportMetric(total, "cp-%core")
		b.ReportMetric(perK, "hb-%core/1000")
		fmt.Printf("idle fleet: %d machines connected for %s: control plane %.1f %% of one core (gateway %.1f, "+
			"controllers %.1f, Postgres %.1f, NATS %.1f); with no machine %.1f %% (gateway %.1f, controllers %.1f, "+
			"Postgres %.1f, NATS %.1f)\n", n, window, total, pct(idle.gateway, window), pct(idle.controllers, window),
			pct(idle.postgres, window), pct(idle.nats, window), base, pct(empty.gateway, baseline),
			pct(empty.controllers, baseline), pct(empty.postgres, baseline), pct(empty.nats, baseline))
		fmt.Printf("  the fleet costs %.2f %% of one core per 1,000 idle machines (target < 5); this process "+
			"(the machines, api, joinservice) %.1f %%\n", perK, pct(idle.self, window))
	}
}
