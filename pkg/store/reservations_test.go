package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
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

// waitForLockWaiter waits until a backend of db's database waits for a
// lock (a row lock, or the transaction of an uncommitted duplicate key).
func waitForLockWaiter(t *testing.T, db *store.DB) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n))
		return n > 0
	}, 10*time.Second, 5*time.Millisecond)
}

// TestCreateReservationAfterWaitingForTheOfferLock: a Reserve whose
// statement began before another Reserve of the tenant in the pool
// committed, and so waited for the offer's lock, decides on what that one
// committed (its snapshot missed it): the quota counts its GPUs, and its
// request id answers a retry. A request id used at once in another pool
// (another offer, so no wait for the lock, only for the duplicate key) is
// refused as a conflict.
func TestCreateReservationAfterWaitingForTheOfferLock(t *testing.T) {
	t.Parallel()
	type fixture struct {
		fleetFixture
		other store.Pool
	}
	setup := func(t *testing.T) fixture {
		f := fixture{fleetFixture: newFleetFixture(t)}
		f.other = storetest.Pool(t, f.db, &storetest.PoolOpts{SiteID: f.site.ID, OwnerTenantID: f.tenant.ID})
		for _, p := range []string{f.pool.ID, f.other.ID} {
			storetest.Node(t, f.db, &storetest.NodeOpts{PoolID: p, State: store.NodeAdopted, GPUs: 8, GPUModel: "H100"})
			storetest.Offer(t, f.db, &storetest.OfferOpts{PoolID: p, TenantID: f.tenant.ID, GPUQuota: 3})
		}
		return f
	}
	newRes := func(f fixture, pool string, gpus int32, requestID string) store.NewReservation {
		now := f.db.Now()
		return store.NewReservation{ID: ids.New(ids.Reservation, now), TenantID: f.tenant.ID, PoolID: pool, GPUs: gpus,
			StartAt: now, EndAt: now.Add(time.Hour), RequestID: requestID}
	}
	// race makes first in a transaction left open, starts second, waits
	// until it waits for a lock, commits the first and returns what the
	// second did.
	race := func(t *testing.T, f fixture, first, second store.NewReservation) (store.CreatedReservation, store.CreatedReservation, error) {
		ctx := t.Context()
		tx, err := f.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		a, err := store.CreateReservation(ctx, tx, f.db.Now(), first)
		require.NoError(t, err)
		type result struct {
			c   store.CreatedReservation
			err error
		}
		done := make(chan result, 1)
		go func() {
			var r result
			r.err = f.db.InTx(ctx, func(tx pgx.Tx) error {
				var err error
				r.c, err = store.CreateReservation(ctx, tx, f.db.Now(), second)
				return err
			})
			done <- r
		}()
		waitForLockWaiter(t, f.db)
		require.NoError(t, tx.Commit(ctx))
		r := <-done
		return a, r.c, r.err
	}

	t.Run("quota counts the GPUs committed while it waited", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		_, _, err := race(t, f, newRes(f, f.pool.ID, 2, ""), newRes(f, f.pool.ID, 2, ""))
		var qe *store.QuotaError
		require.ErrorAs(t, err, &qe)
		require.Equal(t, store.QuotaError{PoolID: f.pool.ID, Quota: 3, InUse: 2, Want: 2}, *qe)
	})
	t.Run("within quota it is created", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		_, c, err := race(t, f, newRes(f, f.pool.ID, 2, ""), newRes(f, f.pool.ID, 1, ""))
		require.NoError(t, err)
		require.False(t, c.Existing)
		o, err := store.GetOffer(t.Context(), f.db.Pool, f.pool.ID, f.tenant.ID)
		require.NoError(t, err)
		require.EqualValues(t, 3, o.GPUsInUse)
	})
	t.Run("the same request id in the same pool returns the first", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		a, c, err := race(t, f, newRes(f, f.pool.ID, 2, "dup"), newRes(f, f.pool.ID, 2, "dup"))
		require.NoError(t, err)
		require.True(t, c.Existing)
		require.Equal(t, a.Reservation, c.Reservation)
	})
	t.Run("the same request id in another pool is a conflict", func(t *testing.T) {
		t.Parallel()
		f := setup(t)
		a, _, err := race(t, f, newRes(f, f.pool.ID, 2, "dup"), newRes(f, f.other.ID, 2, "dup"))
		var conflict *store.RequestConflictError
		require.ErrorAs(t, err, &conflict)
		require.Equal(t, a.Reservation.ID, conflict.Existing.ID)
		rs, err := store.ListReservations(t.Context(), f.db.Pool, store.ReservationFilter{Scope: store.AllTenants, PoolID: f.other.ID})
		require.NoError(t, err)
		require.Empty(t, rs)
	})
}

