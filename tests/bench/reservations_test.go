package bench

import (
	"fmt"
	"net/http"
	"os"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/iam"
)

// BenchmarkReservations runs every service as a process of its own
// (bin/linux) with BETTER_COMPUTE_BENCH_MACHINES (default 1,000) simulated
// H100 machines × 8 GPUs (a fakedaemon process), and reserves through the
// public API (ReservationService.Reserve) as reservationTenants tenants,
// each with its own tenant-member token and an offer of the pool. It prints:
//
//   - placement throughput: 2 × machines reservations of 2 GPUs are made
//     while the scheduler process, started and holding its lease, is
//     stopped (SIGSTOP), then it is continued; the rate is reservations
//     placed per second from then to the last placement (placed_at), with
//     the CPU time per placement of each process group over that phase.
//     Target ≥ 3,000/s.
//   - Reserve → active: machines reservations of 1–4 GPUs are made by
//     reservationCallers callers at 200/s while the scheduler runs; the
//     latency is active_at − created_at (the daemons bind them through the
//     gateway), and created → placed apart (placed_at − created_at).
//     Targets: active p99 < 150 ms, placed p50 ≤ 20 ms.
func BenchmarkReservations(b *testing.B) {
	for range b.N {
		f := startFleet(b, fleetOptions{processes: true, noScheduler: true})
		n, clk, ctx := f.n, f.clk, b.Context()
		f.startMachinesProcess(b, "", 0)
		f.waitAdopted(b)
		db := f.db
		count := func(sql string, args ...any) int {
			var c int
			require.NoError(b, db.Pool.QueryRow(ctx, sql, args...).Scan(&c))
			return c
		}
		clients := f.tenantReservationClients(b, reservationTenants, int32(8*n))
		// reserve makes the i-th reservation of phase (its request id, which
		// makes Reserve idempotent, is unique).
		reserve := func(phase, i int, gpus int32) error {
			_, err := clients[i%len(clients)].Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: f.poolID,
				Gpus: gpus, Duration: durationpb.New(time.Hour), RequestId: fmt.Sprintf("bench-%d-%d", phase, i)}))
			return err
		}

		// Phase 1: placement throughput, the scheduler alone. It runs (and
		// holds its lease) but is stopped (SIGSTOP) while the backlog is made,
		// so that it starts on the whole backlog at once when continued,
		// without its process start in the figure.
		f.startScheduler(b)
		sched := f.services[svcScheduler].proc
		f.allocsBase(b, svcScheduler)
		sched.Pause(b)
		backlog := 2 * n
		require.NoError(b, parallel(backlog, reservationCallers, func(i int) error { return reserve(1, i, 2) }))
		waitProfiles := f.profile(b, "", backlog/500+1, svcScheduler)
		cpu0 := f.cpu(b)
		start := clk.Now()
		sched.Resume(b)
		eventually(b, 5*time.Minute, 50*time.Millisecond, func() (bool, string) {
			placed := count(`SELECT count(*) FROM reservations WHERE placed_at IS NOT NULL`)
			return placed >= backlog, fmt.Sprintf("placed %d of %d", placed, backlog)
		})
		cpu1 := f.cpu(b)
		waitProfiles()
		var last time.Time
		require.NoError(b, db.Pool.QueryRow(ctx, `SELECT max(placed_at) FROM reservations`).Scan(&last))
		placeWall := last.Sub(start)
		placeRate := float64(backlog) / placeWall.Seconds()
		placeCPU := cpu1.sub(cpu0)

		// Phase 2: Reserve → active at a steady rate.
		require.Eventually(b, func() bool {
			return count(`SELECT count(*) FROM reservations WHERE state = 'active'`) == backlog
		}, 5*time.Minute, 50*time.Millisecond, "the backlog turns active")
		tick := clk.NewTicker(5 * time.Millisecond) // 200/s
		phase2 := n
		cpu2 := f.cpu(b)
		// The phase lasts phase2/200 s, and its tail until all are active.
		waitSteady := f.profile(b, "steady", phase2/200+2)
		require.NoError(b, parallel(phase2, reservationCallers, func(i int) error {
			<-tick.C()
			return reserve(2, i, int32(1+i%4))
		}))
		tick.Stop()
		eventually(b, 5*time.Minute, 50*time.Millisecond, func() (bool, string) {
			active := count(`SELECT count(*) FROM reservations WHERE state = 'active'`)
			return active == backlog+phase2, fmt.Sprintf("active %d of %d", active, backlog+phase2)
		})
		steadyCPU := f.cpu(b).sub(cpu2)
		waitSteady()

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
		var placeP50, placeP99, bindP50 float64
		require.NoError(b, db.Pool.QueryRow(ctx, `SELECT
				percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM placed_at - created_at)),
				percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM placed_at - created_at)),
				percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM active_at - placed_at))
			FROM (SELECT * FROM reservations ORDER BY created_at DESC LIMIT $1) r`, phase2).Scan(&placeP50, &placeP99, &bindP50))
		var overlaps int
		require.NoError(b, db.Pool.QueryRow(ctx, `SELECT count(*) FROM bookings x JOIN bookings y ON x.node_id = y.node_id
			AND x.device_index = y.device_index AND x.reservation_id < y.reservation_id AND x.during && y.during`).Scan(&overlaps))
		require.Zero(b, overlaps)

		record(b, figPlacements, placeRate)
		record(b, figCPUPerPlace, ms(placeCPU.controlPlane()/time.Duration(backlog)))
		record(b, figCreatedPlaced, placeP50*1000)
		record(b, figActiveP50, ms(p(0.5)))
		record(b, figActiveP99, ms(p(0.99)))
		fmt.Fprintf(os.Stdout, "placement: %d reservations on %d machines in %s: %.0f placed/s (target ≥ 3000)\n",
			backlog, n, placeWall.Round(time.Millisecond), placeRate)
		fmt.Fprintf(os.Stdout, "  CPU per placement (scheduler continued → all placed): %s\n",
			placeCPU.perOp(backlog))
		fmt.Fprintf(os.Stdout, "reserve→active: %d reservations at 200/s through the API as %d tenants: p50 %s, p99 %s "+
			"(target p99 < 150ms)\n", phase2, reservationTenants, p(0.5).Round(time.Millisecond), p(0.99).Round(time.Millisecond))
		fmt.Fprintf(os.Stdout, "  created→placed p50 %s, p99 %s (target p50 ≤ 20ms); placed→active p50 %s\n",
			secs(placeP50), secs(placeP99), secs(bindP50))
		fmt.Fprintf(os.Stdout, "  CPU per reservation at 200/s (Reserve → active): %s\n", steadyCPU.perOp(phase2))
	}
}

