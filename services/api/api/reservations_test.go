package api_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

// reservation creates a pending reservation of gpus GPUs of pool for tenant,
// for an hour from now, through the store (the pool must be offered to it).
func (f *fixture) reservation(t *testing.T, tenant, pool string, gpus int32, requestID string) string {
	t.Helper()
	now := f.db.Now()
	var id string
	require.NoError(t, f.db.InTx(t.Context(), func(tx pgx.Tx) error {
		c, err := store.CreateReservation(t.Context(), tx, now, store.NewReservation{ID: ids.New(ids.Reservation, now),
			TenantID: tenant, PoolID: pool, GPUs: gpus, StartAt: now, EndAt: now.Add(time.Hour), RequestID: requestID})
		id = c.Reservation.ID
		return err
	}))
	return id
}

// offer offers pool to tenant with quota GPUs.
func (f *fixture) offer(t *testing.T, pool, tenant string, quota int32) {
	t.Helper()
	_, err := store.UpsertOffer(t.Context(), f.db.Pool, store.AllTenants, store.Offer{PoolID: pool, TenantID: tenant, GPUQuota: quota, UpdatedAt: f.db.Now()})
	require.NoError(t, err)
}

// count returns the result of a count(*) query.
func (f *fixture) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), sql, args...).Scan(&n))
	return n
}

func reserveReq(pool string, gpus int32, d time.Duration) *connect.Request[computev1.ReserveRequest] {
	return connect.NewRequest(&computev1.ReserveRequest{PoolId: pool, Gpus: gpus, Duration: durationpb.New(d)})
}

