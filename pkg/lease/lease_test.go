package lease_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/lease"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
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

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

func setup(t *testing.T) (*store.DB, *clock.Fake) {
	t.Helper()
	clk := clock.NewFake(t0)
	return storetest.New(t, clk), clk
}

func holderOf(t *testing.T, db *store.DB, name string) string {
	t.Helper()
	l, err := store.GetLease(t.Context(), db.Pool, name)
	if errors.Is(err, store.ErrNotFound) {
		return ""
	}
	require.NoError(t, err)
	return l.Holder
}

// TestTwoHoldersRace races holders for free leases: exactly one wins each.
func TestTwoHoldersRace(t *testing.T) {
	t.Parallel()
	db, _ := setup(t)
	for round := range 20 {
		name := fmt.Sprintf("race-%d", round)
		var wins atomic.Int32
		var winner atomic.Value
		var wg sync.WaitGroup
		start := make(chan struct{})
		for h := range 4 {
			l := &lease.Lease{DB: db, Name: name, Holder: fmt.Sprintf("h%d", h), TTL: 10 * time.Second}
			wg.Go(func() {
				<-start
				ok, err := l.TryAcquire(t.Context())
				if err != nil {
					t.Error(err)
					return
				}
				if ok {
					wins.Add(1)
					winner.Store(l.Holder)
				}
			})
		}
		close(start)
		wg.Wait()
		require.EqualValues(t, 1, wins.Load(), "round %d", round)
		require.Equal(t, winner.Load(), holderOf(t, db, name))
	}
}

// TestExpiryTakeover: a lease that is not renewed passes to another holder
// exactly when it expires, and the old holder cannot renew it then.
func TestExpiryTakeover(t *testing.T) {
	t.Parallel()
	db, clk := setup(t)
	ctx := t.Context()
	a := &lease.Lease{DB: db, Name: "role", Holder: "a", TTL: 10 * time.Second}
	b := &lease.Lease{DB: db, Name: "role", Holder: "b", TTL: 10 * time.Second}

	ok, err := a.TryAcquire(ctx)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = b.TryAcquire(ctx)
	require.NoError(t, err)
	require.False(t, ok, "b took a live lease")

	clk.Advance(5 * time.Second)
	ok, err = a.TryAcquire(ctx) // renew until t0+15s
	require.NoError(t, err)
	require.True(t, ok)
	row, err := store.GetLease(ctx, db.Pool, "role")
	require.NoError(t, err)
	require.True(t, row.AcquiredAt.Equal(t0), "renewal changed acquired_at to %s", row.AcquiredAt)
	require.True(t, row.ExpiresAt.Equal(t0.Add(15*time.Second)))

	clk.Advance(10*time.Second - time.Microsecond)
	ok, err = b.TryAcquire(ctx)
	require.NoError(t, err)
	require.False(t, ok, "b took the lease before it expired")

	clk.Advance(time.Microsecond)
	ok, err = b.TryAcquire(ctx)
	require.NoError(t, err)
	require.True(t, ok, "b could not take an expired lease")
	require.Equal(t, "b", holderOf(t, db, "role"))
	row, err = store.GetLease(ctx, db.Pool, "role")
	require.NoError(t, err)
	require.True(t, row.AcquiredAt.Equal(clk.Now()))

	ok, err = a.TryAcquire(ctx)
	require.NoError(t, err)
	require.False(t, ok, "a renewed a lease b had taken")

	// Release only releases one's own lease.
	require.NoError(t, a.Release(ctx))
	require.Equal(t, "b", holderOf(t, db, "role"))
	require.NoError(t, b.Release(ctx))
	require.Equal(t, "", holderOf(t, db, "role"))
	ok, err = a.TryAcquire(ctx)
	require.NoError(t, err)
	require.True(t, ok)
}

