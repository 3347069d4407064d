package store_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// TestCreateReservationQuotaUnderConcurrency races 20 one-GPU reservations
// of one tenant against a quota of 8: the offer lock serialises them, so
// exactly 8 are created and the rest refused with the numbers.
func TestCreateReservationQuotaUnderConcurrency(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	storetest.Node(t, f.db, &storetest.NodeOpts{PoolID: f.pool.ID, State: store.NodeAdopted, GPUs: 8, GPUModel: "H100"})

	create := func(gpus int32, requestID string) (store.CreatedReservation, error) {
		var c store.CreatedReservation
		err := f.db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			c, err = store.CreateReservation(ctx, tx, f.db.Now(), store.NewReservation{ID: ids.New(ids.Reservation, now),
				TenantID: f.tenant.ID, PoolID: f.pool.ID, GPUs: gpus, StartAt: now, EndAt: now.Add(time.Hour), RequestID: requestID})
			return err
		})
		return c, err
	}
	_, err := create(1, "")
	var notOffered *store.NotOfferedError
	require.ErrorAs(t, err, &notOffered)
	require.ErrorIs(t, err, store.ErrNotOffered)
	require.Equal(t, "pool "+f.pool.ID+" is not offered to tenant "+f.tenant.ID, err.Error())

	o, err := store.UpsertOffer(ctx, f.db.Pool, store.AllTenants, store.Offer{PoolID: f.pool.ID, TenantID: f.tenant.ID, GPUQuota: 8, UpdatedAt: now})
	require.NoError(t, err)
	require.EqualValues(t, 8, o.GPUQuota)
	_, err = store.UpsertOffer(ctx, f.db.Pool, store.AllTenants, store.Offer{PoolID: "pool_missing", TenantID: f.tenant.ID, GPUQuota: 8, UpdatedAt: now})
	require.ErrorIs(t, err, store.ErrNotFound)

	var (
		wg               sync.WaitGroup
		mu               sync.Mutex
		created, refused int
	)
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := create(1, "")
			mu.Lock()
			defer mu.Unlock()
			var qe *store.QuotaError
			switch {
			case err == nil:
				created++
			case errors.As(err, &qe):
				refused++
				if qe.Quota != 8 || qe.InUse != 8 || qe.Want != 1 {
					t.Errorf("quota error %+v, want quota 8, in use 8, want 1", *qe)
				}
			default:
				t.Errorf("unexpected error: %v", err)
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 8, created)
	require.Equal(t, 12, refused)
	o, err = store.GetOffer(ctx, f.db.Pool, f.pool.ID, f.tenant.ID)
	require.NoError(t, err)
	require.EqualValues(t, 8, o.GPUsInUse)

	// Ending one frees its GPUs for the next.
	rs, err := store.ListReservations(ctx, f.db.Pool, store.ReservationFilter{Scope: store.TenantScope(f.tenant.ID), State: store.ReservationPending})
	require.NoError(t, err)
	require.Len(t, rs, 8)
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.EndReservation(ctx, tx, nil, store.AllTenants, f.db.Now(), rs[0].ID, store.ReservationReleased)
		return err
	}))
	c, err := create(1, "retry-me")
	require.NoError(t, err)
	require.False(t, c.Existing)
	require.Equal(t, store.ReservationPending, c.Reservation.State)
	// A retry is answered from the first call, although the quota is full.
	again, err := create(1, "retry-me")
	require.NoError(t, err)
	require.True(t, again.Existing)
	require.Equal(t, c.Reservation.ID, again.Reservation.ID)
}

// TestCreateReservationStatements: a Reserve with a request id costs, in its
// transaction, the request's lookup, one read of the pool with the tenant's
// offer locked, the request's lookup again (under the lock), one read of the
// GPUs in use with whether a node can hold it, the insert returning the row,
// the reservation.created event and the scheduler's poke, with BEGIN and
// COMMIT and the outbox's NOTIFY: at most 10 statements. Not parallel: the
// counter sees every statement of the process.
func TestCreateReservationStatements(t *testing.T) {
	f := newFleetFixture(t)
	ctx := t.Context()
	now := f.db.Now()
	storetest.Node(t, f.db, &storetest.NodeOpts{PoolID: f.pool.ID, State: store.NodeAdopted, GPUs: 8, GPUModel: "H100"})
	_, err := store.UpsertOffer(ctx, f.db.Pool, store.AllTenants, store.Offer{PoolID: f.pool.ID, TenantID: f.tenant.ID, GPUQuota: 8, UpdatedAt: now})
	require.NoError(t, err)

	id := ids.New(ids.Reservation, now)
	stmts := storetest.CountStatements()
	var c store.CreatedReservation
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		c, err = store.CreateReservation(ctx, tx, now, store.NewReservation{ID: id, TenantID: f.tenant.ID, PoolID: f.pool.ID,
			GPUs: 2, StartAt: now, EndAt: now.Add(time.Hour), RequestID: "req-statements", CreatedBy: "tok_statements"})
		return err
	}))
	stmts.Stop()
	require.LessOrEqual(t, stmts.Count(), 10, strings.Join(stmts.SQL(), "\n---\n"))

	// What it returns is what GetReservation reads.
	got, err := store.GetReservation(ctx, f.db.Pool, store.AllTenants, id)
	require.NoError(t, err)
	require.False(t, c.Existing)
	require.Equal(t, got, c.Reservation)
	require.Equal(t, store.ReservationPending, got.State)
	require.Equal(t, "req-statements", got.RequestID)
}

// BenchmarkCreateReservation times store.CreateReservation in a transaction
// of DB.InTx, as the API's Reserve runs it (with a request id, one GPU, a
// pool of one node of 8 GPUs and a quota it never reaches), and reports the
// statements sent per reservation (BEGIN, COMMIT and the outbox's NOTIFY
// included). Every 100 reservations the pending ones are released, with the
// timer stopped, so that the GPUs in use it sums stay few.
//
//	cd pkg && go test -run '^$' -bench BenchmarkCreateReservation -benchmem -benchtime 2000x ./store/
func BenchmarkCreateReservation(b *testing.B) {
	db := storetest.New(b, nil)
	ctx := b.Context()
	pool := storetest.Pool(b, db, nil)
	tenant := storetest.Tenant(b, db, nil)
	storetest.Node(b, db, &storetest.NodeOpts{PoolID: pool.ID, State: store.NodeAdopted, GPUs: 8, GPUModel: "H100"})
	storetest.Offer(b, db, &storetest.OfferOpts{PoolID: pool.ID, TenantID: tenant.ID, GPUQuota: 1 << 20})
	stmts := storetest.CountStatements()
	counted := 0
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if i > 0 && i%100 == 0 {
			b.StopTimer()
			counted += stmts.Count()
			_, err := db.Pool.Exec(ctx, `UPDATE reservations SET state = 'released', ended_at = now() WHERE state = 'pending'`)
			require.NoError(b, err)
			stmts.Reset()
			b.StartTimer()
		}
		now := db.Now()
		n := store.NewReservation{ID: ids.New(ids.Reservation, now), TenantID: tenant.ID, PoolID: pool.ID, GPUs: 1,
			StartAt: now, EndAt: now.Add(time.Hour), RequestID: fmt.Sprintf("bench-%d", i), CreatedBy: "tok_bench"}
		if err := db.InTx(ctx, func(tx pgx.Tx) error {
			_, err := store.CreateReservation(ctx, tx, now, n)
			return err
		}); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	stmts.Stop()
	counted += stmts.Count()
	b.ReportMetric(float64(counted)/float64(b.N), "stmts/op")
}
