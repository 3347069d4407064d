package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/bus/bustest"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/services/scheduler/scheduler"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func startNATS(t testing.TB) *nats.Conn {
	t.Helper()
	s, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(s.Shutdown)
	nc, err := nats.Connect(s.ClientURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// holder returns who holds the scheduler lease, "" when nobody does.
func holder(db *store.DB) string {
	l, err := store.GetLease(context.Background(), db.Pool, scheduler.LeaseName)
	if errors.Is(err, store.ErrNotFound) {
		return ""
	}
	if err != nil {
		return "error: " + err.Error()
	}
	return l.Holder
}

type replica struct {
	srv    *scheduler.Server
	cancel context.CancelFunc
	errc   chan error
}

func startReplica(t *testing.T, db *store.DB, nc *nats.Conn, clk clock.Clock, name string) *replica {
	t.Helper()
	srv, err := scheduler.New(scheduler.Config{Probes: service.Probes{NoHealthServer: true}, Leases: service.Leases{Holder: name, LeaseTTL: 3 * time.Second},
		Interval: time.Hour}, scheduler.Deps{DB: db, NC: nc, Clock: clk})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	r := &replica{srv: srv, cancel: cancel, errc: make(chan error, 1)}
	go func() { r.errc <- srv.Run(ctx) }()
	t.Cleanup(cancel)
	return r
}

func (r *replica) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	require.NoError(t, <-r.errc)
}

// TestLeaseOneAtATime: of two schedulers, one holds the lease; the other
// waits, and takes over as soon as the first shuts down and releases it.
func TestLeaseOneAtATime(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.FixedZone("PST", -8*3600)))
	db := storetest.New(t, clk)
	nc := startNATS(t)

	a := startReplica(t, db, nc, clk, "a")
	require.Eventually(t, a.srv.LeaseHeld, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, "a", holder(db))
	require.Eventually(t, func() bool { return a.srv.Passes() >= 1 }, 10*time.Second, 5*time.Millisecond)

	b := startReplica(t, db, nc, clk, "b")
	// Through several renewal periods (and past the first lease's expiry),
	// a keeps renewing and b keeps waiting.
	for range 12 {
		clk.Advance(500 * time.Millisecond)
		// Let a renew for this tick (every 1 s) before moving on, so that
		// the fake clock cannot outrun its renewals.
		require.Eventually(t, func() bool {
			l, err := store.GetLease(context.Background(), db.Pool, scheduler.LeaseName)
			return err == nil && l.ExpiresAt.Sub(clk.Now()) >= 2500*time.Millisecond
		}, 10*time.Second, 2*time.Millisecond)
		require.False(t, b.srv.LeaseHeld(), "b holds the lease while a does")
		require.Equal(t, "a", holder(db))
	}
	require.Zero(t, b.srv.Passes())

	a.stop(t)
	require.False(t, a.srv.LeaseHeld())
	require.NotEqual(t, "a", holder(db), "shutdown did not release the lease")
	require.Eventually(t, func() bool {
		clk.Advance(100 * time.Millisecond)
		return b.srv.LeaseHeld()
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, "b", holder(db))
	require.Eventually(t, func() bool { return b.srv.Passes() >= 1 }, 10*time.Second, 5*time.Millisecond)

	b.stop(t)
	require.Equal(t, "", holder(db), "shutdown did not release the lease")
}

// TestWakesOnPoke: a poke on bc.poke.scheduler runs a pass (polling is
// hourly here).
func TestWakesOnPoke(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	nc := startNATS(t)
	r := startReplica(t, db, nc, nil, "a")
	require.Eventually(t, func() bool { return r.srv.Passes() >= 1 }, 10*time.Second, 5*time.Millisecond)
	before := r.srv.Passes()
	require.Eventually(t, func() bool {
		_ = nc.Publish(store.SubjectPokeScheduler, nil) // until the loop has subscribed
		return r.srv.Passes() > before
	}, 10*time.Second, 20*time.Millisecond)
	r.stop(t)
}

// TestPlacedOnCommitPoke: with a clock that never advances (no tick, no
// lease renewal) and no outbox relay, a reservation made after the
// scheduler's first pass is placed on the poke its commit publishes
// (store.DB.PokeVia), the only thing that can wake the scheduler.
func TestPlacedOnCommitPoke(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.FixedZone("PST", -8*3600)))
	db := storetest.New(t, clk)
	nc := startNATS(t)
	db.PokeVia(bus.PublishWithID(nc, store.OutboxIDHeader))
	f := storetest.NewFleet(t, db, "commitpoke", 8)
	tenant := f.Tenant(t, "commitpoke-tenant", 8)
	r := startReplica(t, db, nc, clk, "a")
	// The loop subscribes (on nc) before its first pass.
	require.Eventually(t, func() bool { return r.srv.Passes() >= 1 }, 10*time.Second, 5*time.Millisecond)
	res, err := f.Reserve(t.Context(), tenant, 2, time.Hour)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		got, err := store.GetReservation(t.Context(), db.Pool, store.AllTenants, res.ID)
		return err == nil && got.State == store.ReservationBinding
	}, 10*time.Second, 5*time.Millisecond, "placed without a tick or the relay")
	// The pass counts its placements once their transaction committed, a
	// moment after the state is visible.
	require.Eventually(t, func() bool { return r.srv.Placed() >= 1 }, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, int64(1), r.srv.Placed(), "by one pass of this replica")
	r.stop(t)
}

// TestHealthz serves /healthz on the configured listener.
func TestHealthz(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	nc := startNATS(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv, err := scheduler.New(scheduler.Config{Probes: service.Probes{HealthListener: ln}, Leases: service.Leases{Holder: "a"}}, scheduler.Deps{DB: db, NC: nc})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- srv.Run(ctx) }()
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := hc.Get("http://" + ln.Addr().String() + "/healthz")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	cancel()
	require.NoError(t, <-errc)
}
