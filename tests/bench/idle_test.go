package bench

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
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
// machines. The machines' process is printed apart. Then, once the gateway
// has ended three garbage collections since the last adoption (the idle
// steady state), its resident memory (/proc) and its
// heap and stacks (GET /metrics: go_memstats_heap_inuse_bytes and
// go_memstats_stack_inuse_bytes) per idle session: their growth from the
// end of the baseline. Target: ≤ 32 KiB resident per idle session.
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
		gw := func() map[string]float64 { return f.metrics(b)[svcGateway] }
		require.NoError(b, clock.Sleep(ctx, clk, 5*time.Second))
		empty := measure(baseline)
		before := f.gatewayMemory(b)
		f.startMachinesProcess(b, "", 0)
		f.waitAdopted(b)
		gcsAdopted := gw()["go_gc_duration_seconds_count"]
		require.NoError(b, clock.Sleep(ctx, clk, settle))
		waitProfiles := f.profile(b, "", int(window/time.Second))
		gw0 := gw()
		idle := measure(window)
		gw1 := gw()
		waitProfiles()
		// The gateway's memory in the idle steady state: once three
		// collections have ended since the last adoption, so that what the
		// joins left is collected, the heap's goal is the idle sessions',
		// and the stacks the joins grew are shrunk back (each collection
		// halves an idle goroutine's stack at most once); the runtime
		// collects at least every 2 minutes. Resident memory rises and
		// falls with each collection and the runtime's return of free
		// pages: it is the mean of memorySamples samples 2 s apart.
		eventually(b, 8*time.Minute, time.Second, func() (bool, string) {
			gcs := gw()["go_gc_duration_seconds_count"] - gcsAdopted
			return gcs >= 3, fmt.Sprintf("%.0f garbage collections of the gateway since the last adoption", gcs)
		})
		var after gatewayMemory
		var rssMax int64
		for i := range memorySamples {
			if i > 0 {
				require.NoError(b, clock.Sleep(ctx, clk, 2*time.Second))
			}
			m := f.gatewayMemory(b)
			after.add(m, 1/float64(memorySamples))
			rssMax = max(rssMax, m.rss)
		}
		f.saveGatewayMemory(b)
		perSession := func(v float64) float64 { return v / float64(n) }
		rssPerSession := perSession(after.rssMean - float64(before.rss))
		grew := func(name string) float64 { return perSession(after.metrics[name]-before.metrics[name]) / 1024 }
		heapPerSession := grew("go_memstats_heap_inuse_bytes") + grew("go_memstats_stack_inuse_bytes")
		record(b, figGatewayRSS, rssPerSession)
		record(b, figGatewayHeap, heapPerSession)

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
		fmt.Printf("gateway memory: %d KiB resident with no machine, %.0f KiB (at most %d) with %d idle sessions: %.1f KiB "+
			"per session (target ≤ 32); heap and stacks %.1f KiB per session\n", before.rss, after.rssMean, rssMax, n,
			rssPerSession, heapPerSession)
		fmt.Printf("  per session: resident anonymous %.1f KiB, file %.1f KiB; heap in use %.1f, allocated %.1f, free not "+
			"returned %.1f, stacks %.1f, runtime metadata %.1f KiB; the heap's goal %.1f KiB; %.2f goroutines\n",
			perSession(after.anonMean-float64(before.anon)), perSession(after.fileMean-float64(before.file)),
			grew("go_memstats_heap_inuse_bytes"), grew("go_memstats_heap_alloc_bytes"),
			grew("go_memstats_heap_idle_bytes")-grew("go_memstats_heap_released_bytes"), grew("go_memstats_stack_inuse_bytes"),
			grew("go_memstats_mspan_sys_bytes")+grew("go_memstats_gc_sys_bytes")+grew("go_memstats_other_sys_bytes"),
			grew("go_memstats_next_gc_bytes"), grew("go_goroutines")*1024)
		gcs := gw1["go_gc_duration_seconds_count"] - gw0["go_gc_duration_seconds_count"]
		fmt.Printf("  the gateway over the window: %.0f garbage collections, %.0f KiB allocated per second\n",
			gcs, (gw1["go_memstats_alloc_bytes_total"]-gw0["go_memstats_alloc_bytes_total"])/1024/window.Seconds())
	}
}

// saveGatewayMemory writes the gateway's heap profile (/debug/pprof/heap,
// its live objects at the last collection) and its goroutines' stacks
// (/debug/pprof/goroutine?debug=1) into DIR/<benchmark>.gateway.heap.pprof
// and DIR/<benchmark>.gateway.goroutines.txt when
// BETTER_COMPUTE_BENCH_PROFILE_DIR=DIR is set.
func (f *fleet) saveGatewayMemory(b *testing.B) {
	b.Helper()
	dir := profileDir()
	if dir == "" {
		return
	}
	prefix := filepath.Join(dir, strings.SplitN(b.Name(), "/", 2)[0]+"."+svcGateway)
	for path, file := range map[string]string{"/debug/pprof/heap": ".heap.pprof", "/debug/pprof/goroutine?debug=1": ".goroutines.txt"} {
		resp, err := http.Get("http://" + f.services[svcGateway].pprof + path)
		require.NoError(b, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(b, err)
		require.NoError(b, os.WriteFile(prefix+file, body, 0o644))
	}
}

// memorySamples is how many samples of the gateway's memory
// BenchmarkIdleFleet averages.
const memorySamples = 10

// gatewayMemory is a sample of the gateway's memory: its resident set and
// its anonymous and file-backed parts (/proc, KiB), and its GET /metrics;
// or the mean of samples (add).
type gatewayMemory struct {
	rss, anon, file             int64
	rssMean, anonMean, fileMean float64
	metrics                     map[string]float64
}

// gatewayMemory samples the gateway's memory.
func (f *fleet) gatewayMemory(b *testing.B) gatewayMemory {
	b.Helper()
	pid := f.gatewayPID
	return gatewayMemory{rss: statusKiB(b, pid, "VmRSS"), anon: statusKiB(b, pid, "RssAnon"), file: statusKiB(b, pid, "RssFile"),
		metrics: f.metrics(b)[svcGateway]}
}

// add adds sample m weighted w to the means of g.
func (g *gatewayMemory) add(m gatewayMemory, w float64) {
	g.rssMean += w * float64(m.rss)
	g.anonMean += w * float64(m.anon)
	g.fileMean += w * float64(m.file)
	if g.metrics == nil {
		g.metrics = map[string]float64{}
	}
	for k, v := range m.metrics {
		g.metrics[k] += w * v
	}
}