// TestCreateReservationAudit: the audit row CreateReservation writes with
// a reservation names it and says whether it was created pending, failed,
// or returned for its request id; a refusal writes none.
func TestCreateReservationAudit(t *testing.T) {
	t.Parallel()
	f := newFleetFixture(t)
	ctx := t.Context()
	storetest.Node(t, f.db, &storetest.NodeOpts{PoolID: f.pool.ID, State: store.NodeAdopted, GPUs: 2, GPUModel: "H100"})
	storetest.Offer(t, f.db, &storetest.OfferOpts{PoolID: f.pool.ID, TenantID: f.tenant.ID, GPUQuota: 5})
	audit := &store.ReservationAudit{Entry: store.AuditEntry{TenantID: f.tenant.ID, TokenID: "tok_a", Role: "tenant-member",
		Procedure: "/bc.compute.v1.ReservationService/Reserve", Outcome: "ok"},
		Pending: "made pending", Failed: "made failed", Existing: "returned"}
	create := func(gpus int32, requestID string) (store.CreatedReservation, error) {
		now := f.db.Now()
		var c store.CreatedReservation
		err := f.db.InTx(ctx, func(tx pgx.Tx) error {
			var err error
			c, err = store.CreateReservation(ctx, tx, now, store.NewReservation{ID: ids.New(ids.Reservation, now),
				TenantID: f.tenant.ID, PoolID: f.pool.ID, GPUs: gpus, StartAt: now, EndAt: now.Add(time.Hour),
				RequestID: requestID, CreatedBy: "tok_a", Audit: audit})
			return err
		})
		return c, err
	}
	pending, err := create(2, "a")
	require.NoError(t, err)
	failed, err := create(3, "")
	require.NoError(t, err)
	require.Equal(t, store.ReservationFailed, failed.Reservation.State)
	again, err := create(2, "a")
	require.NoError(t, err)
	require.True(t, again.Existing)
	_, err = create(4, "b")
	require.ErrorIs(t, err, store.ErrQuotaExceeded)

	rows, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 10})
	require.NoError(t, err)
	type row struct{ tenant, token, role, procedure, target, outcome, detail string }
	var got []row
	for _, e := range rows {
		got = append(got, row{e.TenantID, e.TokenID, e.Role, e.Procedure, e.Target, e.Outcome, e.Detail})
	}
	r := func(target, detail string) row {
		return row{f.tenant.ID, "tok_a", "tenant-member", "/bc.compute.v1.ReservationService/Reserve", target, "ok", detail}
	}
	// Newest first.
	require.Equal(t, []row{r(pending.Reservation.ID, "returned"), r(failed.Reservation.ID, "made failed"),
		r(pending.Reservation.ID, "made pending")}, got)
}

