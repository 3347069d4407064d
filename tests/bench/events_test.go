package bench

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/store"
)

// BenchmarkEventsWatch writes BETTER_COMPUTE_BENCH_EVENTS (100,000) events
// straight into the store (store.WriteEvents, node.cordoned ones, in
// transactions of BETTER_COMPUTE_BENCH_EVENT_BATCH (50) events from
// BETTER_COMPUTE_BENCH_EVENT_PRODUCERS (4) concurrent writers, as fast as
// they commit) while one root-admin watcher reads every event through
// EventService.Watch, and prints the events per second delivered end to end
// (first write to last event received), the writers' own rate and the
// committed → received latency p50/p99. No machine runs: the events are all
// that happens.
func BenchmarkEventsWatch(b *testing.B) {
	total := envInt("BETTER_COMPUTE_BENCH_EVENTS", 100_000)
	batch := envInt("BETTER_COMPUTE_BENCH_EVENT_BATCH", 50)
	producers := envInt("BETTER_COMPUTE_BENCH_EVENT_PRODUCERS", 4)
	total -= total % batch
	for range b.N {
		f := startFleet(b, fleetOptions{noScheduler: true})
		clk, ctx, db := f.clk, b.Context(), f.db
		committed := make([]time.Time, total)
		received := make([]time.Time, total)
		var (
			mu    sync.Mutex
			count int
			bad   []string
		)
		// A marker event first: the watch starts after it, so that it sees
		// every event of the benchmark however late its stream opens
		// (after_id 0 would mean "from when the watch starts").
		require.NoError(b, db.InTx(ctx, func(tx pgx.Tx) error {
			return store.WriteEvents(ctx, tx, db.Now(), store.NewEvent{TenantID: f.tenantID,
				Data: store.NodeCordonedData{NodeID: "mark", Reason: "benchmark"}})
		}))
		after, err := store.MaxEventID(ctx, db.Pool, store.AllTenants)
		require.NoError(b, err)
		watchCtx, stopWatch := context.WithCancel(ctx)
		watchDone := f.watchEvents(watchCtx, f.apiHTTPClient(1), nil, after, func(e *computev1.Event, at time.Time) {
			mu.Lock()
			defer mu.Unlock()
			i, err := strconv.Atoi(strings.TrimPrefix(e.GetSubjectId(), "bench-"))
			if err != nil || i < 0 || i >= total || !received[i].IsZero() {
				bad = append(bad, e.GetSubjectId())
				return
			}
			received[i] = at
			count++
		})

		start := clk.Now()
		require.NoError(b, parallel(total/batch, producers, func(k int) error {
			events := make([]store.NewEvent, batch)
			for j := range events {
				events[j] = store.NewEvent{TenantID: f.tenantID,
					Data: store.NodeCordonedData{NodeID: fmt.Sprintf("bench-%d", k*batch+j), Reason: "benchmark"}}
			}
			err := db.InTx(ctx, func(tx pgx.Tx) error { return store.WriteEvents(ctx, tx, db.Now(), events...) })
			at := clk.Now()
			for j := range events {
				committed[k*batch+j] = at
			}
			return err
		}))
		written := clk.Now()
		all := assert.Eventually(b, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return count == total
		}, 5*time.Minute, 10*time.Millisecond)
		mu.Lock()
		got, wrong := count, len(bad)
		mu.Unlock()
		require.True(b, all, "events received: %d of %d (and %d not written by the benchmark or twice)", got, total, wrong)
		stopWatch()
		require.NoError(b, <-watchDone)
		require.Empty(b, bad, "events received twice or not written by the benchmark")

		var last time.Time
		lat := make([]time.Duration, total)
		for i := range total {
			if received[i].After(last) {
				last = received[i]
			}
			lat[i] = received[i].Sub(committed[i])
		}
		rate := float64(total) / last.Sub(start).Seconds()
		writeRate := float64(total) / written.Sub(start).Seconds()
		p := percentiles(lat, 0.5, 0.99)
		b.ReportMetric(rate, "events/s")
		b.ReportMetric(ms(p[0]), "p50-ms")
		b.ReportMetric(ms(p[1]), "p99-ms")
		fmt.Printf("events watch: %d events (%d writers, %d per transaction) to one watcher: %.0f events/s delivered "+
			"end to end (written at %.0f/s); committed → received p50 %s, p99 %s\n",
			total, producers, batch, rate, writeRate, p[0].Round(time.Millisecond), p[1].Round(time.Millisecond))
	}
}
