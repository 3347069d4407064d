package store_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
)

func outboxSubjects(t *testing.T, msgs []store.OutboxMessage) []string {
	t.Helper()
	out := make([]string, 0, len(msgs))
	for i, m := range msgs {
		if i > 0 {
			require.Less(t, msgs[i-1].ID, m.ID, "ordered by id")
		}
		out = append(out, m.Subject)
	}
	return out
}

// TestTakeOutbox: TakeOutbox deletes the oldest rows, skips the rows another
// transaction took, and a rollback puts the rows back.
func TestTakeOutbox(t *testing.T) {
	db := storetest.New(t, nil)
	ctx := t.Context()

	none, err := store.TakeOutbox(ctx, db.Pool, 0, 10)
	require.NoError(t, err)
	require.Empty(t, none)

	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		for _, s := range []string{"t.1", "t.2", "t.3", "t.4", "t.5"} {
			if err := store.Enqueue(ctx, tx, db.Now(), s, []byte(s)); err != nil {
				return err
			}
		}
		return nil
	}))

	a, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = a.Rollback(ctx) }()
	got, err := store.TakeOutbox(ctx, a, 0, 2)
	require.NoError(t, err)
	require.Equal(t, []string{"t.1", "t.2"}, outboxSubjects(t, got), "the oldest first")
	require.Equal(t, "t.1", string(got[0].Payload))

	// Another relay skips the rows a holds.
	b, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = b.Rollback(ctx) }()
	got, err = store.TakeOutbox(ctx, b, 0, 10)
	require.NoError(t, err)
	require.Equal(t, []string{"t.3", "t.4", "t.5"}, outboxSubjects(t, got))

	// A failed publish rolls back: the rows are there again.
	require.NoError(t, b.Rollback(ctx))
	require.NoError(t, a.Rollback(ctx))
	require.Equal(t, 5, countRows(t, db, `SELECT count(*) FROM outbox`))

	// Rows at or below after are left.
	var third int64
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT id FROM outbox ORDER BY id OFFSET 2 LIMIT 1`).Scan(&third))
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		got, err = store.TakeOutbox(ctx, tx, third, 10)
		return err
	}))
	require.Equal(t, []string{"t.4", "t.5"}, outboxSubjects(t, got), "only the ids above after")
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		got, err = store.TakeOutbox(ctx, tx, 0, 10)
		return err
	}))
	require.Equal(t, []string{"t.1", "t.2", "t.3"}, outboxSubjects(t, got))
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM outbox`), "taken rows are gone once committed")
}

// TestSignalOutboxVia: a commit that wrote outbox rows calls the signal
// instead of sending a NOTIFY; a rolled-back one calls nothing; when the
// signal fails, the NOTIFY goes out as before.
func TestSignalOutboxVia(t *testing.T) {
	db := storetest.New(t, nil)
	ctx := t.Context()
	listener, err := pgx.Connect(ctx, db.Pool.Config().ConnString())
	require.NoError(t, err)
	t.Cleanup(func() { _ = listener.Close(context.WithoutCancel(ctx)) })
	_, err = listener.Exec(ctx, "LISTEN "+store.OutboxChannel)
	require.NoError(t, err)
	notified := func(within time.Duration) bool {
		wctx, cancel := context.WithTimeout(ctx, within)
		defer cancel()
		_, err := listener.WaitForNotification(wctx)
		return err == nil
	}

	var calls atomic.Int64
	fail := atomic.Bool{}
	db.SignalOutboxVia(func() error {
		calls.Add(1)
		if fail.Load() {
			return errors.New("nats: connection closed")
		}
		return nil
	})
	enqueue := func(rollback bool) {
		t.Helper()
		err := db.InTx(ctx, func(tx pgx.Tx) error {
			if err := store.Enqueue(ctx, tx, db.Now(), "test.x", nil); err != nil {
				return err
			}
			if rollback {
				return errRollback
			}
			return nil
		})
		if rollback {
			require.ErrorIs(t, err, errRollback)
		} else {
			require.NoError(t, err)
		}
	}

	enqueue(true)
	require.Zero(t, calls.Load(), "a rollback signals nothing")
	enqueue(false)
	require.Equal(t, int64(1), calls.Load())
	fail.Store(true)
	enqueue(false)
	require.Equal(t, int64(2), calls.Load())
	require.True(t, notified(10*time.Second), "the failed signal falls back to NOTIFY")
}