// TestReservationFailedDataSQL checks that the SQL that builds
// ReservationFailedData in CreateReservation writes what the Go type does.
func TestReservationFailedDataSQL(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	d := store.ReservationFailedData{ReservationID: "res_1", Reason: `no node of pool "p" has 8 GPUs (largest: 2)`}
	b, err := json.Marshal(d)
	require.NoError(t, err)
	var fromGo, fromSQL string
	require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT $1::jsonb::text`, string(b)).Scan(&fromGo))
	require.NoError(t, db.Pool.QueryRow(t.Context(), `SELECT (`+store.ReservationFailedDataSQL+`)::text
		FROM (VALUES ($1, $2)) AS r(id, reason)`, d.ReservationID, d.Reason).Scan(&fromSQL))
	require.Equal(t, fromGo, fromSQL)
}

// TestCreateReservationStatements: a Reserve with a request id (and its
// audit row) is, in its transaction, one statement (store.CreateReservation's
// data-modifying CTE: the request's lookup, the offer's lock, the quota and
// never-fits checks, the insert returning the row, the reservation.created
// event with its outbox message, the scheduler's poke and the audit row)
// between BEGIN and COMMIT; the outbox's NOTIFY, sent after the commit on a
// goroutine of its own, is left out. Not parallel: the counter sees every
// statement of the process.
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
			GPUs: 2, StartAt: now, EndAt: now.Add(time.Hour), RequestID: "req-statements", CreatedBy: "tok_statements",
			Audit: &store.ReservationAudit{Entry: store.AuditEntry{TenantID: f.tenant.ID, Procedure: "/reserve", Outcome: "ok"},
				Pending: "pending", Failed: "failed", Existing: "existing"}})
		return err
	}))
	stmts.Stop()
	var sent []string
	for _, q := range stmts.SQL() {
		if q != store.OutboxNotifySQL {
			sent = append(sent, q)
		}
	}
	require.Equal(t, []string{"begin", store.CreateReservationSQL, "commit"}, sent, strings.Join(sent, "\n---\n"))

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

// BenchmarkCreateReservationContended is BenchmarkCreateReservation with 8
// Reserves at once of the one tenant in the one pool (b.SetParallelism(4)
// on 2 cores), all serialised by the offer's lock: a Reserve that waited for
// another's commit runs its statement again, which the statements per
// reservation show. The reservations are not released (the quota is never
// reached).
//
//	cd pkg && go test -run '^$' -bench BenchmarkCreateReservationContended -benchmem -benchtime 2000x ./store/
func BenchmarkCreateReservationContended(b *testing.B) {
	db := storetest.New(b, nil)
	ctx := b.Context()
	pool := storetest.Pool(b, db, nil)
	tenant := storetest.Tenant(b, db, nil)
	storetest.Node(b, db, &storetest.NodeOpts{PoolID: pool.ID, State: store.NodeAdopted, GPUs: 8, GPUModel: "H100"})
	storetest.Offer(b, db, &storetest.OfferOpts{PoolID: pool.ID, TenantID: tenant.ID, GPUQuota: 1 << 30})
	var seq atomic.Int64
	stmts := storetest.CountStatements()
	b.ReportAllocs()
	b.SetParallelism(4)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			now := db.Now()
			n := store.NewReservation{ID: ids.New(ids.Reservation, now), TenantID: tenant.ID, PoolID: pool.ID, GPUs: 1,
				StartAt: now, EndAt: now.Add(time.Hour), RequestID: fmt.Sprintf("bench-%d", seq.Add(1)), CreatedBy: "tok_bench"}
			if err := db.InTx(ctx, func(tx pgx.Tx) error {
				_, err := store.CreateReservation(ctx, tx, now, n)
				return err
			}); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	stmts.Stop()
	b.ReportMetric(float64(stmts.Count())/float64(b.N), "stmts/op")
}

// TestFailNodeReservationsLocksInIDOrder: FailNodeReservations locks a
// node's reservations in id order, as ActivateReservations does, so the two
// cannot deadlock. With the lower id held by another transaction it waits
// there, holding no lock on the higher one, even when the higher one comes
// first in the table.
func TestFailNodeReservationsLocksInIDOrder(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	f := storetest.NewFleet(t, db, "lockorder", 8)
	now := db.Now()
	node := f.Nodes[0]
	res := func(id string, dev int32) {
		storetest.Reservation(t, db, &storetest.ReservationOpts{ID: id, TenantID: f.OwnerID, PoolID: f.PoolID,
			State: store.ReservationActive, NodeID: node, DeviceIndexes: []int32{dev}, SpecGeneration: 1, PlacedAt: now, ActiveAt: now})
	}
	low, high := ids.New(ids.Reservation, now), ids.New(ids.Reservation, now.Add(time.Second))
	res(high, 1) // first in the heap
	res(low, 0)

	ctx := t.Context()
	holder, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT FROM reservations WHERE id = $1 FOR UPDATE`, low)
	require.NoError(t, err)

	failed := make(chan error, 1)
	go func() {
		failed <- db.InTx(ctx, func(tx pgx.Tx) error {
			_, err := store.FailNodeReservations(ctx, tx, nil, db.Now(), node, "node revoked")
			return err
		})
	}()
	// Once it waits on the lower id, the higher one is still free.
	require.Eventually(t, func() bool {
		var waiting bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%reservations%' AND pid <> pg_backend_pid())`).Scan(&waiting)
		return err == nil && waiting
	}, 10*time.Second, 10*time.Millisecond, "FailNodeReservations waits on the held reservation")
	probe, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = probe.Rollback(ctx) }()
	_, err = probe.Exec(ctx, `SELECT FROM reservations WHERE id = $1 FOR UPDATE NOWAIT`, high)
	require.NoError(t, err, "the higher id is not locked while the lower one is waited for")
	require.NoError(t, probe.Rollback(ctx))

	require.NoError(t, holder.Rollback(ctx))
	require.NoError(t, <-failed)
	var states []string
	require.NoError(t, pgxScanStrings(ctx, db, `SELECT state FROM reservations WHERE node_id = $1 ORDER BY id`, node, &states))
	require.Equal(t, []string{store.ReservationFailed, store.ReservationFailed}, states)
}

func pgxScanStrings(ctx context.Context, db *store.DB, sql string, arg any, out *[]string) error {
	rows, err := db.Pool.Query(ctx, sql, arg)
	if err != nil {
		return err
	}
	*out, err = pgx.CollectRows(rows, pgx.RowTo[string])
	return err
}