// TestRunReleasesOnCancel: Run starts fn once it holds the lease, renews it
// and, on cancel, stops fn before releasing the lease.
func TestRunReleasesOnCancel(t *testing.T) {
	t.Parallel()
	db, clk := setup(t)
	l := &lease.Lease{DB: db, Name: "role", Holder: "a", TTL: 3 * time.Second}
	ctx, cancel := context.WithCancel(t.Context())
	started := make(chan struct{})
	var stillHeldAtStop atomic.Bool
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, func(fctx context.Context) error {
			close(started)
			<-fctx.Done()
			// The lease is released only after fn returned.
			stillHeldAtStop.Store(holderOf(t, db, "role") == "a")
			return nil
		})
	}()
	<-started
	require.True(t, l.Held())
	require.Equal(t, "a", holderOf(t, db, "role"))

	// Renewals keep it alive past the first TTL. Time moves a second per
	// poll, so the renew ticker fires however late its goroutine starts.
	require.Eventually(t, func() bool {
		clk.Advance(time.Second)
		row, err := store.GetLease(t.Context(), db.Pool, "role")
		return err == nil && row.ExpiresAt.After(t0.Add(3*time.Second))
	}, 10*time.Second, 10*time.Millisecond, "lease not renewed")

	cancel()
	require.NoError(t, <-errc)
	require.True(t, stillHeldAtStop.Load(), "lease released before fn stopped")
	require.Equal(t, "", holderOf(t, db, "role"))
	require.False(t, l.Held())
}

// TestRunStopsFnWhenLost: when another holder has the lease at renewal time,
// fn's context ends and Run waits to acquire again.
func TestRunStopsFnWhenLost(t *testing.T) {
	t.Parallel()
	db, clk := setup(t)
	l := &lease.Lease{DB: db, Name: "role", Holder: "a", TTL: 3 * time.Second}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var runs atomic.Int32
	var stopped atomic.Int32
	errc := make(chan error, 1)
	go func() {
		errc <- l.Run(ctx, func(fctx context.Context) error {
			runs.Add(1)
			<-fctx.Done()
			stopped.Add(1)
			return fctx.Err()
		})
	}()
	require.Eventually(t, func() bool { return runs.Load() == 1 }, 10*time.Second, 5*time.Millisecond)

	// Another holder steals it (as if a's renewals had stalled past expiry).
	// Raw SQL: store.TryAcquireLease never takes a lease that has not
	// expired.
	_, err := db.Pool.Exec(t.Context(), `UPDATE leases SET holder = 'thief', expires_at = $1 WHERE name = 'role'`,
		t0.Add(time.Hour))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		clk.Advance(time.Second)
		return stopped.Load() == 1
	}, 10*time.Second, 10*time.Millisecond, "fn kept running after the lease was lost")
	require.False(t, l.Held())
	require.Equal(t, "thief", holderOf(t, db, "role"), "a released or took the thief's lease")

	// When the thief's lease expires, a takes it again and runs fn again.
	clk.Set(t0.Add(time.Hour))
	require.Eventually(t, func() bool {
		clk.Advance(time.Second)
		return runs.Load() == 2
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, "a", holderOf(t, db, "role"))
	cancel()
	require.NoError(t, <-errc)
	require.Equal(t, "", holderOf(t, db, "role"))
}

// TestRunWaitsForHolder: Run does not start fn while another holder has the
// lease, and starts it soon after that holder releases it.
func TestRunWaitsForHolder(t *testing.T) {
	t.Parallel()
	db, clk := setup(t)
	b := &lease.Lease{DB: db, Name: "role", Holder: "b", TTL: 3 * time.Second}
	ok, err := b.TryAcquire(t.Context())
	require.NoError(t, err)
	require.True(t, ok)

	a := &lease.Lease{DB: db, Name: "role", Holder: "a", TTL: 3 * time.Second}
	ctx, cancel := context.WithCancel(t.Context())
	var running atomic.Bool
	errc := make(chan error, 1)
	go func() {
		errc <- a.Run(ctx, func(fctx context.Context) error {
			running.Store(true)
			<-fctx.Done()
			return nil
		})
	}()
	for range 2 {
		clk.Advance(time.Second) // still before b's expiry at t0+3s
	}
	require.False(t, running.Load(), "fn ran while b held the lease")
	require.NoError(t, b.Release(t.Context()))
	require.Eventually(t, func() bool {
		clk.Advance(100 * time.Millisecond)
		return running.Load()
	}, 10*time.Second, 10*time.Millisecond)
	cancel()
	require.NoError(t, <-errc)
}

// TestRunReturnsFnError: fn failing by itself ends Run with its error and
// releases the lease.
func TestRunReturnsFnError(t *testing.T) {
	t.Parallel()
	db, _ := setup(t)
	l := &lease.Lease{DB: db, Name: "role", Holder: "a"}
	boom := errors.New("boom")
	err := l.Run(t.Context(), func(context.Context) error { return boom })
	require.ErrorIs(t, err, boom)
	require.Equal(t, "", holderOf(t, db, "role"))
}