func TestReserve(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	member := f.as(f.tokens["acme-member"])
	f.node(t, f.acmePool, 8, "H100", adopted)
	f.node(t, f.acmePool, 8, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 8)

	before := f.db.Now()
	res, err := member.res.Reserve(ctx, reserveReq(f.acmePool, 4, time.Hour))
	require.NoError(t, err)
	r := res.Msg.Reservation
	require.NoError(t, ids.Check(ids.Reservation, r.Id))
	require.Equal(t, f.acme, r.TenantId)
	require.Equal(t, f.acmePool, r.PoolId)
	require.EqualValues(t, 4, r.Gpus)
	require.Equal(t, "pending", r.State)
	require.Empty(t, r.Reason)
	require.False(t, r.StartTime.AsTime().Before(before))
	require.Equal(t, time.Hour, r.EndTime.AsTime().Sub(r.StartTime.AsTime()))
	// Its event and the scheduler's poke went out with it.
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'reservation.created' AND subject_id = $1 AND tenant_id = $2`, r.Id, f.acme))
	require.Zero(t, f.count(t, `SELECT count(*) FROM outbox WHERE subject LIKE 'bc.events.%'`), "an event has no outbox row")
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM outbox WHERE subject = $1`, store.SubjectPokeScheduler))

	// A start in the future is kept.
	start := f.db.Now().Add(48 * time.Hour).Truncate(time.Second)
	res, err = member.res.Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 4,
		Duration: durationpb.New(30 * time.Minute), StartTime: timestamppb.New(start)}))
	require.NoError(t, err)
	require.True(t, res.Msg.Reservation.StartTime.AsTime().Equal(start))
	require.True(t, res.Msg.Reservation.EndTime.AsTime().Equal(start.Add(30*time.Minute)))

	// Quota: 8 GPUs, 8 in use.
	_, err = member.res.Reserve(ctx, reserveReq(f.acmePool, 1, time.Hour))
	requireCode(t, err, connect.CodeResourceExhausted, "gpus: quota of pool "+f.acmePool+" is 8 GPUs, 8 in use, 1 requested")
	offers, err := member.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{}))
	require.NoError(t, err)
	require.Len(t, offers.Msg.Offers, 1)
	require.EqualValues(t, 8, offers.Msg.Offers[0].GpusInUse)
	require.EqualValues(t, 8, offers.Msg.Offers[0].GpuQuota)

	// Releasing frees quota.
	_, err = member.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: r.Id}))
	require.NoError(t, err)
	_, err = member.res.Reserve(ctx, reserveReq(f.acmePool, 4, time.Hour))
	require.NoError(t, err)

	// No node of the pool can ever hold 9 GPUs: failed at once, with the
	// reason and its event, and it holds no quota.
	f.offer(t, f.acmePool, f.acme, 64)
	res, err = member.res.Reserve(ctx, reserveReq(f.acmePool, 9, time.Hour))
	require.NoError(t, err)
	failed := res.Msg.Reservation
	require.Equal(t, "failed", failed.State)
	require.Equal(t, "no node of pool "+f.acmePool+" has 9 GPUs (largest: 8)", failed.Reason)
	require.NotNil(t, failed.EndedAt)
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'reservation.failed' AND subject_id = $1`, failed.Id))
	offers, err = member.pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: f.acmePool}))
	require.NoError(t, err)
	require.EqualValues(t, 8, offers.Msg.Offers[0].GpusInUse, "a failed reservation holds nothing")

	// The pool is not offered to the other tenant: to it the pool is
	// missing (TestForeignPoolReadsAsMissing); a missing pool.
	_, err = f.as(f.tokens["other-member"]).res.Reserve(ctx, reserveReq(f.acmePool, 1, time.Hour))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool "+f.acmePool+" not found")
	_, err = member.res.Reserve(ctx, reserveReq(f.otherPool, 1, time.Hour))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool "+f.otherPool+" not found")
	_, err = member.res.Reserve(ctx, reserveReq("pool_missing", 1, time.Hour))
	requireCode(t, err, connect.CodeNotFound, "pool_id: pool pool_missing not found")
}

func TestReserveInvalid(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	member := f.as(f.tokens["acme-member"])
	f.node(t, f.acmePool, 8, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 64)
	for _, tc := range []struct {
		name  string
		req   *computev1.ReserveRequest
		field string
	}{
		{"zero gpus", &computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 0, Duration: durationpb.New(time.Hour)}, "gpus:"},
		{"negative gpus", &computev1.ReserveRequest{PoolId: f.acmePool, Gpus: -2, Duration: durationpb.New(time.Hour)}, "gpus:"},
		{"zero duration", &computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 1, Duration: durationpb.New(0)}, "duration:"},
		{"negative duration", &computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 1, Duration: durationpb.New(-time.Hour)}, "duration:"},
		{"no duration", &computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 1}, "duration:"},
		{"no pool", &computev1.ReserveRequest{Gpus: 1, Duration: durationpb.New(time.Hour)}, "pool_id:"},
		{"start in the past", &computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 1, Duration: durationpb.New(time.Hour),
			StartTime: timestamppb.New(f.db.Now().Add(-time.Hour))}, "start_time:"},
		{"start too far", &computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 1, Duration: durationpb.New(time.Hour),
			StartTime: timestamppb.New(f.db.Now().Add(400 * 24 * time.Hour))}, "start_time:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := member.res.Reserve(ctx, connect.NewRequest(tc.req))
			requireCode(t, err, connect.CodeInvalidArgument, tc.field)
		})
	}
	require.Zero(t, f.count(t, `SELECT count(*) FROM reservations`), "nothing half-written")
}

func TestReserveIdempotent(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	member := f.as(f.tokens["acme-member"])
	f.node(t, f.acmePool, 8, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 4)
	req := func(id string) *connect.Request[computev1.ReserveRequest] {
		return connect.NewRequest(&computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 4, Duration: durationpb.New(time.Hour),
			RequestId: id})
	}
	first, err := member.res.Reserve(ctx, req("req-1"))
	require.NoError(t, err)
	require.Equal(t, "req-1", first.Msg.Reservation.RequestId)
	// The quota is now full, but a retry returns the same reservation.
	again, err := member.res.Reserve(ctx, req("req-1"))
	require.NoError(t, err)
	require.Equal(t, first.Msg.Reservation.Id, again.Msg.Reservation.Id)
	// The same request id for a different reservation is refused, not
	// answered with the old one.
	_, err = member.res.Reserve(ctx, connect.NewRequest(&computev1.ReserveRequest{PoolId: f.acmePool, Gpus: 2,
		Duration: durationpb.New(2 * time.Hour), RequestId: "req-1"}))
	requireCode(t, err, connect.CodeAlreadyExists, `request_id: "req-1" was used for reservation `+first.Msg.Reservation.Id)
	_, err = member.res.Reserve(ctx, req("req-2"))
	requireCode(t, err, connect.CodeResourceExhausted, "4 in use")
	// Another tenant's request id is its own.
	f.offer(t, f.acmePool, f.other, 4)
	other, err := f.as(f.tokens["other-member"]).res.Reserve(ctx, req("req-1"))
	require.NoError(t, err)
	require.NotEqual(t, first.Msg.Reservation.Id, other.Msg.Reservation.Id)

	// Concurrent duplicates make one reservation.
	f.offer(t, f.acmePool, f.acme, 64)
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		got = map[string]int{}
	)
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := member.res.Reserve(ctx, req("req-concurrent"))
			if !assertNoErr(t, err) {
				return
			}
			mu.Lock()
			got[res.Msg.Reservation.Id]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Len(t, got, 1, "every call returned the same reservation")
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM reservations WHERE request_id = 'req-concurrent'`))
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events e JOIN reservations r ON r.id = e.subject_id
		WHERE r.request_id = 'req-concurrent' AND e.type = 'reservation.created'`), "one event")
}

// assertNoErr reports err without stopping the test (for goroutines).
func assertNoErr(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Errorf("unexpected error: %v", err)
		return false
	}
	return true
}

// TestRelease places a reservation by hand (booking and spec, as the
// scheduler would) and releases it: bookings end, the spec drops the
// allocation with a new generation, the event is written; another tenant
// gets NotFound.
func TestRelease(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	member := f.as(f.tokens["acme-member"])
	node := f.node(t, f.acmePool, 8, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 8)
	now := f.db.Now()
	id := storetest.Reservation(t, f.db, &storetest.ReservationOpts{TenantID: f.acme, PoolID: f.acmePool, GPUs: 2,
		State: store.ReservationActive, NodeID: node, DeviceIndexes: []int32{2, 3},
		Binding: []string{"nvidia.com/gpu=2", "nvidia.com/gpu=3"}, PlacedAt: now, ActiveAt: now}).ID
	var gen0 int64
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		gens, err := store.RebuildNodeSpecs(ctx, tx, nil, now, []string{node})
		gen0 = gens[node]
		return err
	}))
	allocs := f.allocations(t, node).Allocations
	require.Len(t, allocs, 1)
	require.Equal(t, id, allocs[0].ReservationId)
	require.Equal(t, []int32{2, 3}, allocs[0].DeviceIndexes)

	got, err := member.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: id}))
	require.NoError(t, err)
	require.Equal(t, "active", got.Msg.Reservation.State)
	require.Equal(t, node, got.Msg.Reservation.NodeId)
	require.Equal(t, []int32{2, 3}, got.Msg.Reservation.DeviceIndexes)
	require.Equal(t, []string{"nvidia.com/gpu=2", "nvidia.com/gpu=3"}, got.Msg.Reservation.Binding)

	// Another tenant's release and get are NotFound and change nothing.
	_, err = f.as(f.tokens["other-admin"]).res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: id}))
	requireCode(t, err, connect.CodeNotFound, "reservation "+id+" not found")
	_, err = f.as(f.tokens["other-member"]).res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: id}))
	requireCode(t, err, connect.CodeNotFound, "reservation "+id+" not found")
	_, err = member.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: "res_missing"}))
	requireCode(t, err, connect.CodeNotFound, "reservation res_missing not found")
	require.Equal(t, 2, f.count(t, `SELECT count(*) FROM bookings WHERE reservation_id = $1 AND upper(during) > now() + interval '50 minutes'`, id))

	rel, err := member.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: id}))
	require.NoError(t, err)
	r := rel.Msg.Reservation
	require.Equal(t, "released", r.State)
	require.False(t, rel.Msg.AlreadyEnded)
	require.NotNil(t, r.EndedAt)
	ended := r.EndedAt.AsTime()
	// Bookings end at the release; the spec drops the allocation.
	rows, err := f.db.Pool.Query(ctx, `SELECT upper(during) FROM bookings WHERE reservation_id = $1`, id)
	require.NoError(t, err)
	uppers, err := pgx.CollectRows(rows, pgx.RowTo[time.Time])
	require.NoError(t, err)
	require.Len(t, uppers, 2)
	for _, u := range uppers {
		require.True(t, u.Equal(ended), "booking ends at %s, released at %s", u, ended)
	}
	spec := f.allocations(t, node)
	require.Empty(t, spec.Allocations)
	require.Equal(t, gen0+1, spec.gen)
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'reservation.released' AND subject_id = $1`, id))

	// Releasing again returns it unchanged, and says so.
	again, err := member.res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: id}))
	require.NoError(t, err)
	require.True(t, again.Msg.AlreadyEnded)
	require.Equal(t, "released", again.Msg.Reservation.State)
	require.True(t, again.Msg.Reservation.EndedAt.AsTime().Equal(ended))
	require.Equal(t, gen0+1, f.allocations(t, node).gen)
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'reservation.released' AND subject_id = $1`, id))
	audit, err := store.ListAudit(ctx, f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 10})
	require.NoError(t, err)
	require.Equal(t, "already released", audit[0].Detail)
	require.Equal(t, "released", audit[1].Detail)
	require.Equal(t, id, audit[1].Target)
}

// nodeSpec is a node's spec and its generation.
type nodeSpec struct {
	*gatewayv1.NodeSpec
	gen int64
}

func (f *fixture) allocations(t *testing.T, node string) nodeSpec {
	t.Helper()
	var (
		b   []byte
		gen int64
	)
	require.NoError(t, f.db.Pool.QueryRow(t.Context(), `SELECT spec, spec_generation FROM nodes WHERE id = $1`, node).Scan(&b, &gen))
	ns := &gatewayv1.NodeSpec{}
	require.NoError(t, protojson.Unmarshal(b, ns))
	return nodeSpec{NodeSpec: ns, gen: gen}
}

func TestOffers(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	offer := func(c clients, pool, tenant string, quota int32) (*computev1.Offer, error) {
		res, err := c.pools.OfferPool(ctx, connect.NewRequest(&computev1.OfferPoolRequest{PoolId: pool, TenantId: tenant, GpuQuota: quota}))
		if err != nil {
			return nil, err
		}
		return res.Msg.Offer, nil
	}
	root := f.as(f.tokens["root"])
	// A tenant-admin sees no other tenant: offering to one reads exactly as
	// offering to a tenant that does not exist (answerOf writes either id
	// as POOL).
	_, err := offer(admin, f.acmePool, f.other, 16)
	require.Equal(t, answer{Code: connect.CodeNotFound, Message: "tenant_id: tenant POOL not found"},
		answerOf(err, f.other), "another tenant reads as a missing one")
	_, err = offer(admin, f.acmePool, "ten_missing", 1)
	require.Equal(t, answer{Code: connect.CodeNotFound, Message: "tenant_id: tenant POOL not found"},
		answerOf(err, "ten_missing"))
	require.Zero(t, f.count(t, `SELECT count(*) FROM pool_offers`), "no refusal wrote an offer")

	o, err := offer(root, f.acmePool, f.other, 16)
	require.NoError(t, err)
	require.Equal(t, f.acmePool, o.PoolId)
	require.Equal(t, f.other, o.TenantId)
	require.EqualValues(t, 16, o.GpuQuota)
	require.Zero(t, o.GpusInUse)
	created := o.CreatedAt.AsTime()
	// Offering again changes the quota.
	o, err = offer(root, f.acmePool, f.other, 32)
	require.NoError(t, err)
	require.EqualValues(t, 32, o.GpuQuota)
	require.True(t, o.CreatedAt.AsTime().Equal(created))
	_, err = offer(admin, f.acmePool, f.acme, 8)
	require.NoError(t, err)

	// other was offered acme's pool: it sees it, but only its owner offers it.
	_, err = offer(f.as(f.tokens["other-admin"]), f.acmePool, f.other, 64)
	requireCode(t, err, connect.CodePermissionDenied, "pool_id: pool "+f.acmePool+" is offered to your tenant but owned by another")
	_, err = offer(f.as(f.tokens["acme-member"]), f.acmePool, f.acme, 1)
	requireCode(t, err, connect.CodePermissionDenied, "needs fleet.manage")
	_, err = offer(root, f.otherPool, f.acme, 4)
	require.NoError(t, err, "root offers any pool")

	list := func(who, pool string) []string {
		res, err := f.as(f.tokens[who]).pools.ListOffers(ctx, connect.NewRequest(&computev1.ListOffersRequest{PoolId: pool}))
		require.NoError(t, err)
		var out []string
		for _, o := range res.Msg.Offers {
			out = append(out, fmt.Sprintf("%s>%s:%d", o.PoolId, o.TenantId, o.GpuQuota))
		}
		return out
	}
	acmeToAcme := f.acmePool + ">" + f.acme + ":8"
	acmeToOther := f.acmePool + ">" + f.other + ":32"
	otherToAcme := f.otherPool + ">" + f.acme + ":4"
	// acme sees the offers of its pool and those made to it.
	require.ElementsMatch(t, []string{acmeToAcme, acmeToOther, otherToAcme}, list("acme-viewer", ""))
	// other sees the offer made to it and those of its own pool.
	require.ElementsMatch(t, []string{acmeToOther, otherToAcme}, list("other-member", ""))
	require.ElementsMatch(t, []string{acmeToOther}, list("other-member", f.acmePool))
	require.ElementsMatch(t, []string{acmeToAcme, acmeToOther, otherToAcme}, list("root", ""))
}

func TestListReservations(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	f.node(t, f.acmePool, 8, "H100", adopted)
	f.node(t, f.otherPool, 8, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 64)
	f.offer(t, f.otherPool, f.acme, 64)
	f.offer(t, f.otherPool, f.other, 64)
	var acmeIDs []string
	for range 3 {
		acmeIDs = append(acmeIDs, f.reservation(t, f.acme, f.acmePool, 1, ""))
	}
	acmeIDs = append(acmeIDs, f.reservation(t, f.acme, f.otherPool, 1, ""))
	otherID := f.reservation(t, f.other, f.otherPool, 1, "")
	_, err := f.as(f.tokens["acme-member"]).res.ReleaseReservation(ctx, connect.NewRequest(&computev1.ReleaseReservationRequest{ReservationId: acmeIDs[1]}))
	require.NoError(t, err)

	list := func(who string, req *computev1.ListReservationsRequest) ([]string, string) {
		res, err := f.as(f.tokens[who]).res.ListReservations(ctx, connect.NewRequest(req))
		require.NoError(t, err)
		var out []string
		for _, r := range res.Msg.Reservations {
			out = append(out, r.Id)
		}
		return out, res.Msg.NextPageToken
	}
	got, next := list("acme-viewer", &computev1.ListReservationsRequest{})
	require.Equal(t, acmeIDs, got)
	require.Empty(t, next)
	got, _ = list("acme-viewer", &computev1.ListReservationsRequest{PoolId: f.acmePool, State: "pending"})
	require.Equal(t, []string{acmeIDs[0], acmeIDs[2]}, got)
	got, _ = list("acme-viewer", &computev1.ListReservationsRequest{State: "released"})
	require.Equal(t, []string{acmeIDs[1]}, got)
	got, next = list("acme-viewer", &computev1.ListReservationsRequest{PageSize: 2})
	require.Equal(t, acmeIDs[:2], got)
	require.Equal(t, acmeIDs[1], next)
	got, _ = list("acme-viewer", &computev1.ListReservationsRequest{PageSize: 2, PageToken: next})
	require.Equal(t, acmeIDs[2:], got)
	got, _ = list("other-member", &computev1.ListReservationsRequest{})
	require.Equal(t, []string{otherID}, got, "another tenant's reservations are never listed")
	// A pool other neither owns nor was offered reads as a missing one.
	for _, pool := range []string{f.acmePool, "pool_missing"} {
		_, err := f.as(f.tokens["other-member"]).res.ListReservations(ctx,
			connect.NewRequest(&computev1.ListReservationsRequest{PoolId: pool}))
		requireCode(t, err, connect.CodeNotFound, "pool_id: pool "+pool+" not found")
	}
	got, _ = list("root", &computev1.ListReservationsRequest{})
	require.Equal(t, append(append([]string{}, acmeIDs...), otherID), got)
}

func TestListUsage(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	f.node(t, f.acmePool, 8, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 64)
	f.offer(t, f.acmePool, f.other, 64)
	acmeRes := f.reservation(t, f.acme, f.acmePool, 2, "")
	otherRes := f.reservation(t, f.other, f.acmePool, 1, "")
	hour := time.Date(2025, 3, 1, 10, 0, 0, 0, time.UTC)
	for _, w := range []struct {
		res, tenant string
		start       time.Time
		secs        int64
	}{
		{acmeRes, f.acme, hour, 1800 * 2},
		{acmeRes, f.acme, hour.Add(time.Hour), 3600 * 2},
		{acmeRes, f.acme, hour.Add(2 * time.Hour), 600 * 2},
		{otherRes, f.other, hour, 3600},
	} {
		storetest.UsageWindow(t, f.db, &storetest.UsageWindowOpts{ReservationID: w.res, TenantID: w.tenant, PoolID: f.acmePool,
			WindowStart: w.start, GPUSeconds: w.secs})
	}
	usage := func(who, tenant string, since *time.Time) (*computev1.ListUsageResponse, error) {
		req := &computev1.ListUsageRequest{TenantId: tenant}
		if since != nil {
			req.Since = timestamppb.New(*since)
		}
		res, err := f.as(f.tokens[who]).usage.ListUsage(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		return res.Msg, nil
	}
	res, err := usage("acme-viewer", "", nil)
	require.NoError(t, err)
	require.Len(t, res.Windows, 3)
	require.EqualValues(t, 3600+7200+1200, res.TotalGpuSeconds)
	require.Equal(t, acmeRes, res.Windows[0].ReservationId)
	require.True(t, res.Windows[0].WindowStart.AsTime().Equal(hour))
	// Since 11:30: the windows that end after it.
	since := hour.Add(90 * time.Minute)
	res, err = usage("acme-viewer", "", &since)
	require.NoError(t, err)
	require.Len(t, res.Windows, 2)
	require.EqualValues(t, 7200+1200, res.TotalGpuSeconds)
	_, err = usage("acme-viewer", f.other, nil)
	requireCode(t, err, connect.CodeNotFound, "tenant_id: tenant "+f.other+" not found")
	res, err = usage("root", f.other, nil)
	require.NoError(t, err)
	require.EqualValues(t, 3600, res.TotalGpuSeconds)
}

// TestRevokeNodeFailsItsReservations: revoking a node ends its active
// reservation as failed with the reason, its bookings end at the revocation
// (usage and quota stop there), the spec drops the allocation and a
// reservation.failed event is written; other nodes' reservations stay.
func TestRevokeNodeFailsItsReservations(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	node := f.node(t, f.acmePool, 8, "H100", adopted)
	other := f.node(t, f.acmePool, 8, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 8)
	place := func(n string) string {
		now := f.db.Now()
		id := storetest.Reservation(t, f.db, &storetest.ReservationOpts{TenantID: f.acme, PoolID: f.acmePool, GPUs: 2,
			State: store.ReservationActive, NodeID: n, DeviceIndexes: []int32{0, 1}, PlacedAt: now, ActiveAt: now}).ID
		require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
			_, err := store.RebuildNodeSpecs(ctx, tx, nil, now, []string{n})
			return err
		}))
		return id
	}
	onNode, onOther := place(node), place(other)

	_, err := f.as(f.tokens["acme-admin"]).nodes.RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: node, Reason: "stolen"}))
	require.NoError(t, err)
	got, err := f.as(f.tokens["acme-member"]).res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: onNode}))
	require.NoError(t, err)
	r := got.Msg.Reservation
	require.Equal(t, "failed", r.State)
	require.Equal(t, "node "+node+" was revoked: stolen", r.Reason)
	require.NotNil(t, r.EndedAt)
	require.Equal(t, 2, f.count(t, `SELECT count(*) FROM bookings WHERE reservation_id = $1 AND upper(during) = $2`,
		onNode, r.EndedAt.AsTime()), "bookings end at the revocation")
	require.Empty(t, f.allocations(t, node).Allocations)
	require.Equal(t, 1, f.count(t, `SELECT count(*) FROM events WHERE type = 'reservation.failed' AND subject_id = $1`, onNode))

	still, err := f.as(f.tokens["acme-member"]).res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: onOther}))
	require.NoError(t, err)
	require.Equal(t, "active", still.Msg.Reservation.State)
}

// TestReserveAuditRows: each Reserve writes one audit row, the success rows
// in its one statement (store.CreateReservation): created pending or failed
// with the GPUs, pool, times and state, an existing reservation returned
// with its request id; a refusal's row is the audit interceptor's.
func TestReserveAuditRows(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	member := f.as(f.tokens["acme-member"])
	f.node(t, f.acmePool, 2, "H100", adopted)
	f.offer(t, f.acmePool, f.acme, 5)
	since := f.newestAudit(t)
	req := func(gpus int32, requestID string) *connect.Request[computev1.ReserveRequest] {
		return connect.NewRequest(&computev1.ReserveRequest{PoolId: f.acmePool, Gpus: gpus, Duration: durationpb.New(time.Hour),
			RequestId: requestID})
	}
	pending, err := member.res.Reserve(ctx, req(2, "req-a"))
	require.NoError(t, err)
	failed, err := member.res.Reserve(ctx, req(3, ""))
	require.NoError(t, err)
	require.Equal(t, "failed", failed.Msg.Reservation.State)
	_, err = member.res.Reserve(ctx, req(2, "req-a"))
	require.NoError(t, err)
	_, err = member.res.Reserve(ctx, req(4, "req-b"))
	requireCode(t, err, connect.CodeResourceExhausted, "2 in use")

	detail := func(r *computev1.Reservation) string {
		return fmt.Sprintf("%d GPUs of pool %s from %s to %s: %s", r.Gpus, r.PoolId,
			r.StartTime.AsTime().UTC().Format(time.RFC3339), r.EndTime.AsTime().UTC().Format(time.RFC3339), r.State)
	}
	type row struct{ tenant, token, procedure, target, outcome, detail string }
	var got []row
	for _, e := range f.auditAfter(t, since) {
		got = append(got, row{e.TenantID, e.TokenID, e.Procedure, e.Target, e.Outcome, e.Detail})
	}
	require.NotEmpty(t, got)
	tok := got[0].token
	require.NotEmpty(t, tok)
	proc := computev1connect.ReservationServiceReserveProcedure
	require.Equal(t, []row{
		{f.acme, tok, proc, pending.Msg.Reservation.Id, "ok", detail(pending.Msg.Reservation)},
		{f.acme, tok, proc, failed.Msg.Reservation.Id, "ok", detail(failed.Msg.Reservation)},
		{f.acme, tok, proc, pending.Msg.Reservation.Id, "ok", `request_id "req-a": existing reservation returned`},
		{f.acme, tok, proc, f.acmePool, "resource_exhausted", "gpus: quota of pool " + f.acmePool + " is 5 GPUs, 2 in use, 4 requested"},
	}, got)
}