var errRollback = errors.New("roll back")

// TestPokeVia: a transaction of InTx that enqueued a scheduler poke
// publishes it directly, once however many times it was enqueued, after it
// has committed — when the poke is sent the reservation is visible to
// another connection — and keeps the outbox row for the relay; a placement
// publishes its node's gateway poke too. A rollback publishes nothing, and
// neither does a transaction that only enqueued other messages. The
// gateway poke names its outbox row (so that a gateway drops the relay's
// copy); the scheduler's names none.
func TestPokeVia(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, nil)
	ctx := t.Context()
	f := storetest.NewFleetWith(t, db, storetest.FleetOpts{Name: "pokevia", GPUs: []int{8},
		Node: func(_ int, o *storetest.NodeOpts) { o.GatewayID = "gw-pokevia" }})
	tenant := f.Tenant(t, "pokevia-tenant", 8)
	type poke struct {
		subject, payload string
		// pending is how many pending reservations another connection saw
		// when the poke was published.
		pending int
		// row is the outbox row the poke names (0: none).
		row int64
	}
	var (
		mu    sync.Mutex
		pokes []poke
	)
	db.PokeVia(func(subject string, payload []byte, row int64) error {
		var n int
		if err := db.Pool.QueryRow(context.WithoutCancel(ctx),
			`SELECT count(*) FROM reservations WHERE state = 'pending'`).Scan(&n); err != nil {
			return err
		}
		// The payload as compact JSON: what it says, not its spacing.
		var compact bytes.Buffer
		if len(payload) > 0 {
			if err := json.Compact(&compact, payload); err != nil {
				return err
			}
		}
		mu.Lock()
		defer mu.Unlock()
		pokes = append(pokes, poke{subject: subject, payload: compact.String(), pending: n, row: row})
		return nil
	})
	taken := func() []poke {
		mu.Lock()
		defer mu.Unlock()
		out := pokes
		pokes = nil
		return out
	}
	outbox := func(subject string) int {
		var n int
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE subject = $1`, subject).Scan(&n))
		return n
	}

	err := db.InTx(ctx, func(tx pgx.Tx) error {
		if err := store.Enqueue(ctx, tx, db.Now(), store.SubjectPokeScheduler, nil); err != nil {
			return err
		}
		return errRollback
	})
	require.ErrorIs(t, err, errRollback)
	require.Empty(t, taken(), "a rollback pokes nothing")
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		return store.Enqueue(ctx, tx, db.Now(), "test.other", nil)
	}))
	require.Empty(t, taken(), "only pokes are published directly")
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		for range 3 {
			if err := store.Enqueue(ctx, tx, db.Now(), store.SubjectPokeScheduler, nil); err != nil {
				return err
			}
		}
		return nil
	}))
	require.Equal(t, []poke{{subject: store.SubjectPokeScheduler}}, taken(), "one scheduler poke per transaction")

	r, err := f.Reserve(ctx, tenant, 2, time.Hour)
	require.NoError(t, err)
	require.Equal(t, []poke{{subject: store.SubjectPokeScheduler, pending: 1},
		{subject: store.SubjectEvents + "." + tenant + "." + store.EventReservationCreated, pending: 1}}, taken(),
		"Reserve's commit pokes the scheduler, and hints its event, after the commit")
	require.Equal(t, 4, outbox(store.SubjectPokeScheduler), "the outbox rows stay for the relay")

	now := db.Now()
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		placed, err := store.PlaceReservations(ctx, tx, nil, now, []store.Placement{{ReservationID: r.ID, TenantID: tenant,
			NodeID: f.Nodes[0], Devices: []int32{0, 1}, Lower: now, Upper: r.EndAt}})
		require.Equal(t, []string{r.ID}, placed)
		return err
	}))
	var row int64
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT id FROM outbox WHERE subject = $1`,
		store.SubjectPokeGatewayPrefix+"gw-pokevia").Scan(&row))
	require.Equal(t, []poke{{subject: store.SubjectPokeGatewayPrefix + "gw-pokevia",
		payload: `{"nodeIds":["` + f.Nodes[0] + `"]}`, row: row},
		{subject: store.SubjectEvents + "." + tenant + "." + store.EventReservationBound}}, taken(),
		"the placement pokes the node's gateway, and hints its event, after the commit")
	require.Equal(t, 1, outbox(store.SubjectPokeGatewayPrefix+"gw-pokevia"), "the outbox row stays for the relay")
}

