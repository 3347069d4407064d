package api_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/bus/bustest"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/syncbuf"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
)

// streamBearer sends a bearer token on streaming calls ("" sends none).
type streamBearer string

func (b streamBearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc { return next }

func (b streamBearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if b != "" {
			conn.RequestHeader().Set("Authorization", "Bearer "+string(b))
		}
		return conn
	}
}

func (b streamBearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// insertEvent writes an event of typ for tenant ("": none), subject
// "sub-<typ>", data {"type": typ}, in tx when it is not nil (committed then
// by the caller), and returns its id. The watch's tests need types, tenants
// and commits the control plane never writes (storetest.Event).
func insertEvent(t *testing.T, db *store.DB, tx pgx.Tx, now time.Time, tenant, typ string) int64 {
	t.Helper()
	return storetest.Event(t, db, &storetest.EventOpts{Tx: tx, TenantID: tenant, NoTenant: tenant == "", Type: typ,
		SubjectID: "sub-" + typ, Data: `{"type": "` + typ + `"}`, CreatedAt: now})
}

// mark writes an event of tenant ("": none) and returns its id: a watch of
// that tenant (of every tenant, for none) after it sees what follows
// (after_id 0 would mean "from now"), and may start after it, since it is
// the newest of its own.
func mark(t *testing.T, db *store.DB, tenant string) int64 {
	t.Helper()
	return insertEvent(t, db, nil, db.Now(), tenant, "test.mark")
}

// withServer returns f served by a new API server with cfg's watch settings,
// nc and clk (nil: the database's).
func (f *fixture) withServer(t *testing.T, cfg api.WatchConfig, nc *nats.Conn, clk clock.Clock) *fixture {
	t.Helper()
	srv, err := api.New(api.Config{Watch: cfg}, api.Deps{DB: f.db, Logger: telemetry.Discard(), NC: nc, Clock: clk})
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(srv.Close)
	t.Cleanup(ts.Close)
	t.Cleanup(srv.StopWatches) // runs first: open watches end, Close returns
	g := *f
	g.url = ts.URL
	return &g
}

// eventStream is a running Watch call.
type eventStream struct {
	events chan *computev1.Event
	// done receives the stream's error once it ends.
	done   chan error
	cancel context.CancelFunc
}

// watch starts c.events.Watch(req); it is cancelled when the test ends.
func watch(t *testing.T, c clients, req *computev1.WatchRequest) *eventStream {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	s := &eventStream{events: make(chan *computev1.Event, 100), done: make(chan error, 1), cancel: cancel}
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		defer close(s.events)
		stream, err := c.events.Watch(ctx, connect.NewRequest(req))
		if err != nil {
			s.done <- err
			return
		}
		for stream.Receive() {
			select {
			case s.events <- stream.Msg().Event:
			case <-ctx.Done():
			}
		}
		s.done <- stream.Err()
		_ = stream.Close()
	}()
	t.Cleanup(func() {
		cancel()
		<-finished
	})
	return s
}

// next returns the next event, failing after 10 s.
func (s *eventStream) next(t *testing.T) *computev1.Event {
	t.Helper()
	timer := clock.New().NewTimer(10 * time.Second)
	defer timer.Stop()
	select {
	case e, ok := <-s.events:
		if !ok {
			t.Fatalf("the stream ended: %v", <-s.done)
		}
		return e
	case <-timer.C():
		t.Fatal("no event within 10s")
		return nil
	}
}

// refusal returns the error a refused watch ended with, failing when it
// delivers an event or has not ended within 10 s.
func (s *eventStream) refusal(t *testing.T) error {
	t.Helper()
	timer := clock.New().NewTimer(10 * time.Second)
	defer timer.Stop()
	select {
	case e, ok := <-s.events:
		if ok {
			t.Fatalf("the watch was accepted: event %d", e.GetId())
		}
		return <-s.done
	case <-timer.C():
		t.Fatal("the watch was accepted: no refusal within 10s")
		return nil
	}
}

// none checks that no event arrives for d.
func (s *eventStream) none(t *testing.T, d time.Duration) {
	t.Helper()
	timer := clock.New().NewTimer(d)
	defer timer.Stop()
	select {
	case e := <-s.events:
		t.Fatalf("unexpected event %d %s", e.GetId(), e.GetType())
	case <-timer.C():
	}
}

// ids returns the next n events' ids.
func (s *eventStream) ids(t *testing.T, n int) []int64 {
	t.Helper()
	out := make([]int64, n)
	for i := range out {
		out[i] = s.next(t).Id
	}
	return out
}