// reservationTenants is how many tenants reserve; reservationCallers how
// many calls are in flight at once.
const (
	reservationTenants = 32
	reservationCallers = 32
)

// tenantReservationClients creates count tenants through the public API
// as the root administrator (TenantService.CreateTenant), offers each the
// fleet's pool with quota GPUs (PoolService.OfferPool), mints each a
// tenant-member token (TokenService.CreateToken) and returns a
// ReservationService client per tenant with its token.
func (f *fleet) tenantReservationClients(b *testing.B, count int, quota int32) []computev1connect.ReservationServiceClient {
	b.Helper()
	ctx, root := b.Context(), f.apiHTTPClient(4)
	base := f.apiURL + "/api/compute"
	tenants := computev1connect.NewTenantServiceClient(root, base)
	pools := computev1connect.NewPoolServiceClient(root, base)
	tokens := computev1connect.NewTokenServiceClient(root, base)
	out := make([]computev1connect.ReservationServiceClient, count)
	for i := range out {
		t, err := tenants.CreateTenant(ctx, connect.NewRequest(&computev1.CreateTenantRequest{Name: fmt.Sprintf("bench-%d", i)}))
		require.NoError(b, err)
		id := t.Msg.GetTenant().GetId()
		_, err = pools.OfferPool(ctx, connect.NewRequest(&computev1.OfferPoolRequest{PoolId: f.poolID, TenantId: id, GpuQuota: quota}))
		require.NoError(b, err)
		tok, err := tokens.CreateToken(ctx, connect.NewRequest(&computev1.CreateTokenRequest{TenantId: id, Name: "bench",
			Role: string(iam.RoleTenantMember)}))
		require.NoError(b, err)
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConnsPerHost = reservationCallers
		out[i] = computev1connect.NewReservationServiceClient(&http.Client{Transport: bearer{token: tok.Msg.GetSecret(), next: tr}}, base)
	}
	return out
}
