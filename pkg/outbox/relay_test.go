package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/better-compute/better-compute/pkg/bus/bustest"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/outbox"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

func TestMain(m *testing.M) {
	code := m.Run()
	storetest.Stop()
	os.Exit(code)
}

// TestRelayPublishesCommittedRowsOnly checks the outbox contract: a message
// written in a committed transaction reaches NATS promptly (woken by the
// commit's NOTIFY, long before the 1 h poll) and its row is deleted; one
// written in a rolled-back transaction never leaves.
func TestRelayPublishesCommittedRowsOnly(t *testing.T) {
	db := storetest.New(t, nil)
	nc, sub := natsServer(t)

	runRelay(t, &outbox.Relay{DB: db, NC: nc, Logger: telemetry.Discard(), Clock: clock.New(), Poll: time.Hour})

	rollback := errors.New("roll back")
	err := db.InTx(t.Context(), func(tx pgx.Tx) error {
		require.NoError(t, store.Enqueue(t.Context(), tx, db.Now(), "test.rolled-back", []byte("no")))
		return rollback
	})
	require.ErrorIs(t, err, rollback)
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		return store.Enqueue(t.Context(), tx, db.Now(), "test.committed", []byte("yes"))
	}))

	msg, err := sub.NextMsg(10 * time.Second)
	require.NoError(t, err)
	require.Equal(t, "test.committed", msg.Subject)
	require.Equal(t, "yes", string(msg.Data))
	require.Eventually(t, func() bool { return outboxRows(t.Context(), db) == 0 }, 10*time.Second, 20*time.Millisecond,
		"the published row is deleted")
	_, err = sub.NextMsg(200 * time.Millisecond)
	require.ErrorIs(t, err, nats.ErrTimeout, "the rolled-back message is never published")
}

// natsServer starts an embedded NATS server for t and returns a connection
// to it and a subscription of "test.>" on it.
func natsServer(t *testing.T) (*nats.Conn, *nats.Subscription) {
	t.Helper()
	srv, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)
	return subscribeTest(t, srv.ClientURL())
}

// subscribeTest connects to the NATS server at url for t and subscribes to
// "test.>".
func subscribeTest(t *testing.T, url string) (*nats.Conn, *nats.Subscription) {
	t.Helper()
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	sub, err := nc.SubscribeSync("test.>")
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	return nc, sub
}

// runRelay runs r until t ends, and then requires that it returned nil.
func runRelay(t *testing.T, r *outbox.Relay) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

// outboxRows counts the outbox rows, -1 on error (for Eventually).
func outboxRows(ctx context.Context, db *store.DB) int {
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil {
		return -1
	}
	return n
}

// failures is a slog.Handler counting the relay's failed passes.
type failures struct{ n atomic.Int64 }

func (f *failures) Enabled(context.Context, slog.Level) bool { return true }
func (f *failures) Handle(_ context.Context, r slog.Record) error {
	if r.Message == "outbox relay pass failed" {
		f.n.Add(1)
	}
	return nil
}
func (f *failures) WithAttrs([]slog.Attr) slog.Handler { return f }
func (f *failures) WithGroup(string) slog.Handler      { return f }

// TestRelayKeepsRowsWhenPublishFails: a relay whose NATS connection is
// closed fails its pass and rolls back, so the rows stay; a working relay
// then publishes them and deletes them.
func TestRelayKeepsRowsWhenPublishFails(t *testing.T) {
	db := storetest.New(t, nil)
	srv, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		for _, s := range []string{"test.a", "test.b"} {
			if err := store.Enqueue(t.Context(), tx, db.Now(), s, []byte(s)); err != nil {
				return err
			}
		}
		return nil
	}))

	closed, err := nats.Connect(srv.ClientURL())
	require.NoError(t, err)
	closed.Close()
	var failed failures
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	broken := &outbox.Relay{DB: db, NC: closed, Logger: slog.New(&failed), Clock: clock.New(), Poll: time.Hour}
	go func() { done <- broken.Run(ctx) }()
	require.Eventually(t, func() bool { return failed.n.Load() > 0 }, 10*time.Second, 10*time.Millisecond,
		"the relay with a closed connection never failed a pass")
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, 2, outboxRows(t.Context(), db), "a failed publish leaves the rows")
	require.Empty(t, deadLetters(t, db), "a closed connection sets no row aside")

	nc, sub := subscribeTest(t, srv.ClientURL())
	ctx, cancel = context.WithCancel(t.Context())
	relay := &outbox.Relay{DB: db, NC: nc, Logger: telemetry.Discard(), Clock: clock.New(), Poll: time.Hour}
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	for _, want := range []string{"test.a", "test.b"} {
		msg, err := sub.NextMsg(10 * time.Second)
		require.NoError(t, err)
		require.Equal(t, want, msg.Subject, "published in id order")
		require.Equal(t, want, string(msg.Data))
	}
	require.Eventually(t, func() bool { return outboxRows(t.Context(), db) == 0 }, 10*time.Second, 20*time.Millisecond,
		"the published rows are deleted")
}

