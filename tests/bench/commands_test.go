package bench

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/store"
)

// commandKind is the kind the benchmark runs: the machines run it in no
// simulated time (fakedaemon --command-durations, or Config.Durations in
// process), so the round trip is the control plane's and the daemons'
// handling only.
const commandKind = fakehw.KindDiagNVML

// commandRun is one command the benchmark ran: when RunCommand was called
// and returned, and (from its terminal event) when the control plane
// recorded its end and when the watch delivered that.
type commandRun struct {
	called, returned time.Time
	state            string
	finished, seen   time.Time
}

// commandLog records the commands' calls and terminal events; events may
// arrive before their RunCommand call returns.
type commandLog struct {
	mu   sync.Mutex
	runs map[string]*commandRun
	// ended counts the terminal events received.
	ended int
}

func (l *commandLog) get(id string) *commandRun {
	r := l.runs[id]
	if r == nil {
		r = &commandRun{}
		l.runs[id] = r
	}
	return r
}

func (l *commandLog) called(id string, called, returned time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.get(id)
	r.called, r.returned = called, returned
}

func (l *commandLog) event(e *computev1.Event, at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.get(e.GetSubjectId())
	if r.state == "" {
		l.ended++
	}
	r.state, r.finished, r.seen = e.GetType(), e.GetTime().AsTime(), at
}

// waitEnded waits until every command of ids has its terminal event.
func (l *commandLog) waitEnded(b *testing.B, ids []string, within time.Duration) {
	b.Helper()
	missing := 0
	require.Eventually(b, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		missing = 0
		for _, id := range ids {
			if r := l.runs[id]; r == nil || r.state == "" {
				missing++
			}
		}
		return missing == 0
	}, within, 20*time.Millisecond, "commands without a terminal event: %d of %d", &missing, len(ids))
}

// commandStats are the figures of a set of commands.
type commandStats struct {
	// first is the first RunCommand call, lastReturned the last return,
	// lastFinished the last terminal state recorded.
	first, lastReturned, lastFinished time.Time
	// roundTrip is RunCommand called → terminal state recorded (the
	// terminal event's time, which is the command's finished_at);
	// call is the RunCommand call alone; seen is called → terminal event
	// received through the watch.
	roundTrip, call, seen []time.Duration
	failed                int
}

func (l *commandLog) stats(ids []string) commandStats {
	l.mu.Lock()
	defer l.mu.Unlock()
	var s commandStats
	for _, id := range ids {
		r := l.runs[id]
		if s.first.IsZero() || r.called.Before(s.first) {
			s.first = r.called
		}
		if r.returned.After(s.lastReturned) {
			s.lastReturned = r.returned
		}
		if r.finished.After(s.lastFinished) {
			s.lastFinished = r.finished
		}
		if r.state != store.EventCommandSucceeded {
			s.failed++
		}
		s.roundTrip = append(s.roundTrip, r.finished.Sub(r.called))
		s.call = append(s.call, r.returned.Sub(r.called))
		s.seen = append(s.seen, r.seen.Sub(r.called))
	}
	return s
}

