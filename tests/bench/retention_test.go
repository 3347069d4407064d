package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/services/controllers/controllers"
)

// BenchmarkRetention runs one retention pass (controllers.Retention, the
// reconciler the controllers run behind their lease) over
// BETTER_COMPUTE_BENCH_RETENTION_EVENTS (10,000,000) events past their
// retention, while commands run through the public API on
// BETTER_COMPUTE_BENCH_RETENTION_MACHINES (100) adopted machines at
// BETTER_COMPUTE_BENCH_RETENTION_COMMAND_RATE (200) per second. The old
// events (20 days old; the pass keeps events 10 days) are written by one
// INSERT … SELECT generate_series statement before the machines join (so
// that their ids come first, as old events' do). The
// pass deletes BETTER_COMPUTE_BENCH_RETENTION_BATCH (10,000; the service's
// default is 1,000, which takes ten times the statements and pauses for the
// same rows) rows per statement with BETTER_COMPUTE_BENCH_RETENTION_PAUSE
// (the service's default, 50 ms) between statements.
//
// It prints the time to seed, the pass's duration and rows per second, and
// the command round trip (RunCommand called → terminal state recorded, as
// BenchmarkCommands measures it) p50/p99 of the commands called during the
// pass, beside those of the same number of seconds of commands before it
// (at most 20 s). Target: the round trip p99 during the pass stays under
// the commands' target, 100 ms.
func BenchmarkRetention(b *testing.B) {
	events := envInt("BETTER_COMPUTE_BENCH_RETENTION_EVENTS", 10_000_000)
	rate := envInt("BETTER_COMPUTE_BENCH_RETENTION_COMMAND_RATE", 200)
	batch := envInt("BETTER_COMPUTE_BENCH_RETENTION_BATCH", 10*controllers.DefaultRetentionBatch)
	pause := envDuration("BETTER_COMPUTE_BENCH_RETENTION_PAUSE", controllers.DefaultRetentionPause)
	for range b.N {
		f := startFleet(b, fleetOptions{machines: envInt("BETTER_COMPUTE_BENCH_RETENTION_MACHINES", 100), noScheduler: true})
		clk, ctx, db := f.clk, b.Context(), f.db

		seeded := clk.Now()
		_, err := db.Pool.Exec(ctx, `INSERT INTO events (tenant_id, type, subject_id, data, created_at)
			SELECT $1, 'node.cordoned', 'node_bench', '{"nodeId": "node_bench", "reason": "retention benchmark"}',
				$2::timestamptz + g * interval '1 millisecond'
			FROM generate_series(1, $3::bigint) AS g`, f.tenantID, clk.Now().Add(-20*24*time.Hour), events)
		require.NoError(b, err)
		_, err = db.Pool.Exec(ctx, `VACUUM (PARALLEL 0, ANALYZE) events`)
		require.NoError(b, err)
		seedTime := clock.Since(clk, seeded)

		f.startMachines(b, &fakehw.Durations{ByKind: map[string]time.Duration{commandKind: 0}})
		f.waitAdopted(b)
		nodes := f.nodeIDs(b)
		hc := f.apiHTTPClient(8)
		commands := f.commandClient(hc)
		log := &commandLog{runs: map[string]*commandRun{}}
		after, err := store.MaxEventID(ctx, db.Pool, store.AllTenants)
		require.NoError(b, err)
		watchCtx, stopWatch := context.WithCancel(ctx)
		watchDone := f.watchEvents(watchCtx, hc, []string{store.EventCommandSucceeded, store.EventCommandFailed,
			store.EventCommandExpired}, after, log.event)

		// Commands at a steady rate until stop, each in a goroutine of its
		// own so that a slow one does not hold the next back.
		var ids []string
		idc := make(chan string, 1024)
		errc := make(chan error, 1)
		stop := make(chan struct{})
		runDone := make(chan struct{})
		go func() {
			defer close(runDone)
			tick := clk.NewTicker(time.Second / time.Duration(rate))
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-tick.C():
				}
				node := nodes[(i*7)%len(nodes)]
				go func() {
					called := clk.Now()
					res, err := commands.RunCommand(ctx, connect.NewRequest(&computev1.RunCommandRequest{NodeId: node,
						Kind: commandKind, Timeout: durationpb.New(5 * time.Minute)}))
					if err != nil {
						select {
						case errc <- err:
						default:
						}
						return
					}
					id := res.Msg.GetCommand().GetId()
					log.called(id, called, clk.Now())
					idc <- id
				}()
			}
		}()
		collected := make(chan []string)
		go func() {
			var all []string
			for id := range idc {
				all = append(all, id)
			}
			collected <- all
		}()
		// Before the pass: a baseline of the same commands.
		baselineFrom := clk.Now()
		require.NoError(b, clock.Sleep(ctx, clk, 20*time.Second))
		passFrom := clk.Now()
		// Events kept 10 days: the seeded ones (20 days old) are due; the
		// stack's own controllers keep them 30 days, so this pass alone
		// deletes them.
		r := &controllers.Retention{DB: db, Clock: clk, Config: controllers.RetentionConfig{RetentionEvents: 10 * 24 * time.Hour,
			RetentionBatch: batch, RetentionPause: pause}}
		pass, err := r.Reconcile(ctx)
		require.NoError(b, err)
		passTime := clock.Since(clk, passFrom)
		close(stop)
		<-runDone
		// Let the last calls return, then the channel closes.
		require.NoError(b, clock.Sleep(ctx, clk, 2*time.Second))
		close(idc)
		ids = <-collected
		select {
		case err := <-errc:
			require.NoError(b, err, "RunCommand")
		default:
		}
		log.waitEnded(b, ids, 5*time.Minute)
		stopWatch()
		require.NoError(b, <-watchDone)

		var before, during []string
		log.mu.Lock()
		for _, id := range ids {
			switch called := log.runs[id].called; {
			case !called.Before(passFrom) && called.Before(passFrom.Add(passTime)):
				during = append(during, id)
			case !called.Before(baselineFrom) && called.Before(passFrom):
				before = append(before, id)
			}
		}
		log.mu.Unlock()
		require.Equal(b, events, pass.Events, "every seeded event is past its retention")
		sb, sd := log.stats(before), log.stats(during)
		require.Zero(b, sb.failed+sd.failed, "commands that did not succeed")
		rb, rd := percentiles(sb.roundTrip, 0.5, 0.99), percentiles(sd.roundTrip, 0.5, 0.99)
		rows := float64(pass.Total()) / passTime.Seconds()
		b.ReportMetric(passTime.Seconds(), "pass-s")
		b.ReportMetric(rows, "rows/s")
		b.ReportMetric(ms(rd[1]), "rt-p99-during-ms")
		fmt.Printf("retention: %d events seeded in %s (one INSERT … SELECT generate_series, then VACUUM (PARALLEL 0, ANALYZE))\n",
			events, seedTime.Round(time.Second))
		fmt.Printf("retention pass: %d rows in %s (%d statements of at most %d rows, %s pause) = %.0f rows/s\n",
			pass.Total(), passTime.Round(time.Millisecond), pass.Batches, batch, pause, rows)
		fmt.Printf("command round trip at %d/s on %d machines: during the pass (%d commands) p50 %s, p99 %s (target p99 < 100ms); "+
			"before it (%d commands) p50 %s, p99 %s\n", rate, f.n, len(during), rd[0].Round(time.Millisecond),
			rd[1].Round(time.Millisecond), len(before), rb[0].Round(time.Millisecond), rb[1].Round(time.Millisecond))
	}
}