// TestRelayWakesOnTheWriteSignal: a row whose writer signals the relays over
// NATS (store.DB.SignalOutboxVia), not with a NOTIFY, is published at once,
// long before the 1 h poll.
func TestRelayWakesOnTheWriteSignal(t *testing.T) {
	db := storetest.New(t, nil)
	nc, sub := natsServer(t)
	var signals atomic.Int64
	db.SignalOutboxVia(func() error {
		signals.Add(1)
		return nc.Publish(store.SubjectOutboxWritten, nil)
	})

	runRelay(t, &outbox.Relay{DB: db, NC: nc, Logger: telemetry.Discard(), Clock: clock.New(), Poll: time.Hour})
	// The relay drains once when it starts listening; a row it published
	// shows that it runs (and has subscribed: it subscribes first).
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		return store.Enqueue(t.Context(), tx, db.Now(), "test.first", nil)
	}))
	msg, err := sub.NextMsg(10 * time.Second)
	require.NoError(t, err)
	require.Equal(t, "test.first", msg.Subject)

	require.Equal(t, int64(1), signals.Load(), "the committed Enqueue signalled once")

	// Rows written with no NOTIFY at all, each followed by the NATS signal
	// alone. The relay's one wake-up when it starts listening may serve one
	// of them (it can come late); not three. Raw SQL: store.Enqueue always
	// signals.
	for i := range 3 {
		subject := fmt.Sprintf("test.signalled.%d", i)
		_, err = db.Pool.Exec(t.Context(), `INSERT INTO outbox (subject, payload, created_at) VALUES ($1, '', now())`, subject)
		require.NoError(t, err)
		require.NoError(t, nc.Publish(store.SubjectOutboxWritten, nil))
		msg, err = sub.NextMsg(10 * time.Second)
		require.NoError(t, err, "woken by the signal, not the hourly poll")
		require.Equal(t, subject, msg.Subject)
	}
}

// TestRelayPublishesStragglers: rows that commit with ids below ones the
// relay already took are published — just below at once (the relay looks a
// window back when signalled), far below at the next poll (which reads from
// the oldest id); each message names its row (store.OutboxIDHeader).
func TestRelayPublishesStragglers(t *testing.T) {
	db := storetest.New(t, nil)
	nc, sub := natsServer(t)
	db.SignalOutboxVia(func() error { return nc.Publish(store.SubjectOutboxWritten, nil) })
	_, err := db.Pool.Exec(t.Context(), `SELECT setval('outbox_id_seq', 100000)`)
	require.NoError(t, err)

	runRelay(t, &outbox.Relay{DB: db, NC: nc, Logger: telemetry.Discard(), Clock: clock.New(), Poll: 500 * time.Millisecond})
	next := func(want string, id int64) {
		t.Helper()
		msg, err := sub.NextMsg(10 * time.Second)
		require.NoError(t, err)
		require.Equal(t, want, msg.Subject)
		require.Equal(t, strconv.FormatInt(id, 10), msg.Header.Get(store.OutboxIDHeader))
	}
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		return store.Enqueue(t.Context(), tx, db.Now(), "test.high", nil)
	}))
	next("test.high", 100001) // the relay has taken it
	for _, s := range []struct {
		id      int64
		subject string
	}{{100001 - 10, "test.near"}, {5, "test.far"}} {
		require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
			// Raw SQL: a row with the id of a straggler, which the
			// sequence, and so store.Enqueue, never hands out late.
			if _, err := tx.Exec(t.Context(), `INSERT INTO outbox (id, subject, payload, created_at) VALUES ($1, $2, '', now())`,
				s.id, s.subject); err != nil {
				return err
			}
			return store.Enqueue(t.Context(), tx, db.Now(), s.subject+".marker", nil) // signals the commit
		}))
		got := map[string]bool{}
		for range 2 {
			msg, err := sub.NextMsg(10 * time.Second)
			require.NoError(t, err, "after %v", got)
			got[msg.Subject] = true
			if msg.Subject == s.subject {
				require.Equal(t, strconv.FormatInt(s.id, 10), msg.Header.Get(store.OutboxIDHeader))
			}
		}
		require.Equal(t, map[string]bool{s.subject: true, s.subject + ".marker": true}, got)
	}
}