// BenchmarkCommands runs diag.nvml commands through the public API
// (CommandService.RunCommand, as `better-compute commands run` does) on
// BETTER_COMPUTE_BENCH_MACHINES (1,000) adopted machines, every service a
// process of its own (bin/linux, `make build`), and learns each command's
// end from its command.succeeded (or .failed, .expired) event through one
// EventService.Watch. It prints:
//
//   - throughput: BETTER_COMPUTE_BENCH_COMMANDS (10 × machines) commands
//     queued by BETTER_COMPUTE_BENCH_CALLERS (64) concurrent callers as fast
//     as RunCommand returns, spread round-robin over the machines; completed
//     per second from the first call to the last terminal state recorded,
//     and the CPU time per command of each process group over the phase
//     (each service, Postgres, NATS, the machines, the callers) with the
//     control plane's total (services, Postgres, NATS). Target ≤ 0.30 ms of
//     control-plane CPU per command.
//   - round trip: commands at BETTER_COMPUTE_BENCH_COMMAND_RATE (default:
//     half the throughput just measured, so that they do not queue),
//     2 × machines or 20 s of them (at least 200;
//     BETTER_COMPUTE_BENCH_STEADY_COMMANDS sets the count); p50/p99 from the
//     RunCommand call to the terminal state the control plane records (the
//     event's time, the command's finished_at), with the RunCommand call
//     alone, the watch's delivery and, from the commands table, queued →
//     delivered and delivered → finished. Target p99 < 50 ms.
//
// The machines run in a fakedaemon process of their own;
// BETTER_COMPUTE_BENCH_MACHINES_INPROCESS=1 runs them in this process instead
// (their CPU is then the callers').
func BenchmarkCommands(b *testing.B) {
	callers := envInt("BETTER_COMPUTE_BENCH_CALLERS", 64)
	rate := envInt("BETTER_COMPUTE_BENCH_COMMAND_RATE", 0) // 0: half the measured throughput
	inProcess := os.Getenv("BETTER_COMPUTE_BENCH_MACHINES_INPROCESS") == "1"
	durations := fakehw.Durations{ByKind: map[string]time.Duration{commandKind: 0}}
	for range b.N {
		f := startFleet(b, fleetOptions{processes: true})
		n, clk, ctx := f.n, f.clk, b.Context()
		total := envInt("BETTER_COMPUTE_BENCH_COMMANDS", 10*n)
		if inProcess {
			f.startMachines(b, &durations)
		} else {
			f.startMachinesProcess(b, commandKind+"=0", 0)
		}
		f.waitAdopted(b)
		nodes := f.nodeIDs(b)
		hc := f.apiHTTPClient(callers + 2)
		commands := f.commandClient(hc)

		log := &commandLog{runs: map[string]*commandRun{}}
		after, err := store.MaxEventID(ctx, f.db.Pool, store.AllTenants)
		require.NoError(b, err)
		watchCtx, stopWatch := context.WithCancel(ctx)
		watchDone := f.watchEvents(watchCtx, hc, []string{store.EventCommandSucceeded, store.EventCommandFailed,
			store.EventCommandExpired}, after, log.event)
		run := func(node string) (string, error) {
			called := clk.Now()
			res, err := commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{NodeId: node, Kind: commandKind,
				Timeout: durationpb.New(5 * time.Minute)}))
			if err != nil {
				return "", err
			}
			id := res.Msg.GetCommand().GetId()
			log.called(id, called, clk.Now())
			return id, nil
		}
		runAll := func(count int, each func(i int) (string, error)) []string {
			ids := make([]string, count)
			require.NoError(b, parallel(count, callers, func(i int) error {
				id, err := each(i)
				ids[i] = id
				return err
			}))
			log.waitEnded(b, ids, 5*time.Minute)
			return ids
		}

		// Phase 1: throughput, with the CPU time it costs each process group:
		// each service, Postgres, NATS, the machines and the callers.
		m0, cpu0 := f.metrics(b), f.cpu(b)
		stmts := startStatements(b, f.dbURL, f.pgID)
		sampleCtx, stopSampling := context.WithCancel(ctx)
		waits := sampleWaits(sampleCtx, f.dbURL, clk)
		// The phase's length at 500 commands/s, an upper bound (a shorter
		// phase leaves an idle tail in the profile).
		waitProfiles := f.profile(b, "", total/500+1)
		ids := runAll(total, func(i int) (string, error) { return run(nodes[i%len(nodes)]) })
		cpu1, m1 := f.cpu(b), f.metrics(b)
		statements := stmts.summary(b, "command", total, 10, cpu1[groupPostgres]-cpu0[groupPostgres])
		stopSampling()
		waitProfiles()
		sat := cpu1.sub(cpu0)
		s := log.stats(ids)
		require.Zero(b, s.failed, "commands that did not succeed")
		completed := float64(total) / s.lastFinished.Sub(s.first).Seconds()
		queued := float64(total) / s.lastReturned.Sub(s.first).Seconds()
		satRT := percentiles(s.roundTrip, 0.5, 0.99)

		// Phase 2: round trip at a steady rate the control plane sustains.
		rate := rate
		if rate == 0 {
			rate = max(1, int(completed/2))
		}
		steady := envInt("BETTER_COMPUTE_BENCH_STEADY_COMMANDS", max(200, min(2*n, 20*rate)))
		tick := clk.NewTicker(time.Second / time.Duration(rate))
		cpu2 := f.cpu(b)
		waitSteady := f.profile(b, "steady", steady/rate+1)
		ids = runAll(steady, func(i int) (string, error) {
			<-tick.C()
			return run(nodes[(i*7)%len(nodes)])
		})
		tick.Stop()
		steadyCPU := f.cpu(b).sub(cpu2)
		waitSteady()
		s = log.stats(ids)
		require.Zero(b, s.failed, "commands that did not succeed")
		offered := float64(steady) / s.lastReturned.Sub(s.first).Seconds()
		tail := log.tail(ids, 0.01, 250*time.Millisecond)
		rt := percentiles(s.roundTrip, 0.5, 0.99)
		call := percentiles(s.call, 0.5, 0.99)
		seen := percentiles(s.seen, 0.5, 0.99)
		var deliver50, deliver99, finish50, finish99 float64
		require.NoError(b, f.db.Pool.QueryRow(ctx, `SELECT
				percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - created_at)),
				percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - created_at)),
				percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - delivered_at)),
				percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - delivered_at))
			FROM commands WHERE id = ANY($1)`, ids).Scan(&deliver50, &deliver99, &finish50, &finish99))
		stopWatch()
		require.NoError(b, <-watchDone)

		cpCmd := sat.controlPlane() / time.Duration(total)
		record(b, figCPUPerCommand, ms(cpCmd))
		record(b, figCommandsPerSec, completed)
		record(b, figCommandRTp50, ms(rt[0]))
		record(b, figCommandRTp99, ms(rt[1]))
		fmt.Printf("commands: %d %s (no simulated time) on %d machines from %d callers: queued at %.0f/s, "+
			"%.0f completed/s; round trip at that load p50 %s, p99 %s\n",
			total, commandKind, n, callers, queued, completed, satRT[0].Round(time.Millisecond), satRT[1].Round(time.Millisecond))
		fmt.Printf("  CPU per command: %s\n", sat.perOp(total))
		fmt.Printf("  control plane %s of CPU per command (target ≤ 300µs) → ~%.0f commands/s per control-plane core\n",
			cpCmd.Round(time.Microsecond), perCore(cpCmd))
		fmt.Printf("  %s; %s\n", poolLine(m0, m1, total), <-waits)
		if statements != "" {
			fmt.Println(statements)
		}
		fmt.Printf("command round trip at %.0f/s (%d commands): RunCommand → terminal state recorded p50 %s, p99 %s "+
			"(target p99 < 50ms)\n", offered, steady, rt[0].Round(time.Millisecond), rt[1].Round(time.Millisecond))
		fmt.Printf("  RunCommand call p50 %s, p99 %s; queued→delivered p50 %s, p99 %s; delivered→finished p50 %s, p99 %s; "+
			"terminal event received by the watch p50 %s, p99 %s after the call\n",
			call[0].Round(time.Millisecond), call[1].Round(time.Millisecond), secs(deliver50), secs(deliver99),
			secs(finish50), secs(finish99), seen[0].Round(time.Millisecond), seen[1].Round(time.Millisecond))
		fmt.Printf("  CPU per command at this rate: %s\n", steadyCPU.perOp(steady))
		fmt.Printf("  slowest 1%% by when they were called (+s from the first call of the phase, 250 ms buckets): %s\n", tail)
	}
}