// TestWatchTenantsAndTypes checks that a watch sends its caller's tenant's
// events only (root: every tenant's), filtered by type patterns, oldest
// first, with their content.
func TestWatchTenantsAndTypes(t *testing.T) {
	t.Parallel()
	f := setup(t)
	now := f.db.Now()
	start, otherStart, rootStart := mark(t, f.db, f.acme), mark(t, f.db, f.other), mark(t, f.db, "")
	a1 := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	o1 := insertEvent(t, f.db, nil, now, f.other, "node.cordoned")
	a2 := insertEvent(t, f.db, nil, now, f.acme, "reservation.active")
	a3 := insertEvent(t, f.db, nil, now, f.acme, "nodes.weird") // not node.*
	a4 := insertEvent(t, f.db, nil, now, f.acme, "node")        // not node.*
	a5 := insertEvent(t, f.db, nil, now, f.acme, "reservation.released")
	n1 := insertEvent(t, f.db, nil, now, "", "system.started") // no tenant: root only

	viewer := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	require.Equal(t, []int64{a1, a2, a3, a4, a5}, viewer.ids(t, 5))
	other := watch(t, f.as(f.tokens["other-member"]), &computev1.WatchRequest{AfterId: otherStart})
	require.Equal(t, o1, other.next(t).Id)
	root := watch(t, f.as(f.tokens["root"]), &computev1.WatchRequest{AfterId: rootStart})
	require.Equal(t, []int64{a1, o1, a2, a3, a4, a5, n1}, root.ids(t, 7))
	typed := watch(t, f.as(f.tokens["acme-member"]), &computev1.WatchRequest{AfterId: start,
		Types: []string{"node.*", "reservation.active"}})
	e := typed.next(t)
	require.Equal(t, a1, e.Id)
	require.Equal(t, "node.cordoned", e.Type)
	require.Equal(t, f.acme, e.TenantId)
	require.Equal(t, "sub-node.cordoned", e.SubjectId)
	require.JSONEq(t, `{"type": "node.cordoned"}`, e.DataJson)
	require.True(t, e.Time.AsTime().Equal(now))
	require.Equal(t, a2, typed.next(t).Id)

	// Live events follow; a marker after the others proves that nothing
	// else was sent in between.
	o2 := insertEvent(t, f.db, nil, now, f.other, "reservation.active")
	a6 := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	a7 := insertEvent(t, f.db, nil, now, f.acme, "reservation.active")
	require.Equal(t, []int64{a6, a7}, viewer.ids(t, 2))
	require.Equal(t, o2, other.next(t).Id)
	require.Equal(t, []int64{o2, a6, a7}, root.ids(t, 3))
	require.Equal(t, []int64{a6, a7}, typed.ids(t, 2))
	other.none(t, 1500*time.Millisecond)

	// Bad patterns are refused naming the field.
	bad := watch(t, f.as(f.tokens["root"]), &computev1.WatchRequest{Types: []string{"node.*.x"}})
	_, ok := <-bad.events
	require.False(t, ok)
	requireCode(t, <-bad.done, connect.CodeInvalidArgument, "types[0]")
}

// TestWatchOutOfOrderCommits checks that an id committed after a higher one
// is still delivered in id order, that a rolled-back id is stepped over as
// soon as its transaction ended, and that a resumed watch has no gap and no
// duplicate.
func TestWatchOutOfOrderCommits(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f = f.withServer(t, api.WatchConfig{Poll: 50 * time.Millisecond}, nil, nil)
	ctx := t.Context()
	now := f.db.Now()
	pool := f.db.Pool
	start := mark(t, f.db, f.acme)
	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})

	// A takes an id, B takes the next one and commits first.
	txA, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = txA.Rollback(ctx) }()
	a := insertEvent(t, f.db, txA, now, f.acme, "node.cordoned")
	b := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	require.Equal(t, a+1, b)
	w.none(t, time.Second) // b is held while A, running when b was read, may commit
	require.NoError(t, txA.Commit(ctx))
	require.Equal(t, []int64{a, b}, w.ids(t, 2))

	// C takes an id and rolls back after D committed: D comes once C ended,
	// long before MaxGrace (a minute).
	txC, err := pool.Begin(ctx)
	require.NoError(t, err)
	c := insertEvent(t, f.db, txC, now, f.acme, "node.cordoned")
	o := insertEvent(t, f.db, nil, now, f.other, "node.cordoned") // another tenant's: not a gap
	d := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	require.Equal(t, []int64{c + 1, c + 2}, []int64{o, d})
	w.none(t, 500*time.Millisecond)
	require.NoError(t, txC.Rollback(ctx))
	began := clock.New().Now()
	require.Equal(t, d, w.next(t).Id)
	require.Less(t, clock.Since(clock.New(), began), 5*time.Second)

	// A resumed watch: after each id, exactly what followed it.
	all := []int64{a, b, d}
	for i, after := range all {
		r := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: after})
		require.Equal(t, all[i+1:], r.ids(t, len(all)-i-1), "after %d", after)
		e := insertEvent(t, f.db, nil, now, f.acme, "marker")
		require.Equal(t, e, r.next(t).Id, "after %d: nothing between", after)
		all = append(all, e)
		r.cancel()
	}
}

