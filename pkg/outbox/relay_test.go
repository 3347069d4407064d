package outbox_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

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
// commit's NOTIFY, long before the 1 h poll) and is marked published; one
// written in a rolled-back transaction never leaves.
func TestRelayPublishesCommittedRowsOnly(t *testing.T) {
	db := storetest.New(t, nil)
	srv, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)
	nc, err := nats.Connect(srv.ClientURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	sub, err := nc.SubscribeSync("test.>")
	require.NoError(t, err)
	require.NoError(t, nc.Flush())

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	relay := &outbox.Relay{DB: db, NC: nc, Logger: telemetry.Discard(), Clock: clock.New(), Poll: time.Hour}
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})

	rollback := errors.New("roll back")
	err = db.InTx(t.Context(), func(tx pgx.Tx) error {
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
	require.Eventually(t, func() bool {
		var unpublished int
		err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox WHERE published_at IS NULL`).Scan(&unpublished)
		return err == nil && unpublished == 0
	}, 10*time.Second, 20*time.Millisecond)
	_, err = sub.NextMsg(200 * time.Millisecond)
	require.ErrorIs(t, err, nats.ErrTimeout, "the rolled-back message is never published")
}