// perCore is how many commands per second one core would run at cpu of
// CPU time per command: 1 s / cpu (0 for no CPU time).
func perCore(cpu time.Duration) float64 {
	if cpu <= 0 {
		return 0
	}
	return float64(time.Second) / float64(cpu)
}

// tail says when the slowest fraction q of ids' round trips were called:
// the count in each bucket of width since the first call, e.g. "+1.25s×12
// (max 310ms)", so that a stall (one bucket) tells apart from a spread tail.
func (l *commandLog) tail(ids []string, q float64, width time.Duration) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	type run struct {
		called time.Time
		rt     time.Duration
	}
	runs := make([]run, 0, len(ids))
	var first time.Time
	for _, id := range ids {
		r := l.runs[id]
		runs = append(runs, run{r.called, r.finished.Sub(r.called)})
		if first.IsZero() || r.called.Before(first) {
			first = r.called
		}
	}
	slices.SortFunc(runs, func(a, b run) int { return cmp.Compare(b.rt, a.rt) })
	runs = runs[:max(1, int(q*float64(len(runs))))]
	count := map[time.Duration]int{}
	worst := map[time.Duration]time.Duration{}
	for _, r := range runs {
		b := r.called.Sub(first).Truncate(width)
		count[b]++
		worst[b] = max(worst[b], r.rt)
	}
	parts := []string{}
	for _, b := range slices.Sorted(maps.Keys(count)) {
		parts = append(parts, fmt.Sprintf("+%s×%d (max %s)", b, count[b], worst[b].Round(time.Millisecond)))
	}
	return fmt.Sprintf("%s (first call at %s)", strings.Join(parts, ", "), first.UTC().Format("15:04:05.000"))
}

// secs rounds a duration in seconds to the millisecond.
func secs(s float64) time.Duration {
	return time.Duration(s * float64(time.Second)).Round(time.Millisecond)
}

// sampleWaits samples what the database's client backends are doing every
// 100 ms until ctx ends (pg_stat_activity: active and waiting on what, idle
// in transaction) over its own connection, and sends a summary: the mean
// number of backends in each state, busiest first.
func sampleWaits(ctx context.Context, dbURL string, clk clock.Clock) <-chan string {
	out := make(chan string, 1)
	go func() {
		conn, err := pgx.Connect(context.WithoutCancel(ctx), dbURL)
		if err != nil {
			out <- "wait sampling: " + err.Error()
			return
		}
		defer conn.Close(context.WithoutCancel(ctx))
		counts := map[string]int{}
		samples := 0
		tick := clk.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for ctx.Err() == nil {
			rows, err := conn.Query(ctx, `SELECT state || COALESCE(' ' || wait_event_type || ':' || wait_event, ''), count(*)
				FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
					AND state <> 'idle' GROUP BY 1`)
			if err == nil {
				for rows.Next() {
					var k string
					var n int
					if rows.Scan(&k, &n) == nil {
						counts[k] += n
					}
				}
				rows.Close()
				samples++
			}
			select {
			case <-ctx.Done():
			case <-tick.C():
			}
		}
		keys := slices.SortedFunc(maps.Keys(counts), func(a, b string) int { return counts[b] - counts[a] })
		parts := make([]string, 0, len(keys))
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%s %.1f", k, float64(counts[k])/float64(max(1, samples))))
		}
		out <- "database backends on average (" + strconv.Itoa(samples) + " samples): " + strings.Join(parts, ", ")
	}()
	return out
}
