package scheduler_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

// statementCounter counts the spans otelpgx makes below a recording span:
// one per round trip (a statement, begin and commit included, or a
// pgx.Batch), by the statement's first word.
type statementCounter struct {
	mu     sync.Mutex
	byVerb map[string]int
	total  int
	// batches are the spans of the batches: their statements' spans are
	// their children.
	batches map[trace.SpanID]bool
	// took sums the round trips' durations by their first 90 characters.
	took map[string]time.Duration
}

func (c *statementCounter) OnStart(_ context.Context, s sdktrace.ReadWriteSpan) {
	if s.Name() == "batch start" {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.batches == nil {
			c.batches = map[trace.SpanID]bool{}
		}
		c.batches[s.SpanContext().SpanID()] = true
	}
}
func (c *statementCounter) OnEnd(s sdktrace.ReadOnlySpan) {
	name := s.Name()
	// Prepares named "prepare …" are not counted; a
	// batch counts once (its "batch start" span), as the round trip it is.
	if name == "pass" || strings.HasPrefix(name, "pool.") || name == "connect" || strings.HasPrefix(name, "prepare") ||
		strings.HasPrefix(name, "batch query") || strings.HasPrefix(name, "batch end") || strings.HasPrefix(name, "batch close") {
		return
	}
	key := name
	for _, a := range s.Attributes() {
		if a.Key == "db.query.text" || a.Key == "db.statement" {
			key = a.Value.AsString()
		}
	}
	// pgx's reads of the catalog (the types of a new connection) are not
	// the pass's.
	if strings.Contains(key, "pg_type") || strings.Contains(key, "pg_catalog") {
		return
	}
	verb, _, _ := strings.Cut(strings.TrimSpace(name), " ")
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.batches[s.Parent().SpanID()] {
		return
	}
	if c.byVerb == nil {
		c.byVerb = map[string]int{}
	}
	c.byVerb[strings.ToLower(verb)]++
	c.total++
	if c.took == nil {
		c.took = map[string]time.Duration{}
	}
	key = strings.Join(strings.Fields(key), " ")
	c.took[key[:min(len(key), 90)]] += s.EndTime().Sub(s.StartTime())
}
func (c *statementCounter) Shutdown(context.Context) error   { return nil }
func (c *statementCounter) ForceFlush(context.Context) error { return nil }

func (c *statementCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.byVerb, c.total, c.took = nil, 0, nil
}

func (c *statementCounter) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	verbs := make([]string, 0, len(c.byVerb))
	for v := range c.byVerb {
		verbs = append(verbs, v)
	}
	sort.Strings(verbs)
	var b strings.Builder
	for _, v := range verbs {
		fmt.Fprintf(&b, " %s=%d", v, c.byVerb[v])
	}
	return b.String()
}

// BenchmarkPass is one scheduling pass placing 2 × nodes pending
// reservations of 2 GPUs on nodes (1,000) of 8 GPUs, as the placement row of
// docs/benchmarks.md does, against a real Postgres. It reports the
// statements (round trips) the pass ran, per pass and per reservation
// placed.
func BenchmarkPass(b *testing.B) { benchmarkPass(b, 0, 2*benchNodes) }

// BenchmarkPassFew is one scheduling pass placing 4 reservations of 2 GPUs
// among the 2 × nodes already placed (1,000 nodes of 8 GPUs): the pass each
// Reserve of a steady stream wakes, as the Reserve → active row of
// docs/benchmarks.md runs them.
func BenchmarkPassFew(b *testing.B) { benchmarkPass(b, 2*benchNodes, 4) }

// benchNodes is how many nodes of 8 GPUs the pass benchmarks place on.
const benchNodes = 1000

// benchmarkPass places placed reservations of 2 GPUs (not measured), then
// measures the pass that places the next fresh ones.
func benchmarkPass(b *testing.B, placed, fresh int) {
	const nodes = benchNodes
	counter := &statementCounter{}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(counter))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	b.Cleanup(func() { otel.SetTracerProvider(prev) })
	db := storetest.New(b, nil)
	nc := startNATS(b)
	ctx := b.Context()
	gpus := make([]int, nodes)
	for i := range gpus {
		gpus[i] = 8
	}
	f := storetest.NewFleet(b, db, "bench", gpus...)
	tenant := f.Tenant(b, "bench-tenant", 8*nodes)
	s, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: "bench"}},
		scheduler.Deps{DB: db, NC: nc})
	require.NoError(b, err)
	insertPending := func(n int) {
		now := db.Now()
		resIDs := make([]string, n)
		for i := range resIDs {
			resIDs[i] = ids.New(ids.Reservation, now)
		}
		_, err := db.Pool.Exec(ctx, `INSERT INTO reservations (id, tenant_id, pool_id, gpus, start_at, end_at, state, reason,
				binding, created_at, updated_at)
			SELECT u.id, $2, $3, 2, $4::timestamptz, $5, 'pending', '', '{}', $4::timestamptz + (u.n * interval '1 microsecond'), $4::timestamptz
			FROM unnest($1::text[]) WITH ORDINALITY AS u(id, n)`, resIDs, tenant, f.PoolID, now, now.Add(time.Hour))
		require.NoError(b, err)
	}
	// fewest is the fewest round trips of a pass: a pass on connections new
	// to a statement counts its prepares too (otelpgx names them as the
	// statement).
	var statements, total, fewest int
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		_, err := db.Pool.Exec(ctx, `DELETE FROM bookings`)
		require.NoError(b, err)
		_, err = db.Pool.Exec(ctx, `DELETE FROM reservations`)
		require.NoError(b, err)
		if placed > 0 {
			insertPending(placed)
			res, err := s.Schedule(ctx)
			require.NoError(b, err)
			require.Equal(b, placed, res.Placed)
		}
		insertPending(fresh)
		counter.reset()
		tctx, span := tp.Tracer("bench").Start(ctx, "pass")
		b.StartTimer()
		res, err := s.Schedule(tctx)
		b.StopTimer()
		span.End()
		require.NoError(b, err)
		require.Equal(b, fresh, res.Placed)
		statements += counter.total
		if fewest == 0 || counter.total < fewest {
			fewest = counter.total
		}
		total += res.Placed
		for k, d := range counter.took {
			if d > 10*time.Millisecond {
				b.Logf("  %8s %s", d.Round(time.Millisecond), k)
			}
		}
		b.Logf("pass: placed %d, conflicts %d, round trips %d:%s; timings %+v", res.Placed, res.Conflicts, counter.total,
			counter.String(), res.Timings)
		b.StartTimer()
	}
	b.ReportMetric(float64(statements)/float64(b.N), "roundtrips/pass")
	b.ReportMetric(float64(fewest), "fewest-roundtrips/pass")
	b.ReportMetric(float64(total)/float64(b.N), "placed/pass")
	b.ReportMetric(float64(statements)/float64(total), "roundtrips/placed")
}