// errorLogs is a slog.Handler keeping the relay's error records.
type errorLogs struct {
	mu   sync.Mutex
	msgs []string
}

func (h *errorLogs) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelError }
func (h *errorLogs) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.msgs = append(h.msgs, r.Message)
	return nil
}
func (h *errorLogs) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *errorLogs) WithGroup(string) slog.Handler      { return h }

func (h *errorLogs) messages() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.msgs)
}

// deadLetter is what the tests read of an outbox_dead_letters row.
type deadLetter struct {
	OutboxID int64
	Subject  string
	Size     int
	Reason   string
}

func deadLetters(t *testing.T, db *store.DB) []deadLetter {
	t.Helper()
	rows, err := db.Pool.Query(t.Context(), `SELECT outbox_id, subject, length(payload), reason
		FROM outbox_dead_letters ORDER BY outbox_id`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[deadLetter])
	require.NoError(t, err)
	return out
}

// TestRelaySetsAsidePoisonRows: a row that NATS can never take (a payload
// of 2 MiB, above the server's 1 MiB max payload; a subject that is not
// one) is moved to outbox_dead_letters with its reason, counted and logged
// as an error, and the rows after it, in the same pass, are published.
func TestRelaySetsAsidePoisonRows(t *testing.T) {
	db := storetest.New(t, nil)
	nc, sub := natsServer(t)
	reader := sdkmetric.NewManualReader()
	prev := otel.GetMeterProvider()
	otel.SetMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)))
	t.Cleanup(func() { otel.SetMeterProvider(prev) })

	big := bytes.Repeat([]byte("x"), 2<<20)
	require.Greater(t, int64(len(big)), nc.MaxPayload())
	var ids []int64
	require.NoError(t, db.InTx(t.Context(), func(tx pgx.Tx) error {
		for _, m := range []struct {
			subject string
			payload []byte
		}{{"test.big", big}, {"test.bad subject", []byte("x")}, {"test.small", []byte("small")}} {
			if err := store.Enqueue(t.Context(), tx, db.Now(), m.subject, m.payload); err != nil {
				return err
			}
		}
		return tx.QueryRow(t.Context(), `SELECT array_agg(id ORDER BY id) FROM outbox`).Scan(&ids)
	}))

	logs := &errorLogs{}
	runRelay(t, &outbox.Relay{DB: db, NC: nc, Logger: slog.New(logs), Clock: clock.New(), Poll: time.Hour})

	msg, err := sub.NextMsg(10 * time.Second)
	require.NoError(t, err)
	require.Equal(t, "test.small", msg.Subject, "the row after the poison ones is published")
	require.Equal(t, "small", string(msg.Data))
	require.Eventually(t, func() bool { return outboxRows(t.Context(), db) == 0 }, 10*time.Second, 20*time.Millisecond,
		"every row left the outbox")
	dead := deadLetters(t, db)
	require.Len(t, dead, 2)
	require.Equal(t, deadLetter{OutboxID: ids[0], Subject: "test.big", Size: 2 << 20, Reason: dead[0].Reason}, dead[0])
	require.Contains(t, dead[0].Reason, "max payload")
	require.Equal(t, deadLetter{OutboxID: ids[1], Subject: "test.bad subject", Size: 1, Reason: dead[1].Reason}, dead[1])
	require.Contains(t, dead[1].Reason, "subject")
	// Counted, then logged, after the pass's commit, which the reads above
	// may see first.
	require.Eventually(t, func() bool { return len(logs.messages()) >= 2 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"outbox row set aside", "outbox row set aside"}, logs.messages())

	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(t.Context(), &rm))
	counts := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "bc.outbox.dead_letters" {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				cause, _ := dp.Attributes.Value("cause")
				counts[cause.AsString()] += dp.Value
			}
		}
	}
	require.Equal(t, map[string]int64{"max_payload": 1, "bad_subject": 1}, counts)

	_, err = sub.NextMsg(200 * time.Millisecond)
	require.ErrorIs(t, err, nats.ErrTimeout, "the poison rows are never published")
}