// TestGenericPlanConnections: AutoCommit and InGenericTx run on the
// connections that plan prepared statements generically (the hot paths'
// batched statements and the relay's take were re-planned on every
// execution otherwise); InTx keeps Postgres's choice.
func TestGenericPlanConnections(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	ctx := t.Context()
	show := func(q store.DBTX) string {
		var mode string
		require.NoError(t, q.QueryRow(ctx, `SHOW plan_cache_mode`).Scan(&mode))
		return mode
	}
	require.Equal(t, "force_generic_plan", show(db.AutoCommit()))
	require.NoError(t, db.InGenericTx(ctx, func(tx pgx.Tx) error {
		require.Equal(t, "force_generic_plan", show(tx))
		return nil
	}))
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		require.Equal(t, "auto", show(tx))
		return nil
	}))
}

// TestDeadLetterOutbox: a taken row dead-lettered in the taking transaction
// leaves the outbox for outbox_dead_letters, with its subject, payload,
// creation time and the reason, when that transaction commits; a rollback
// puts it back in the outbox and sets nothing aside.
func TestDeadLetterOutbox(t *testing.T) {
	db := storetest.New(t, nil)
	ctx := t.Context()
	require.NoError(t, db.InTx(ctx, func(tx pgx.Tx) error {
		return store.Enqueue(ctx, tx, db.Now(), "t.poison", []byte("payload"))
	}))
	setAside := func(commit bool) store.OutboxMessage {
		t.Helper()
		var m store.OutboxMessage
		err := db.InTx(ctx, func(tx pgx.Tx) error {
			got, err := store.TakeOutbox(ctx, tx, 0, 10)
			if err != nil {
				return err
			}
			require.Len(t, got, 1)
			m = got[0]
			if err := store.DeadLetterOutbox(ctx, tx, db.Now(), m, "too large"); err != nil {
				return err
			}
			if !commit {
				return errRollback
			}
			return nil
		})
		if commit {
			require.NoError(t, err)
		} else {
			require.ErrorIs(t, err, errRollback)
		}
		return m
	}

	setAside(false)
	require.Equal(t, 1, countRows(t, db, `SELECT count(*) FROM outbox`), "rolled back: the row is in the outbox again")
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM outbox_dead_letters`))

	m := setAside(true)
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM outbox`))
	var (
		id              int64
		subject         string
		payload         []byte
		created, deadAt time.Time
		reason          string
	)
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT outbox_id, subject, payload, created_at, dead_at, reason
		FROM outbox_dead_letters`).Scan(&id, &subject, &payload, &created, &deadAt, &reason))
	require.Equal(t, m.ID, id)
	require.Equal(t, "t.poison", subject)
	require.Equal(t, "payload", string(payload))
	require.False(t, m.CreatedAt.IsZero())
	require.True(t, m.CreatedAt.Equal(created), "%v %v", m.CreatedAt, created)
	require.False(t, deadAt.Before(created))
	require.Equal(t, "too large", reason)
}