// TestWatchMaxGrace checks that a transaction holding an id past MaxGrace
// does not stall the watch for ever.
func TestWatchMaxGrace(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f = f.withServer(t, api.WatchConfig{Poll: 50 * time.Millisecond, MaxGrace: 700 * time.Millisecond}, nil, nil)
	ctx := t.Context()
	now := f.db.Now()
	start := mark(t, f.db, "")
	w := watch(t, f.as(f.tokens["root"]), &computev1.WatchRequest{AfterId: start})
	tx, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	insertEvent(t, f.db, tx, now, f.acme, "stuck")
	later := insertEvent(t, f.db, nil, now, f.acme, "later")
	w.none(t, 400*time.Millisecond)
	require.Equal(t, later, w.next(t).Id)
}

// insertOld writes an event like insertEvent, inserted age ago by the
// database's clock (events.inserted_at): history, as a watch replaying it
// sees it.
func insertOld(t *testing.T, db *store.DB, tenant, typ string, age time.Duration) int64 {
	t.Helper()
	return storetest.Event(t, db, &storetest.EventOpts{TenantID: tenant, NoTenant: tenant == "", Type: typ,
		SubjectID: "sub-" + typ, Data: `{"type": "` + typ + `"}`, Age: age})
}

// gap takes an event id in a transaction that rolls back: a gap in the ids
// that never fills.
func gap(t *testing.T, db *store.DB) int64 {
	t.Helper()
	ctx := t.Context()
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	id := insertEvent(t, db, tx, db.Now(), "", "rolled.back")
	require.NoError(t, tx.Rollback(ctx))
	return id
}

// history writes n events of tenant inserted age ago, with 1, 2, … n
// rolled-back ids before them (and an event of other after each: not a
// gap), and returns the ids of tenant's events.
func history(t *testing.T, db *store.DB, tenant, other string, n int, age time.Duration) []int64 {
	t.Helper()
	var ids []int64
	for i := range n {
		for range i + 1 {
			gap(t, db)
		}
		ids = append(ids, insertOld(t, db, tenant, "node.cordoned", age))
		insertOld(t, db, other, "node.cordoned", age)
	}
	return ids
}

// TestWatchReplaysHistory checks that a watch replaying history with gaps
// in the ids (rolled-back inserts) and other tenants' events between its
// own delivers them without waiting out a grace: the server's clock here
// never moves, so a hold could only pass by the horizon, checked at each
// wake. A new gap, whose transaction has ended, does not hold the next
// event either.
func TestWatchReplaysHistory(t *testing.T) {
	t.Parallel()
	f := setup(t)
	nc := natsConn(t)
	f = f.withServer(t, api.WatchConfig{}, nc, clock.NewFake(f.db.Now()))
	start := mark(t, f.db, f.acme)
	want := history(t, f.db, f.acme, f.other, 4, 2*time.Hour)
	// The transactions of parallel tests may be running at a read; the
	// watch checks the horizon again at a wake (the relay's publication
	// after a commit), as its re-check timer and its poll never fire on
	// this clock.
	nudge(t, nc, store.SubjectEvents+"."+f.acme+".test.nudge")
	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	require.Equal(t, want, w.ids(t, len(want)))

	gap(t, f.db)
	next := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.uncordoned")
	require.Equal(t, next, w.next(t).Id)
}

// TestWatchRechecksHeldGaps checks that events are held while a
// transaction that was running when the watch read them, and wrote events,
// has not ended, and that the watch delivers them soon after that
// transaction ends, by its re-check timer (WatchConfig.GapRecheck): the
// poll is an hour away and no NATS wakes it. A transaction that never
// touched events holds nothing.
func TestWatchRechecksHeldGaps(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f = f.withServer(t, api.WatchConfig{Poll: time.Hour}, nil, nil)
	ctx := t.Context()
	start := mark(t, f.db, f.acme)
	want := history(t, f.db, f.acme, f.other, 4, 2*time.Hour)
	running, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = running.Rollback(ctx) }()
	// It wrote an event (another tenant's, which acme's watch cannot tell):
	// it may write acme's too until it ends.
	insertEvent(t, f.db, running, f.db.Now(), f.other, "node.cordoned")
	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	w.none(t, 300*time.Millisecond)
	require.NoError(t, running.Rollback(ctx))
	require.Equal(t, want, w.ids(t, len(want)))

	idle, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = idle.Rollback(ctx) }()
	require.NoError(t, idle.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(new(string)), "a transaction id")
	next := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.uncordoned")
	fresh := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: want[len(want)-1]})
	require.Equal(t, next, fresh.next(t).Id, "delivered at once: the open transaction never wrote an event")
}

// nudge publishes an empty message on subject every 20 ms until the test
// ends.
func nudge(t *testing.T, nc *nats.Conn, subject string) {
	t.Helper()
	done, stopped := make(chan struct{}), make(chan struct{})
	ticker := clock.New().NewTicker(20 * time.Millisecond)
	go func() {
		defer close(stopped)
		defer ticker.Stop()
		for {
			select {
			case <-done:
				return
			case <-ticker.C():
				_ = nc.Publish(subject, nil)
			}
		}
	}()
	t.Cleanup(func() {
		close(done)
		<-stopped
	})
}

