package bench

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// BenchmarkReservations runs the real services in process (one gateway) with
// BETTER_COMPUTE_BENCH_MACHINES (default 1,000) simulated H100 machines
// × 8 GPUs and prints:
//
//   - placement throughput: 2 × machines reservations of 2 GPUs are created
//     pending with no scheduler running, then one scheduler starts; the rate
//     is reservations placed (binding) per second from its start until the
//     last is placed. Target ≥ 2,000/s.
//   - Reserve → active: machines reservations of 1–4 GPUs are made by 16
//     clients at 200/s while the scheduler runs; the latency is active_at −
//     created_at (the daemons bind them through the gateway). Target p99 <
//     250 ms.
func BenchmarkReservations(b *testing.B) {
	for range b.N {
		f := startFleet(b, fleetOptions{noScheduler: true})
		n, clk, ctx, natsURL := f.n, f.clk, b.Context(), f.natsURL
		f.startMachines(b, nil)
		f.waitAdopted(b)
		db := f.db
		count := func(sql string, args ...any) int {
			var c int
			require.NoError(b, db.Pool.QueryRow(ctx, sql, args...).Scan(&c))
			return c
		}

		// Tenants with offers; reservations of one tenant in one pool are
		// serialised by the offer's lock, so spread them.
		const tenants = 32
		tenantIDs := make([]string, tenants)
		for i := range tenantIDs {
			tenantIDs[i] = storetest.Tenant(b, db, &storetest.TenantOpts{Name: fmt.Sprintf("bench-%d", i)}).ID
			storetest.Offer(b, db, &storetest.OfferOpts{PoolID: f.poolID, TenantID: tenantIDs[i], GPUQuota: int32(8 * n)})
		}
		reserve := func(i int, gpus int32) {
			require.NoError(b, db.InTx(ctx, func(tx pgx.Tx) error {
				now := db.Now()
				_, err := store.CreateReservation(ctx, tx, now, store.NewReservation{ID: ids.New(ids.Reservation, now),
					TenantID: tenantIDs[i%tenants], PoolID: f.poolID, GPUs: gpus, StartAt: now, EndAt: now.Add(time.Hour)})
				return err
			}))
		}
		parallel := func(total, workers int, each func(i int)) {
			var wg sync.WaitGroup
			next := make(chan int)
			for range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range next {
						each(i)
					}
				}()
			}
			for i := range total {
				next <- i
			}
			close(next)
			wg.Wait()
		}

		// Phase 1: placement throughput.
		backlog := 2 * n
		parallel(backlog, 16, func(i int) { reserve(i, 2) })
		nc, err := nats.Connect(natsURL)
		require.NoError(b, err)
		b.Cleanup(nc.Close)
		sched, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: "bench"}, Interval: 200 * time.Millisecond},
			scheduler.Deps{DB: db, NC: nc, Logger: benchLogger()})
		require.NoError(b, err)
		schedCtx, stopSched := context.WithCancel(ctx)
		schedDone := make(chan error, 1)
		start := clk.Now()
		go func() { schedDone <- sched.Run(schedCtx) }()
		require.Eventually(b, func() bool { return sched.Placed() >= int64(backlog) }, 5*time.Minute, 2*time.Millisecond)
		placeWall := clk.Now().Sub(start)
		placeRate := float64(backlog) / placeWall.Seconds()

		// Phase 2: Reserve → active at a steady rate.
		require.Eventually(b, func() bool {
			return count(`SELECT count(*) FROM reservations WHERE state = 'active'`) == backlog
		}, 5*time.Minute, 50*time.Millisecond, "the backlog turns active")
		tick := clk.NewTicker(5 * time.Millisecond) // 200/s
		phase2 := n
		parallel(phase2, 16, func(i int) {
			<-tick.C()
			reserve(i, int32(1+i%4))
		})
		tick.Stop()
		var active int
		require.Eventually(b, func() bool {
			active = count(`SELECT count(*) FROM reservations WHERE state = 'active'`)
			return active == backlog+phase2
		}, 5*time.Minute, 50*time.Millisecond, "active %d of %d", &active, backlog+phase2)
		stopSched()
		require.NoError(b, <-schedDone)

		rows, err := db.Pool.Query(ctx, `SELECT extract(epoch FROM active_at - created_at) FROM reservations
			ORDER BY created_at DESC LIMIT $1`, phase2)
		require.NoError(b, err)
		lat, err := pgx.CollectRows(rows, pgx.RowTo[float64])
		require.NoError(b, err)
		slices.Sort(lat)
		p := func(q float64) time.Duration {
			return time.Duration(lat[int(q*float64(len(lat)-1))] * float64(time.Second))
		}
		// Where the time goes: created → placed (scheduler) and placed →
		// active (spec delivery, daemon, AllocationBound).
		var placeP50, bindP50 float64
		require.NoError(b, db.Pool.QueryRow(ctx, `SELECT
				percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM placed_at - created_at)),
				percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM active_at - placed_at))
			FROM (SELECT * FROM reservations ORDER BY created_at DESC LIMIT $1) r`, phase2).Scan(&placeP50, &bindP50))
		var overlaps int
		require.NoError(b, db.Pool.QueryRow(ctx, `SELECT count(*) FROM bookings x JOIN bookings y ON x.node_id = y.node_id
			AND x.device_index = y.device_index AND x.reservation_id < y.reservation_id AND x.during && y.during`).Scan(&overlaps))
		require.Zero(b, overlaps)

		b.ReportMetric(placeRate, "placed/s")
		b.ReportMetric(float64(p(0.5).Milliseconds()), "active-p50-ms")
		b.ReportMetric(float64(p(0.99).Milliseconds()), "active-p99-ms")
		fmt.Fprintf(os.Stdout, "placement: %d reservations on %d machines in %s: %.0f placed/s (target ≥ 2000)\n",
			backlog, n, placeWall.Round(time.Millisecond), placeRate)
		fmt.Fprintf(os.Stdout, "reserve→active: %d reservations at 200/s: p50 %s, p99 %s (target p99 < 250ms)\n",
			phase2, p(0.5).Round(time.Millisecond), p(0.99).Round(time.Millisecond))
		fmt.Fprintf(os.Stdout, "  median created→placed %.0fms, placed→active %.0fms\n", placeP50*1000, bindP50*1000)
	}
}
