// Package outbox publishes the outbox table to NATS: the relay takes (deletes)
// a batch of the rows that committed transactions wrote, publishes each to
// its subject, flushes, and only then commits, so a row costs one insert and
// one delete; a failed publish rolls the delete back and the rows wait for
// the next pass. It wakes on store.SubjectOutboxWritten (published after
// commit by writers given store.DB.SignalOutboxVia) and on the commit-time
// NOTIFY of store.OutboxChannel (the others, or when publishing fails), and
// also polls, so a missed signal only delays. Several relays may
// run: rows are taken with FOR UPDATE SKIP LOCKED, and a message may be
// published more than once (a commit lost after the flush; pokes and events
// are idempotent hints to their readers).
package outbox

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/store"
)

// Relay moves outbox rows to NATS.
type Relay struct {
	DB     *store.DB
	NC     *nats.Conn
	Logger *slog.Logger
	Clock  clock.Clock
	// Poll is how often the relay looks without a notification; 1 s if zero.
	Poll time.Duration
	// Batch is how many rows one pass takes; 500 if zero.
	Batch int
}

// straggleWindow is how far below the highest id it took a relay woken by a
// signal looks (store.TakeOutbox's after): ids are drawn when rows are
// inserted, so a transaction may commit rows below ids already taken, and
// those are in flight at most a few pool-fulls of batches (hundreds of ids)
// behind. A row further behind waits for the next poll, which reads from
// the oldest id.
const straggleWindow = 4096

// Name returns "outbox relay" (service.Runner).
func (r *Relay) Name() string { return "outbox relay" }

// Run relays until ctx ends.
func (r *Relay) Run(ctx context.Context) error {
	if r.Poll == 0 {
		r.Poll = time.Second
	}
	if r.Batch == 0 {
		r.Batch = 500
	}
	wake := make(chan struct{}, 1)
	signal := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	sub, err := r.NC.Subscribe(store.SubjectOutboxWritten, func(*nats.Msg) { signal() })
	if err != nil {
		r.Logger.Warn("outbox relay: subscribe to the write signal; NOTIFY and polling only", "err", err)
	} else {
		defer func() { _ = sub.Unsubscribe() }()
	}
	go r.listen(ctx, wake)
	tick := r.Clock.NewTicker(r.Poll)
	defer tick.Stop()
	var last int64 // the highest id taken
	full := true   // read from the oldest id: at start and on each poll
	for {
		for {
			after := int64(0)
			if !full {
				after = max(0, last-straggleWindow)
			}
			n, top, err := r.drainOnce(ctx, after)
			last = max(last, top)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				r.Logger.Warn("outbox relay pass failed", "err", err)
				break
			}
			if n < r.Batch {
				break
			}
		}
		full = false
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-tick.C():
			full = true
		}
	}
}

// drainOnce publishes one batch of the rows with ids above after and returns
// how many rows it published and the highest id among them. The rows are
// deleted in the transaction that publishes them, which commits only after
// NATS has flushed them; on any error it rolls back and the rows stay for
// the next pass.
func (r *Relay) drainOnce(ctx context.Context, after int64) (n int, top int64, err error) {
	err = r.DB.InGenericTx(ctx, func(tx pgx.Tx) error {
		msgs, err := store.TakeOutbox(ctx, tx, after, r.Batch)
		if err != nil || len(msgs) == 0 {
			return err
		}
		for _, m := range msgs {
			if err := r.NC.Publish(m.Subject, m.Payload); err != nil {
				return err
			}
		}
		if err := r.NC.FlushTimeout(5 * time.Second); err != nil {
			return err
		}
		n, top = len(msgs), msgs[len(msgs)-1].ID
		return nil
	})
	if err != nil {
		return 0, 0, err
	}
	return n, top, nil
}

// listen holds a LISTEN connection and signals wake on every notification;
// it reconnects after errors until ctx ends.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		r.Logger.Warn("outbox listen failed", "err", err)
		_ = clock.Sleep(ctx, r.Clock, time.Second)
	}
}

func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	conn, err := r.DB.Pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "LISTEN "+store.OutboxChannel); err != nil {
		return err
	}
	// Rows committed while nothing listened (before the first LISTEN, or
	// between a lost connection and this one) sent their NOTIFY to no one:
	// drain once now that notifications are heard.
	select {
	case wake <- struct{}{}:
	default:
	}
	defer func() {
		_, _ = conn.Exec(context.WithoutCancel(ctx), "UNLISTEN *")
	}()
	for {
		_, err := conn.Conn().WaitForNotification(ctx)
		if err != nil {
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		}
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}