// natsConn starts an in-process NATS server and returns a connection to it,
// both closed when the test ends.
func natsConn(t *testing.T) *nats.Conn {
	t.Helper()
	ns, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(ns.Shutdown)
	nc, err := nats.Connect(ns.ClientURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// TestWatchWakesOnNATS checks that an event published on bc.events wakes a
// watch whose poll never fires (a clock that does not move), and that a
// cancelled watch leaves no subscription behind.
func TestWatchWakesOnNATS(t *testing.T) {
	t.Parallel()
	f := setup(t)
	nc := natsConn(t)
	f = f.withServer(t, api.WatchConfig{}, nc, clock.NewFake(f.db.Now()))
	now := f.db.Now()
	start := mark(t, f.db, f.acme)
	// The server's own subscription (token revocations) is there already.
	server := nc.NumSubscriptions()
	// The watch's first read finds this one without a wake; once it has
	// been received the watch waits, with no wake pending, for the next.
	first := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	subscribed := func(n int) func() bool { return func() bool { return nc.NumSubscriptions() == server+n } }
	require.Eventually(t, subscribed(1), 10*time.Second, 10*time.Millisecond, "the watch subscribes")
	require.Equal(t, first, w.next(t).Id)
	// Another tenant's subject does not wake acme's watch.
	second := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	require.NoError(t, nc.Publish(store.SubjectEvents+"."+f.other+".node.cordoned", []byte("{}")))
	w.none(t, 300*time.Millisecond)
	require.NoError(t, nc.Publish(store.SubjectEvents+"."+f.acme+".node.uncordoned", []byte("{}")))
	require.Equal(t, second, w.next(t).Id)
	// And every wake of its own tenant does.
	third := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	require.NoError(t, nc.Publish(store.SubjectEvents+"."+f.acme+".node.cordoned", []byte("{}")))
	require.Equal(t, third, w.next(t).Id)
	w.cancel()
	require.Eventually(t, subscribed(0), 10*time.Second, 10*time.Millisecond, "an ended watch unsubscribes")
}

// TestWatchWakesOnCommitHint checks that a commit that writes events wakes
// the watches of their tenant through the hint its writer publishes after
// the commit (store.DB.PokeVia on NATS), with no outbox relay running and a
// clock that never moves (no poll): a cordon's node.cordoned reaches acme's
// watch, and its outbox holds no copy of the event.
func TestWatchWakesOnCommitHint(t *testing.T) {
	t.Parallel()
	f := setup(t)
	nc := natsConn(t)
	f.db.PokeVia(bus.PublishWithID(nc, store.OutboxIDHeader))
	f = f.withServer(t, api.WatchConfig{}, nc, clock.NewFake(f.db.Now()))
	ctx := t.Context()
	node := f.node(t, f.acmePool, 1, "H100", storetest.NodeOpts{State: store.NodeAdopted})
	start := mark(t, f.db, f.acme)
	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	w.none(t, 300*time.Millisecond) // caught up: it waits for a wake
	require.NoError(t, f.db.InTx(ctx, func(tx pgx.Tx) error {
		_, err := store.CordonNode(ctx, tx, store.AllTenants, f.db.Now(), node, "fan noise")
		return err
	}))
	e := w.next(t)
	require.Equal(t, store.EventNodeCordoned, e.Type)
	require.Equal(t, node, e.SubjectId)
	var outboxed int
	require.NoError(t, f.db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE subject LIKE 'bc.events.%'`).Scan(&outboxed))
	require.Zero(t, outboxed, "the event's only message is its hint")
}

// TestWatchEnds checks that a watch ends with no error when its client
// cancels, and with Unavailable when the server stops.
func TestWatchEnds(t *testing.T) {
	t.Parallel()
	f := setup(t)
	var logs syncbuf.Buffer
	srv, err := api.New(api.Config{}, api.Deps{DB: f.db, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	f.url = ts.URL
	// A cancelled watch ends on the server too: ts.Close waits for it, and
	// goleak (TestMain) finds its goroutine otherwise.
	c := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{})
	c.cancel()
	require.Equal(t, connect.CodeCanceled, connect.CodeOf(<-c.done), "the client's own view")

	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{})
	srv.StopWatches()
	err = <-w.done
	requireCode(t, err, connect.CodeUnavailable, "resume after the last event id")
	ts.Close() // waits for the handlers
	require.NotContains(t, logs.String(), "internal error", "a watch that ended well is not an error")
}

// TestWatchHTTP checks GET /api/compute/watch: NDJSON lines with the same
// semantics as Watch, from now when after is absent, and JSON refusals.
func TestWatchHTTP(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	now := f.db.Now()
	get := func(ctx context.Context, token string, q url.Values) *http.Response {
		return f.getWatch(ctx, t, token, q)
	}
	refused := func(token string, q url.Values, status int, code, contains string) {
		t.Helper()
		f.refusedWatch(t, token, q, status, code, contains)
	}
	refused("", nil, http.StatusUnauthorized, "unauthenticated", "missing bearer token")
	refused("bct_nope", nil, http.StatusUnauthorized, "unauthenticated", "")
	refused(f.tokens["acme-viewer"], url.Values{"after": {"x"}}, http.StatusBadRequest, "invalid_argument", "after:")
	// The route's own parameter names, not the request message's (after_id).
	refused(f.tokens["acme-viewer"], url.Values{"after": {"-1"}}, http.StatusBadRequest, "invalid_argument", "after: want")
	refused(f.tokens["acme-viewer"], url.Values{"after": {"1", "2"}}, http.StatusBadRequest, "invalid_argument",
		"after: given more than once")
	refused(f.tokens["acme-viewer"], url.Values{"from_start": {"true", "false"}}, http.StatusBadRequest, "invalid_argument",
		"from_start: given more than once")
	refused(f.tokens["acme-viewer"], url.Values{"types": {"node.*,Bad"}}, http.StatusBadRequest, "invalid_argument",
		"types[1]")

	mark(t, f.db, f.acme)
	old := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	// No after: from now. The headers come once the watch has its cursor.
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	res := get(sctx, f.tokens["acme-viewer"], url.Values{"types": {"node.*,reservation.active"}})
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, "application/x-ndjson", res.Header.Get("Content-Type"))
	cursor, err := strconv.ParseInt(res.Header.Get(api.WatchCursorHeader), 10, 64)
	require.NoError(t, err, "the watch names where \"now\" was")
	require.GreaterOrEqual(t, cursor, old)
	insertEvent(t, f.db, nil, now, f.acme, "reservation.released")
	insertEvent(t, f.db, nil, now, f.other, "node.cordoned")
	e1 := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	e2 := insertEvent(t, f.db, nil, now, f.acme, "reservation.active")
	lines := bufio.NewScanner(res.Body)
	var got []map[string]any
	for range 2 {
		require.True(t, lines.Scan(), "a line: %v", lines.Err())
		var m map[string]any
		require.NoError(t, json.Unmarshal(lines.Bytes(), &m), lines.Text())
		got = append(got, m)
	}
	require.Equal(t, map[string]any{"id": float64(e1), "type": "node.uncordoned", "tenantId": f.acme,
		"subjectId": "sub-node.uncordoned", "data": map[string]any{"type": "node.uncordoned"},
		"time": now.UTC().Format(time.RFC3339Nano)}, got[0])
	require.Equal(t, float64(e2), got[1]["id"])

	// Resuming after old: the same events, none before.
	res2 := get(sctx, f.tokens["acme-viewer"], url.Values{"after": {strconv.FormatInt(old-1, 10)}, "types": {"node.*"}})
	defer res2.Body.Close()
	require.Equal(t, strconv.FormatInt(old-1, 10), res2.Header.Get(api.WatchCursorHeader), "the after asked for")
	lines2 := bufio.NewScanner(res2.Body)
	var ids []float64
	for range 2 {
		require.True(t, lines2.Scan())
		var m map[string]any
		require.NoError(t, json.Unmarshal(lines2.Bytes(), &m))
		ids = append(ids, m["id"].(float64))
	}
	require.Equal(t, []float64{float64(old), float64(e1)}, ids)
}

// getWatch sends GET WatchPath?q with token ("" sends none) and returns the
// response once its headers have come; the caller closes its body.
func (f *fixture) getWatch(ctx context.Context, t *testing.T, token string, q url.Values) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.url+api.WatchPath+"?"+q.Encode(), nil)
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	return res
}

// refusedWatch checks that GET WatchPath?q with token is refused with
// status and a JSON error of code whose message contains contains.
func (f *fixture) refusedWatch(t *testing.T, token string, q url.Values, status int, code, contains string) {
	t.Helper()
	res := f.getWatch(t.Context(), t, token, q)
	defer res.Body.Close()
	require.Equal(t, status, res.StatusCode)
	require.Equal(t, "application/json", res.Header.Get("Content-Type"))
	var body map[string]string
	require.NoError(t, json.NewDecoder(res.Body).Decode(&body))
	require.Equal(t, code, body["code"])
	require.Contains(t, body["message"], contains)
}

// ndjsonIDs reads the ids of the next n lines of an NDJSON watch.
func ndjsonIDs(t *testing.T, lines *bufio.Scanner, n int) []int64 {
	t.Helper()
	var ids []int64
	for range n {
		require.True(t, lines.Scan(), "a line: %v", lines.Err())
		var m struct {
			ID *int64 `json:"id"`
		}
		require.NoError(t, json.Unmarshal(lines.Bytes(), &m), lines.Text())
		require.NotNil(t, m.ID, "an event, not an error: %s", lines.Text())
		ids = append(ids, *m.ID)
	}
	return ids
}

// TestWatchHTTPRepeatedTypes checks that every types parameter of GET
// WatchPath counts, each a comma-separated list: the watch takes the union.
func TestWatchHTTPRepeatedTypes(t *testing.T) {
	t.Parallel()
	f := setup(t)
	now := f.db.Now()
	start := mark(t, f.db, f.acme)
	a := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	insertEvent(t, f.db, nil, now, f.acme, "pool.created") // in no list
	b := insertEvent(t, f.db, nil, now, f.acme, "reservation.active")
	c := insertEvent(t, f.db, nil, now, f.acme, "command.succeeded")
	insertEvent(t, f.db, nil, now, f.acme, "reservation.released") // in no list
	d := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	end := insertEvent(t, f.db, nil, now, f.acme, "node.end") // the last line
	res := f.getWatch(t.Context(), t, f.tokens["acme-viewer"], url.Values{"after": {strconv.FormatInt(start, 10)},
		"types": {"node.*", "reservation.active, command.*", ""}})
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	lines := bufio.NewScanner(res.Body)
	var got []int64
	for id := int64(0); id != end; {
		id = ndjsonIDs(t, lines, 1)[0]
		got = append(got, id)
	}
	require.Equal(t, []int64{a, b, c, d, end}, got)
	f.refusedWatch(t, f.tokens["acme-viewer"], url.Values{"types": {"node.*", "x,Bad"}}, http.StatusBadRequest,
		"invalid_argument", "types[2]")
}

// TestWatchFromStart checks that a watch with from_start replays every
// retained event, oldest first (the ids below the first one, deleted, are a
// gap like any other), then goes on live; and that from_start with a
// non-zero after_id is refused naming from_start.
func TestWatchFromStart(t *testing.T) {
	t.Parallel()
	f := setup(t)
	f = f.withServer(t, api.WatchConfig{Poll: 50 * time.Millisecond}, nil, nil)
	pool, now := f.db.Pool, f.db.Now()
	deleted := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	a1 := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	insertEvent(t, f.db, nil, now, f.other, "node.cordoned")
	a2 := insertEvent(t, f.db, nil, now, f.acme, "reservation.active")
	_, err := pool.Exec(t.Context(), `DELETE FROM events WHERE id = $1`, deleted) // retention
	require.NoError(t, err)

	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{FromStart: true})
	require.Equal(t, []int64{a1, a2}, w.ids(t, 2))
	live := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	require.Equal(t, live, w.next(t).Id)

	bad := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{FromStart: true, AfterId: a1})
	_, ok := <-bad.events
	require.False(t, ok)
	requireCode(t, <-bad.done, connect.CodeInvalidArgument, "from_start")
	require.NoError(t, firstEvent(t.Context(), f.as(f.tokens["acme-viewer"]),
		&computev1.WatchRequest{FromStart: true, AfterId: 0}), "after_id 0 is no after_id")
}

// TestWatchHTTPFromStart checks GET WatchPath?from_start=true: every
// retained event, the Bc-Watch-After header 0; and its refusals.
func TestWatchHTTPFromStart(t *testing.T) {
	t.Parallel()
	f := setup(t)
	now := f.db.Now()
	a1 := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	insertEvent(t, f.db, nil, now, f.other, "node.cordoned")
	a2 := insertEvent(t, f.db, nil, now, f.acme, "reservation.active")
	viewer := f.tokens["acme-viewer"]
	f.refusedWatch(t, viewer, url.Values{"from_start": {"yes"}}, http.StatusBadRequest, "invalid_argument", "from_start:")
	f.refusedWatch(t, viewer, url.Values{"from_start": {""}}, http.StatusBadRequest, "invalid_argument", "from_start:")
	f.refusedWatch(t, viewer, url.Values{"from_start": {"true"}, "after": {strconv.FormatInt(a1, 10)}},
		http.StatusBadRequest, "invalid_argument", "from_start: cannot be combined with after=")

	res := f.getWatch(t.Context(), t, viewer, url.Values{"from_start": {"true"}, "after": {"0"}})
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, "0", res.Header.Get(api.WatchCursorHeader))
	lines := bufio.NewScanner(res.Body)
	require.Equal(t, []int64{a1, a2}, ndjsonIDs(t, lines, 2))
	live := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	require.Equal(t, []int64{live}, ndjsonIDs(t, lines, 1))

	// from_start=false is a watch from now.
	fromNow := f.getWatch(t.Context(), t, viewer, url.Values{"from_start": {"false"}})
	defer fromNow.Body.Close()
	require.Equal(t, http.StatusOK, fromNow.StatusCode)
	require.Equal(t, strconv.FormatInt(live, 10), fromNow.Header.Get(api.WatchCursorHeader))
}

// TestScanEvents checks that a scan returns its scope's events passing the
// filter only, across a rolled-back insert's gap and other tenants' and
// types' events, with their content, up to its limit, in agreement with
// EventFilter.Matches.
func TestScanEvents(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	var gap int64
	err := f.db.InTx(ctx, func(tx pgx.Tx) error {
		gap = insertEvent(t, f.db, tx, f.db.Now(), f.acme, "x")
		return context.Canceled
	})
	require.ErrorIs(t, err, context.Canceled)
	next := insertEvent(t, f.db, nil, f.db.Now().Add(-24*time.Hour), f.acme, "y.z")
	foreign := insertEvent(t, f.db, nil, f.db.Now(), f.other, "y.z")
	untyped := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "yy")
	last := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "y.w")
	require.Equal(t, []int64{gap + 1, gap + 2, gap + 3, gap + 4}, []int64{next, foreign, untyped, last})
	filter := store.EventFilter{Scope: store.TenantScope(f.acme), Types: []string{"y.*"}}
	scan, err := store.ScanEvents(ctx, f.db.AutoCommit(), gap-1, filter, 10)
	require.NoError(t, err)
	require.Len(t, scan.Events, 2)
	require.Equal(t, store.Event{ID: next, TenantID: f.acme, Type: "y.z", SubjectID: "sub-y.z", Data: scan.Events[0].Data,
		CreatedAt: scan.Events[0].CreatedAt}, scan.Events[0])
	require.JSONEq(t, `{"type": "y.z"}`, string(scan.Events[0].Data))
	require.Equal(t, last, scan.Events[1].ID)
	for id, e := range map[int64]store.Event{next: {TenantID: f.acme, Type: "y.z"}, foreign: {TenantID: f.other, Type: "y.z"},
		untyped: {TenantID: f.acme, Type: "yy"}, last: {TenantID: f.acme, Type: "y.w"}} {
		require.Equal(t, id == next || id == last, filter.Matches(e), "EventFilter.Matches agrees with the SQL: %d", id)
	}
	scan, err = store.ScanEvents(ctx, f.db.AutoCommit(), gap-1, filter, 1)
	require.NoError(t, err)
	require.Len(t, scan.Events, 1, "limit")
	scan, err = store.ScanEvents(ctx, f.db.AutoCommit(), gap-1, store.EventFilter{Scope: store.AllTenants}, 10)
	require.NoError(t, err)
	require.Len(t, scan.Events, 4, "every tenant's for AllTenants")
}

// firstEvent calls Watch(req) and returns nil once an event arrives, or the
// error the stream ended with.
func firstEvent(ctx context.Context, c clients, req *computev1.WatchRequest) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.events.Watch(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	defer stream.Close()
	if stream.Receive() {
		return nil
	}
	if err := stream.Err(); err != nil {
		return err
	}
	return errors.New("the watch ended without an event")
}

// TestWatchRefusesAfterBeyondNewest checks that a watch after an id above
// the newest committed event id, which no watch ever sent, is refused on
// both paths, naming the field and the newest id, rather than accepted to
// wait for ever; after the newest id itself, from now and from the start
// are accepted, also when there is no event at all.
func TestWatchRefusesAfterBeyondNewest(t *testing.T) {
	t.Parallel()
	f := setup(t)
	viewer := f.tokens["acme-viewer"]
	c := f.as(viewer)

	// No event yet: any after is beyond the newest (0).
	empty := watch(t, c, &computev1.WatchRequest{AfterId: 1})
	requireCode(t, empty.refusal(t), connect.CodeInvalidArgument, "after_id: 1 is above the newest event id, 0")
	f.refusedWatch(t, viewer, url.Values{"after": {"1"}}, http.StatusBadRequest, "invalid_argument",
		"after: 1 is above the newest event id, 0")
	fromNow := f.getWatch(t.Context(), t, viewer, url.Values{"after": {"0"}})
	defer fromNow.Body.Close()
	require.Equal(t, http.StatusOK, fromNow.StatusCode, "after=0 is from now")
	require.Equal(t, "0", fromNow.Header.Get(api.WatchCursorHeader))

	newest := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.cordoned")
	beyond := strconv.FormatInt(newest+1, 10)
	bad := watch(t, c, &computev1.WatchRequest{AfterId: newest + 1})
	requireCode(t, bad.refusal(t), connect.CodeInvalidArgument,
		"after_id: "+beyond+" is above the newest event id, "+strconv.FormatInt(newest, 10))
	f.refusedWatch(t, viewer, url.Values{"after": {"99999999"}}, http.StatusBadRequest, "invalid_argument",
		"after: 99999999 is above the newest event id, "+strconv.FormatInt(newest, 10))
	f.refusedWatch(t, viewer, url.Values{"after": {beyond}, "types": {"node.*"}}, http.StatusBadRequest,
		"invalid_argument", "after: "+beyond)

	// After the newest id: accepted, and the next event comes.
	atNewest := watch(t, c, &computev1.WatchRequest{AfterId: newest})
	res := f.getWatch(t.Context(), t, viewer, url.Values{"after": {strconv.FormatInt(newest, 10)}})
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	fromStart := watch(t, c, &computev1.WatchRequest{FromStart: true})
	require.Equal(t, newest, fromStart.next(t).Id)
	next := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.uncordoned")
	require.Equal(t, next, atNewest.next(t).Id)
	require.Equal(t, []int64{next}, ndjsonIDs(t, bufio.NewScanner(res.Body), 1))
	require.Equal(t, next, fromStart.next(t).Id)
}

// TestWatchRefusesUnknownTypes checks that a type pattern that matches
// none of the event types the control plane writes is refused on both
// paths, naming its index and the families; empty entries of the NDJSON
// path's comma-separated lists are dropped (not counted), and types= alone
// watches every type.
func TestWatchRefusesUnknownTypes(t *testing.T) {
	t.Parallel()
	f := setup(t)
	viewer := f.tokens["acme-viewer"]
	c := f.as(viewer)
	start := mark(t, f.db, f.acme)
	after := strconv.FormatInt(start, 10)

	for types, field := range map[string]string{"bogus": "types[0]", "node.*,bogus.*": "types[1]",
		"node.cordon": "types[0]", "reservation.active,node.acceptance.*": "types[1]"} {
		bad := watch(t, c, &computev1.WatchRequest{AfterId: start, Types: strings.Split(types, ",")})
		err := bad.refusal(t)
		requireCode(t, err, connect.CodeInvalidArgument, field+": ")
		requireCode(t, err, connect.CodeInvalidArgument, "matches no event type")
		requireCode(t, err, connect.CodeInvalidArgument, "command.*, node.*, reservation.*")
		f.refusedWatch(t, viewer, url.Values{"after": {after}, "types": {types}}, http.StatusBadRequest,
			"invalid_argument", field+": ")
	}
	f.refusedWatch(t, viewer, url.Values{"types": {"node.*,,bogus"}}, http.StatusBadRequest, "invalid_argument",
		`types[1]: "bogus" matches no event type`)
	f.refusedWatch(t, viewer, url.Values{"types": {"node.*", "", "x.*"}}, http.StatusBadRequest, "invalid_argument",
		`types[1]: "x.*" matches no event type`)

	// Empty entries are dropped; types= alone is every type.
	node := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.cordoned")
	cmd := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "command.succeeded")
	res := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "reservation.active")
	some := f.getWatch(t.Context(), t, viewer, url.Values{"after": {after}, "types": {"node.*,,reservation.*,"}})
	defer some.Body.Close()
	require.Equal(t, http.StatusOK, some.StatusCode)
	require.Equal(t, []int64{node, res}, ndjsonIDs(t, bufio.NewScanner(some.Body), 2))
	all := f.getWatch(t.Context(), t, viewer, url.Values{"after": {after}, "types": {""}})
	defer all.Body.Close()
	require.Equal(t, http.StatusOK, all.StatusCode)
	require.Equal(t, []int64{node, cmd, res}, ndjsonIDs(t, bufio.NewScanner(all.Body), 3))
	w := watch(t, c, &computev1.WatchRequest{AfterId: start, Types: []string{"node.cordoned", "command.*"}})
	require.Equal(t, []int64{node, cmd}, w.ids(t, 2))
}

// TestWatchHoldEndsAtCommitPoke checks that events held for a transaction
// running at the read are delivered once it commits, at the hint a commit
// that wrote events publishes (store.SubjectEvents), here another tenant's,
// with a clock that never moves (no re-check timer, no poll) and no wake on
// the tenant's events: in id order, the lower id committed last included
// (no gap, no duplicate), and that hints while it runs deliver nothing past
// it.
func TestWatchHoldEndsAtCommitPoke(t *testing.T) {
	t.Parallel()
	f := setup(t)
	nc := natsConn(t)
	f = f.withServer(t, api.WatchConfig{}, nc, clock.NewFake(f.db.Now()))
	ctx := t.Context()
	now := f.db.Now()
	start := mark(t, f.db, f.acme)

	// A takes an id and runs; B takes the next one and commits first.
	txA, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = txA.Rollback(ctx) }()
	a := insertEvent(t, f.db, txA, now, f.acme, "node.cordoned")
	b := insertEvent(t, f.db, nil, now, f.acme, "node.uncordoned")
	require.Equal(t, a+1, b)
	// Other tenants' commits' hints (and those of parallel tests'
	// transactions, which a read may find running) arrive all the time.
	nudge(t, nc, store.SubjectEvents+"."+f.other+".node.cordoned")
	w := watch(t, f.as(f.tokens["acme-viewer"]), &computev1.WatchRequest{AfterId: start})
	w.none(t, 300*time.Millisecond) // b is held while A may commit a
	require.NoError(t, txA.Commit(ctx))
	require.Equal(t, []int64{a, b}, w.ids(t, 2))

	// Another tenant's transaction, running at the read, holds acme's
	// next event until it ends, which it does by rolling back here.
	txO, err := f.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = txO.Rollback(ctx) }()
	insertEvent(t, f.db, txO, now, f.other, "node.cordoned")
	c := insertEvent(t, f.db, nil, now, f.acme, "node.cordoned")
	require.NoError(t, nc.Publish(store.SubjectEvents+"."+f.acme+".node.cordoned", []byte("{}")))
	w.none(t, 300*time.Millisecond)
	require.NoError(t, txO.Rollback(ctx))
	require.Equal(t, c, w.next(t).Id)
	w.none(t, 100*time.Millisecond)
}
